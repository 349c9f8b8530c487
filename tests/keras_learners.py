"""The strategy of the tests of use_sma's Keras conventions (tests/test_keras_*.py)."""
from crossbow_tf import CrossbowStrategy


def four_learners(cpu_devices):
    """4 learners on one device: what those tests check is per step and per learner, and a second
    device would only trace each step again (a third of their CPU); across devices: tests/test_devices.py."""
    return CrossbowStrategy(devices=cpu_devices[:1], learners_per_device=4)
