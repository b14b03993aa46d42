"""Paired bootstrap intervals: exact where the answer is known, paired where pairing matters."""

import numpy as np
import pytest

from nsa_eval.report.bootstrap import paired_bootstrap


def test_identical_methods_have_a_zero_interval():
    a = np.array([1.0, 0.0, 1.0, 1.0, 0.0])
    assert paired_bootstrap([a], [a.copy()], iters=200) == (0.0, 0.0, 0.0)


def test_a_constant_shift_is_measured_exactly():
    a = np.linspace(0, 1, 40)
    diff, low, high = paired_bootstrap([a], [a + 0.25], iters=300)
    assert diff == pytest.approx(0.25) and low == pytest.approx(0.25) and high == pytest.approx(0.25)


def test_pairing_removes_document_difficulty():
    """Scores that vary a lot by document but move together: the paired interval is narrow and
    excludes 0, where an unpaired comparison of the two means could not tell them apart."""
    rng = np.random.default_rng(1)
    difficulty = rng.uniform(0, 1, 200)
    a, b = difficulty, difficulty + 0.02 + rng.normal(0, 0.005, 200)
    diff, low, high = paired_bootstrap([a], [b], iters=1000)
    assert 0 < low < diff < high and high - low < 0.01


def test_several_subtasks_average_their_means_and_interval_covers_truth():
    rng = np.random.default_rng(0)
    a = [rng.binomial(1, 0.5, 300).astype(float), rng.binomial(1, 0.5, 50).astype(float)]
    b = [x.copy() for x in a]
    b[0][:30] = 1 - b[0][:30]  # flips on the big subtask only
    diff, low, high = paired_bootstrap(a, b, iters=2000, seed=3)
    expected = np.mean([(b[0] - a[0]).mean(), 0.0])  # unweighted mean of subtask means
    assert diff == pytest.approx(expected)
    assert low <= diff <= high
    assert paired_bootstrap(a, b, iters=2000, seed=3) == (diff, low, high)  # seeded: reproducible


def test_empty_input_is_an_error():
    with pytest.raises(ValueError):
        paired_bootstrap([np.array([])], [np.array([])])


def test_size_weights_give_the_pooled_mean_of_all_documents():
    """weights proportional to the subtask sizes: the statistic is lm-eval's weight_by_size group
    score, the mean over all documents pooled, and its interval is around it."""
    rng = np.random.default_rng(2)
    a = [rng.binomial(1, 0.5, 40).astype(float), rng.binomial(1, 0.5, 160).astype(float)]
    b = [x.copy() for x in a]
    b[1][:40] = 1 - b[1][:40]
    diff, low, high = paired_bootstrap(a, b, iters=1000, weights=[40, 160])
    assert diff == pytest.approx((np.concatenate(b) - np.concatenate(a)).mean())
    assert low <= diff <= high
    equal = paired_bootstrap(a, b, iters=1000)
    assert equal[0] == pytest.approx(np.mean([(y - x).mean() for x, y in zip(a, b, strict=True)]))


@pytest.mark.parametrize("iters", [0, -5])
def test_no_resamples_is_an_error(iters):
    with pytest.raises(ValueError, match="iters >= 1"):
        paired_bootstrap([np.array([1.0])], [np.array([0.0])], iters=iters)


def test_weights_must_match_the_subtasks():
    with pytest.raises(ValueError, match="weight per subtask"):
        paired_bootstrap([np.array([1.0])], [np.array([0.0])], weights=[1.0, 2.0])
