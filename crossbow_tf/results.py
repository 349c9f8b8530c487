"""One results format for every run (SMA or baseline): what the tools read.

A run is a JSON file: method, configuration, environment, and per evaluation the training wall time
(evaluation excluded, tracing included once: a resumed run leaves out its step's tracing again and
records it as ``retrace_times``), epoch, iteration, examples seen, test accuracy and loss of the
evaluated model (z for SMA). A run stopped by a NaN holds ``diverged`` (exit code 3), one stopped at
chance accuracy ``collapsed`` (exit code 5).
"""
import json
import math
import os
import platform
import time

from crossbow_tf.files import atomic_write_text

# Every evaluation holds at least these; tools may rely on them (more keys are allowed).
EVALUATION_KEYS = ("epoch", "iteration", "examples", "wall_time", "accuracy", "loss")
RUN_KEYS = ("method", "config", "environment", "evaluations")


def format_problems(d):
    """What makes mapping D (a loaded results file) not a valid run; an empty list when it is one."""
    if not isinstance(d, dict):
        return [f"expected a JSON object, got {type(d).__name__}"]
    problems = [f"missing key {k!r}" for k in RUN_KEYS if k not in d]
    evaluations = d.get("evaluations", [])
    if not isinstance(evaluations, list):
        return problems + ["evaluations: expected a list"]
    previous = -float("inf")
    for i, e in enumerate(evaluations):
        missing = [k for k in EVALUATION_KEYS if not isinstance(e, dict) or k not in e]
        if missing:
            problems.append(f"evaluations[{i}]: missing {', '.join(missing)}")
            continue
        if not e["wall_time"] >= previous:
            problems.append(f"evaluations[{i}]: wall_time {e['wall_time']} goes backwards")
        previous = e["wall_time"]
    return problems


def json_safe(value):
    """VALUE with every non-finite float replaced by None (JSON has no NaN), containers copied."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    if hasattr(value, "item") and getattr(value, "shape", None) == ():   # NumPy scalars
        return json_safe(value.item())
    return value


def environment():
    import keras
    import tensorflow as tf
    return {
        "python": platform.python_version(),
        "tensorflow": tf.__version__,
        "keras": keras.__version__,
        "machine": platform.machine(),
        "cpu_count": os.cpu_count(),
        "logical_devices": [d.name for d in tf.config.list_logical_devices()],
        "physical_gpus": len(tf.config.list_physical_devices("GPU")),
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }


def reaches(accuracy, target, examples=None):
    """True when ACCURACY, measured on EXAMPLES test examples, reaches TARGET.

    Compared at the evaluation's own resolution, correct / total: an accuracy of 9000/10000 stored
    as float32 (0.89999998) reaches a target of 0.90. Without EXAMPLES, a plain comparison.
    """
    if accuracy is None or accuracy != accuracy:   # None or NaN never reaches
        return False
    if not examples:
        return accuracy >= target
    return round(accuracy * examples) >= math.ceil(target * examples - 1e-9)


CHANCE_MARGIN = 0.02   # "at chance": test accuracy below 1/classes + this


def at_chance(accuracy, num_classes):
    """True when ACCURACY is no better than guessing among NUM_CLASSES (a collapsed run)."""
    return accuracy < 1.0 / num_classes + CHANCE_MARGIN


def first_reaching(evaluations, target):
    """The first of EVALUATIONS (in order) whose accuracy reaches TARGET, or None.

    Time to target is measured at evaluation points, as runs are evaluated: a run that crosses the
    target mid-epoch is credited at the end of that epoch, whichever method it is.
    """
    previous = -math.inf
    for e in evaluations:
        if e["wall_time"] < previous:
            raise ValueError(f"wall_time goes backwards at epoch {e['epoch']}: {e['wall_time']} < {previous}")
        previous = e["wall_time"]
        if reaches(e["accuracy"], target, e.get("test_examples")):
            return e
    return None


def time_to_target(evaluations, target):
    """(wall_time, epoch) of the first evaluation reaching TARGET, or None."""
    hit = first_reaching(evaluations, target)
    return None if hit is None else (hit["wall_time"], hit["epoch"])


def collapse_stop(results):
    """The TrainingCollapsed a command exits with (exit code 5) when the collapse rule stopped
    RESULTS (a RunResults: extra["collapsed"]), else None. Its results are written as any run's."""
    if not results.extra.get("collapsed"):
        return None
    from crossbow_tf.errors import TrainingCollapsed
    last = results.evaluations[-1] if results.evaluations else {}
    epochs = results.config.get("collapse_epochs")
    return TrainingCollapsed(f"collapsed: test accuracy at chance for {epochs if epochs else 'several'} epochs after "
                             f"the first ({last.get('accuracy', float('nan')):.4f} at epoch {last.get('epoch')}); "
                             "stopped without reaching the target", results)


class RunResults:
    def __init__(self, method, config=None, env=None, evaluations=None, **extra):
        self.method = method
        self.config = config or {}
        self.environment = env if env is not None else environment()
        self.evaluations = evaluations or []
        self.extra = extra

    def add_evaluation(self, *, epoch, iteration, examples, wall_time, accuracy, loss, **more):
        self.evaluations.append(dict(epoch=epoch, iteration=iteration, examples=examples,
                                     wall_time=wall_time, accuracy=accuracy, loss=loss, **more))

    def time_to_accuracy(self, target):
        """Training wall time at the first evaluation reaching TARGET, or None."""
        hit = self.first_reaching(target)
        return None if hit is None else hit["wall_time"]

    def epochs_to_accuracy(self, target):
        hit = self.first_reaching(target)
        return None if hit is None else hit["epoch"]

    def first_reaching(self, target):
        return first_reaching(self.evaluations, target)

    def target_summary(self, target):
        """One line: the time and epochs to TARGET, or that it was not reached."""
        hit = self.first_reaching(target)
        if hit is None:
            return (f"target accuracy {target:.2%} not reached in {len(self.evaluations)} epochs "
                    f"(best {self.best_accuracy:.2%})")
        return f"time to {target:.2%} test accuracy: {hit['wall_time']:.2f}s of training ({hit['epoch']} epochs)"

    @property
    def best_accuracy(self):
        return max((e["accuracy"] for e in self.evaluations), default=None)

    def to_dict(self):
        return dict(method=self.method, config=self.config, environment=self.environment,
                    evaluations=self.evaluations, **self.extra)

    def save(self, path):
        """Writes the run atomically (a crash never leaves half a file)."""
        atomic_write_text(path, json.dumps(json_safe(self.to_dict()), indent=1, allow_nan=False))   # null, never NaN

    @classmethod
    def load(cls, path):
        with open(path) as f:
            d = json.load(f)
        return cls(d.pop("method"), d.pop("config"), d.pop("environment"), d.pop("evaluations"), **d)
