"""The patience of a worker waiting for its peers (crossbow_tf.distribute.cluster), without servers.

TensorFlow's peer-health probe shares the peers' gRPC connection with the collectives' data, so
behind a slow link it can go unanswered for its 2 s while the peer is alive and sending (issue 29's
100 Mbit/s runs). A peer that is gone is lost at once; one that only fails to answer in time is
lost once it has been silent for the worker timeout.
"""
import threading
import time

import numpy as np
import pytest

from crossbow_tf.distribute import cluster as cluster_lib
from crossbow_tf.distribute.cluster import Cluster, ClusterError, local_tf_configs


def cluster_with_peer(monkeypatch, answers, timeout):
    """Worker 0 of 2 whose probe of worker 1 gives ANSWERS' values in turn (the last one repeated)."""
    monkeypatch.setenv("TF_CONFIG", local_tf_configs(2)[0])
    cluster = cluster_lib.from_environment(timeout=timeout)
    answers = list(answers)
    probes = []

    def probe(worker):
        probes.append(worker)
        return answers.pop(0) if len(answers) > 1 else answers[0]
    monkeypatch.setattr(cluster, "_probe", probe)
    return cluster, probes


def test_a_peer_that_misses_probes_is_lost_only_after_the_worker_timeout(monkeypatch):
    cluster, probes = cluster_with_peer(monkeypatch, [Cluster.HUNG], timeout=0.4)
    silent_since = {}
    assert cluster._lost_workers(silent_since) == []
    assert set(silent_since) == {1}
    time.sleep(0.5)
    lost = cluster._lost_workers(silent_since)
    assert lost == [f"{cluster.describe(1)} does not respond: answered no probe for 0.4 s (hung)"]
    assert probes == [1, 1]


def test_an_answer_resets_the_silence(monkeypatch):
    cluster, _ = cluster_with_peer(monkeypatch, [Cluster.HUNG, None, Cluster.HUNG], timeout=0.4)
    silent_since = {}
    assert cluster._lost_workers(silent_since) == []
    time.sleep(0.5)
    assert cluster._lost_workers(silent_since) == [] and silent_since == {}   # it answered
    assert cluster._lost_workers(silent_since) == []                          # silent anew, not for 0.4 s


def test_a_peer_that_is_gone_is_lost_at_once_and_one_shot_diagnosis_reports_a_missed_probe(monkeypatch):
    gone = "does not answer (not running)"
    cluster, _ = cluster_with_peer(monkeypatch, [gone], timeout=60)
    assert cluster._lost_workers({}) == [f"{cluster.describe(1)} {gone}"]
    # After a failed collective (the step's all-reduce past its timeout) one probe decides.
    cluster, _ = cluster_with_peer(monkeypatch, [Cluster.HUNG], timeout=60)
    assert cluster._lost_workers() == [f"{cluster.describe(1)} {Cluster.HUNG}"]


def test_an_agreement_waits_for_a_slow_collective_whose_peer_misses_probes(monkeypatch):
    cluster, probes = cluster_with_peer(monkeypatch, [Cluster.HUNG], timeout=60)

    class Slow:   # the collective's result, ready after more than one probe's wait
        def numpy(self):
            time.sleep(2.5)
            return np.array([7])
    assert cluster._eager(lambda key, device: Slow()).tolist() == [7]
    assert probes, "the wait probed the peer"


def test_an_agreement_stops_when_the_peer_stays_silent_for_the_worker_timeout(monkeypatch):
    cluster, _ = cluster_with_peer(monkeypatch, [Cluster.HUNG], timeout=0.5)
    aborted = []
    monkeypatch.setattr(cluster, "_abort_collectives", lambda reason: aborted.append(reason))
    never = threading.Event()

    class Never:
        def numpy(self):
            never.wait(30)
            return np.array([0])
    with pytest.raises(ClusterError, match=r"answered no probe for 0.5 s \(hung\); .* stops"):
        cluster._eager(lambda key, device: Never())
    never.set()
    assert aborted and "answered no probe for 0.5 s" in aborted[0]
