"""A failed trial's reason is the training process's error line, not what TensorFlow logs after it."""
import io
import subprocess
import sys

from crossbow_tf.compare import launch


def started(index, script):
    popen = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             text=True, bufsize=1)
    return launch.Process(index, popen, io.StringIO())


def test_the_reason_is_the_error_line_even_with_tensorflow_logs_after_it_or_glued_to_it():
    chief = started(0, "import sys; print('epoch 1'); "
                       "print('crossbow_tf: error: lost worker 1 (worker:1 at h:1) does not answer (not running); "
                       "worker 0 stops'); "
                       "print('WARNING:tensorflow:Value in checkpoint could not be found: (root).save_counter'); "
                       "sys.exit(4)")
    other = started(1, "import sys; "
                       "print('crossbow_tf: error: lost worker 0 (worker:0 at h:0) does not respond within 2 s (hung); "
                       "worker 1 stopsE0000 00:00:1796381592.952851   20512 ring_alg.cc:291] Aborting RingReduce'); "
                       "sys.exit(4)")
    error = launch.supervise([chief, other], timeout=60)
    code, error = launch.outcome([chief, other], error)
    assert code == 4
    assert error == ("lost a worker (worker 0 4, worker 1 4): exit code 4: crossbow_tf: error: lost worker 1 "
                     "(worker:1 at h:1) does not answer (not running); worker 0 stops")
    assert other.reason() == ("crossbow_tf: error: lost worker 0 (worker:0 at h:0) does not respond within 2 s "
                              "(hung); worker 1 stops")
    assert "save_counter" in chief.log.getvalue()   # the log keeps every line


def test_without_an_error_line_the_reason_is_the_last_line_printed():
    proc = started(0, "import sys; print('Traceback (most recent call last):'); print('ValueError: bad'); "
                      "print(''); sys.exit(1)")
    code, error = launch.outcome([proc], launch.supervise([proc], timeout=60))
    assert (code, error) == (1, "exit code 1: ValueError: bad")
