"""Learning-rate schedules by iteration: optional linear warm-up, then step drops."""
import bisect


class StepSchedule:
    """lr(t) = BASE * FACTOR**(drops passed), after a linear warm-up over WARMUP iterations.

    DROPS are iteration indices: from iteration DROPS[i] on, the rate is multiplied by FACTOR once more.
    """

    def __init__(self, base, drops=(), factor=0.1, warmup=0):
        self.base, self.drops, self.factor, self.warmup = float(base), sorted(drops), float(factor), int(warmup)

    def __call__(self, iteration):
        lr = self.base * self.factor ** bisect.bisect_right(self.drops, iteration)
        if self.warmup and iteration < self.warmup:
            lr *= (iteration + 1) / self.warmup
        return lr

    @classmethod
    def from_epochs(cls, base, drops_at_epochs, factor, warmup_epochs, iterations_per_epoch):
        return cls(base, [round(e * iterations_per_epoch) for e in drops_at_epochs], factor,
                   round(warmup_epochs * iterations_per_epoch))


def is_drop(schedule, iteration):
    """True when the rate at ITERATION is lower than at the one before (a step boundary)."""
    return iteration > 0 and schedule(iteration) < schedule(iteration - 1)
