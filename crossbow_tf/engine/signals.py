"""SIGINT and SIGTERM as a clean stop: at the next iteration boundary, after a checkpoint.

Schedulers (Slurm, Kubernetes) send SIGTERM some time before they kill a job; a user presses
Ctrl-C. Either way the trainer finishes the iteration it is in, writes a checkpoint and stops.
"""
import os
import signal
import sys

from crossbow_tf.errors import TrainingInterrupted


class StopSignals:
    """Within ``with StopSignals() as stop:``, SIGINT and SIGTERM ask for a stop.

    While ``stop.deferred`` is true (the trainer sets it around its loop) the first signal is only
    recorded: the trainer stops at the next iteration boundary, writes a checkpoint and raises
    TrainingInterrupted. Otherwise (start-up, tuning) it raises TrainingInterrupted at once. A second
    SIGINT exits the process at once, with exit code 130 and one line.
    """

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self, prog="crossbow_tf"):
        self.prog, self.received, self.deferred, self._previous = prog, None, False, {}

    def __enter__(self):
        for s in self.SIGNALS:
            self._previous[s] = signal.signal(s, self._handle)
        return self

    def __exit__(self, *exc):
        for s, handler in self._previous.items():
            signal.signal(s, handler)
        return False

    def _handle(self, signum, frame):
        if self.received is not None:
            if signum == signal.SIGINT:
                sys.stderr.write(f"{self.prog}: interrupted again: exiting now, without a checkpoint\n")
                sys.stderr.flush()
                os._exit(130)
            return
        self.received = signum
        if not self.deferred:
            raise TrainingInterrupted(signum)
        sys.stderr.write(f"{self.prog}: {signal.Signals(signum).name} received: stopping at the end of this "
                         "iteration (interrupt again to exit at once)\n")
        sys.stderr.flush()
