"""Errors that reach the user as one clear line (exit code 2), never as a traceback."""


class CrossbowError(Exception):
    """Base class of errors caused by user input (configuration, data, arguments)."""


class ConfigError(CrossbowError):
    """An experiment configuration is invalid."""


class DataError(CrossbowError):
    """A data set file is missing or malformed."""
