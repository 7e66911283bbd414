"""The statistics the paired benchmark rests its verdicts on."""

import random

from benchmarks.paired import median_interval


def test_median_interval_is_the_binomial_order_statistics():
    values = list(range(16, 0, -1))
    # Binomial(16, 1/2): P(X <= 3) = 0.011 <= 0.025 < P(X <= 4) = 0.038, so the 4th and 13th values
    assert median_interval(values) == (4, 13)
    # Binomial(5, 1/2): P(X = 0) = 0.031 > 0.025, so nothing narrower than the whole range
    assert median_interval([3.0, 1.0, 2.0, 5.0, 4.0]) == (1.0, 5.0)
    assert median_interval([2.0]) == (2.0, 2.0)


def test_median_interval_covers_the_true_median_as_often_as_it_claims():
    rng = random.Random(0)
    trials, covered = 4000, 0
    for _ in range(trials):
        low, high = median_interval([rng.expovariate(1.0) for _ in range(16)])
        covered += low <= 0.6931471805599453 <= high  # the exponential's median, ln 2
    assert 0.96 <= covered / trials <= 0.995  # exactly 1 - 2 * 0.0106 = 0.979 for 16 values
