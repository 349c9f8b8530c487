"""Errors that reach the user as one clear line (exit code 2), never as a traceback."""


class CrossbowError(Exception):
    """Base class of errors caused by user input (configuration, data, arguments)."""


class ConfigError(CrossbowError, ValueError):
    """An experiment configuration or an argument of the Python API is invalid."""


class ConfigTypeError(ConfigError, TypeError):
    """A setting or argument has the wrong type."""


class DataError(CrossbowError):
    """A data set file is missing or malformed."""
