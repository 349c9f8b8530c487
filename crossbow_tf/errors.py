"""Errors that reach the user as one clear line (exit code 2), never as a traceback."""


class CrossbowError(Exception):
    """Base class of errors caused by user input (configuration, data, arguments)."""


class ConfigError(CrossbowError, ValueError):
    """An experiment configuration or an argument of the Python API is invalid."""


class ConfigTypeError(ConfigError, TypeError):
    """A setting or argument has the wrong type."""


class DataError(CrossbowError):
    """A data set file is missing or malformed."""


class CheckpointError(CrossbowError):
    """A checkpoint cannot be used: missing, damaged, or written by a different configuration."""


class TrainingStopped(Exception):
    """Training ended early on purpose; EXIT_CODE is the command's exit code."""
    exit_code = 1


class TrainingInterrupted(TrainingStopped):
    """SIGINT or SIGTERM stopped training at an iteration boundary (after writing a checkpoint)."""

    def __init__(self, signum, checkpoint=None, iteration=None, epoch=None, elsewhere=False):
        """ELSEWHERE: the signal came to another worker of the cluster (SIGNUM stands for it)."""
        import signal
        self.signum, self.checkpoint, self.iteration, self.epoch = signum, checkpoint, iteration, epoch
        self.signal_name = signal.Signals(signum).name
        self.exit_code = 128 + signum
        where = f" at iteration {iteration} (epoch {epoch})" if iteration is not None else ""
        saved = f"; checkpoint {checkpoint}" if checkpoint else "; no checkpoint written"
        cause = "a stop signal to another worker" if elsewhere else self.signal_name
        super().__init__(f"stopped by {cause}{where}{saved}")


class TrainingDiverged(TrainingStopped):
    """A loss, a learner or z became NaN or infinite (after any roll-backs allowed)."""
    exit_code = 3


class TrainingCollapsed(TrainingStopped):
    """The collapse rule stopped the run: z's test accuracy sat at chance for collapse_epochs epochs
    after the first. RESULTS: the run's results (written, like a finished run's)."""
    exit_code = 5

    def __init__(self, message, results=None):
        super().__init__(message)
        self.results = results


class DamagedFile(CheckpointError, OSError):
    """A checkpoint, backup or state file cannot be read (an OSError, as Keras's BackupAndRestore
    expects of a damaged backup before it falls back to the previous one)."""
