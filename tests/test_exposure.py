"""What a worker's TensorFlow server exposes, in the one line each worker prints when it starts
(crossbow_tf/distribute/exposure.py, issue 52); the line itself in a real 2-worker run:
tests/test_multiworker.py."""
import subprocess
import sys

from crossbow_tf.distribute.exposure import exposure_line, is_loopback, split_address


def test_loopback_names_and_addresses():
    for host in ("127.0.0.1", "127.3.2.1", "localhost", "::1", "[::1]"):
        assert is_loopback(host), host
    for host in ("10.0.0.2", "192.168.1.4", "node-a", "0.0.0.0", "fe80::1"):
        assert not is_loopback(host), host
    assert split_address("[::1]:2222") == ("::1", "2222") and split_address("node-a:2223") == ("node-a", "2223")


def test_a_cluster_across_machines_names_the_other_hosts_and_the_port():
    line = exposure_line("worker 1 (worker:1 at 10.0.0.2:2222)", "10.0.0.2:2222",
                         ["10.0.0.1:2222", "10.0.0.2:2222", "node-c:2300"])
    assert line.startswith("crossbow_tf: worker 1 (worker:1 at 10.0.0.2:2222): TensorFlow's server listens on port "
                           "2222 of every interface of this machine and accepts unauthenticated connections")
    assert "its cluster names other hosts (10.0.0.1, 10.0.0.2, node-c)" in line
    assert line.endswith("run workers on a trusted network only (docs/multiworker.md#security)")
    assert "\n" not in line


def test_a_cluster_on_loopback_still_says_the_server_binds_every_interface():
    line = exposure_line("worker 0", "127.0.0.1:40001", ["127.0.0.1:40001", "localhost:40002"])
    assert "listens on port 40001" in line and "its cluster is on this machine only, but the server binds" in line


def test_the_module_does_not_import_tensorflow():
    code = "import sys, crossbow_tf.distribute.exposure; assert 'tensorflow' not in sys.modules"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, timeout=60).returncode == 0


def test_a_storage_urls_password_is_never_printed(monkeypatch, tmp_path):
    # Issue 52: --storage takes a database URL, which may carry a password.
    import types

    import pytest

    from crossbow_tf.compare import trials
    from crossbow_tf.errors import ConfigError
    assert trials.redacted("postgresql://alice:s3cret@db.example:5432/optuna") == \
        "postgresql://alice:***@db.example:5432/optuna"
    assert trials.redacted("sqlite:///study.db") == "sqlite:///study.db"
    assert trials.redacted("journal:runs/study.log") == "journal:runs/study.log"
    with pytest.raises(ConfigError) as refused:       # a driver not installed, or a form Optuna has not
        trials.check_storage("nosuchdb+driver://alice:s3cret@db.example/optuna")
    assert "s3cret" not in str(refused.value) and "alice:***@db.example" in str(refused.value)

    def unreachable(url, heartbeat):
        raise RuntimeError(f"connection to {url} failed: password authentication failed (s3cret)")
    monkeypatch.setattr(trials, "check_storage", lambda url: None)
    monkeypatch.setattr(trials, "open_storage", unreachable)
    with pytest.raises(ConfigError) as refused:
        trials.open_given_storage(types.SimpleNamespace(storage="postgresql://alice:s3cret@db.example/optuna",
                                                        heartbeat=60))
    assert "s3cret" not in str(refused.value), refused.value
    assert str(refused.value).startswith("--storage postgresql://alice:***@db.example/optuna: cannot open it:")
