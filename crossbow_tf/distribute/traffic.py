"""What crosses the network between workers, and how long the workers wait for it (TensorFlow-free).

A ring all-reduce of N bytes over n workers sends (and receives) 2(n-1)/n x N bytes per worker
(each worker passes every chunk but its own once in the reduce-scatter and once in the all-gather).
The engine's cross-worker reduction counts its all-reduces and the seconds spent in them
(crossbow_tf/distribute/cross_worker.py); ``summary`` turns the counts into the per-iteration
figures a run's results record under ``cross_worker``.
"""


def ring_bytes(nbytes, workers):
    """Bytes one worker sends (and receives) in a ring all-reduce of NBYTES over WORKERS."""
    return 2 * (workers - 1) / workers * nbytes if workers > 1 else 0.0


def packed_bytes(variables, extra_floats=1):
    """Bytes of one float32 vector holding VARIABLES (their sizes) and EXTRA_FLOATS more values: the
    cross-worker payload of a model's weights (and BatchNorm statistics) with the loss."""
    import numpy as np
    return 4 * (sum(int(np.prod(v.shape)) for v in variables) + extra_floats)


def summary(all_reduces, payload_bytes, collective_seconds, workers, iterations, train_seconds):
    """The per-iteration figures of a multi-worker run: {iterations, all_reduces, payload_bytes,
    bytes_sent_per_worker (total), bytes_per_iteration, collective_ms_per_iteration,
    compute_ms_per_iteration (the rest of the training time), step_ms_per_iteration}; the time
    figures are None when the collective's time was not measured (COLLECTIVE_SECONDS None)."""
    sent = all_reduces * ring_bytes(payload_bytes, workers)
    per = max(iterations, 1)
    out = dict(workers=workers, iterations=iterations, all_reduces=all_reduces, payload_bytes=payload_bytes,
               bytes_sent_per_worker=sent, bytes_per_iteration=sent / per,
               step_ms_per_iteration=1000 * train_seconds / per if train_seconds is not None else None,
               collective_ms_per_iteration=None, compute_ms_per_iteration=None)
    if collective_seconds is not None and train_seconds is not None:
        out["collective_ms_per_iteration"] = 1000 * collective_seconds / per
        out["compute_ms_per_iteration"] = 1000 * max(train_seconds - collective_seconds, 0.0) / per
    return out
