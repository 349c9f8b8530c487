"""How the study report words the learners' distance to z."""
from crossbow_tf.compare.study_report import RESTARTED, distance_text


def test_local_sgd_zero_distance_says_the_learners_just_restarted_from_z():
    assert distance_text("localsgd", 0.0) == RESTARTED
    assert "restarts every learner from z" in RESTARTED


def test_a_zero_distance_of_sma_and_a_nonzero_one_of_local_sgd_are_numbers():
    assert distance_text("sma", 0.0) == "0.000"
    assert distance_text("localsgd", 1.1349) == "1.135"
    assert distance_text("localsgd", 1.1349, "{:.3g}") == "1.13"
    assert distance_text("sma", None) is None
