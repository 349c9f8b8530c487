"""Test session set-up: the CPU is split into 4 logical devices before TensorFlow starts.

TensorFlow fixes its device list once per process, so every test shares these 4 devices and picks
the subset it needs (see `cpu_devices`).
"""
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import pytest  # noqa: E402

from crossbow_tf.distribute.devices import split_cpu  # noqa: E402

NUM_TEST_DEVICES = 4
DEVICES = split_cpu(NUM_TEST_DEVICES)


@pytest.fixture
def cpu_devices():
    """The 4 logical CPU devices of the test session."""
    return list(DEVICES)
