"""LatencyHistogram: exact below the cap, within the stated relative error of numpy above it."""

import doctest
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import kvjax.metrics.latency_histogram
from kvjax.metrics.latency_histogram import LatencyHistogram

QS = np.linspace(0.0, 1.0, 101)


def filled(samples, **options):
    histogram = LatencyHistogram(**options)
    for value in samples:
        histogram.add(value)
    histogram.check_invariants()
    return histogram


def max_relative_error(histogram, samples):
    estimate = np.asarray(histogram.quantiles(QS))
    truth = np.percentile(samples, 100 * QS)
    return float(np.max(np.abs(estimate - truth) / truth))


def test_docstring_examples_hold():
    assert doctest.testmod(kvjax.metrics.latency_histogram).failed == 0


def test_below_the_cap_percentiles_equal_numpy_exactly():
    samples = np.random.default_rng(0).exponential(0.05, 500)
    histogram = filled(samples, exact_samples=500)
    assert histogram.exact
    assert histogram.quantiles(QS) == list(np.percentile(samples, 100 * QS))


@pytest.mark.parametrize("relative_error", [0.01, 0.02])
@pytest.mark.parametrize(
    "distribution",
    [
        pytest.param(lambda rng: rng.lognormal(-4.0, 1.5, 60_000), id="lognormal"),
        pytest.param(
            lambda rng: np.concatenate(
                [rng.normal(2e-3, 3e-4, 45_000).clip(1e-6), rng.normal(0.5, 0.05, 15_000)]
            ),
            id="bimodal",
        ),
    ],
)
def test_past_the_cap_every_percentile_is_within_the_relative_error(distribution, relative_error):
    rng = np.random.default_rng(1)
    samples = distribution(rng)
    rng.shuffle(samples)
    histogram = filled(samples, exact_samples=1_000, relative_error=relative_error)
    assert not histogram.exact and histogram.count == samples.size
    assert max_relative_error(histogram, samples) <= relative_error * (1 + 1e-9)
    assert histogram.quantile(0.0) == samples.min() and histogram.quantile(1.0) == samples.max()
    assert histogram.total == pytest.approx(samples.sum(), rel=1e-9)


@settings(max_examples=100, deadline=None)
@given(
    st.lists(st.floats(1e-9, 1e6), min_size=1, max_size=20),
    st.floats(0.0, 1.0),
)
def test_any_samples_in_range_meet_the_bound_with_no_exact_phase(samples, q):
    histogram = filled(samples, exact_samples=0)
    truth = float(np.percentile(samples, 100 * q))
    assert abs(histogram.quantile(q) - truth) <= 0.01 * truth * (1 + 1e-9)


@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.one_of(st.floats(0.0, 1e6), st.floats(0.0, 1e-8), st.just(0.0)), min_size=1, max_size=40),
    st.integers(0, 8),
    st.sampled_from([0.01, 0.05, 0.2]),
)
def test_past_exact_samples_any_non_negative_samples_meet_the_bound_in_order(samples, exact_samples, relative_error):
    """Samples kept exactly, then moved into buckets (``exact_samples`` < len), zeros and values
    below ``min_value`` included: each percentile is within the relative error of numpy's, plus
    ``min_value`` absolute (a tiny sample reads as 0); p50 <= p90 <= p99 <= max, p0/p100 exact."""
    histogram = filled(samples, exact_samples=exact_samples, relative_error=relative_error)
    assert histogram.exact == (len(samples) <= exact_samples)
    truth = np.percentile(samples, 100 * QS)
    estimate = np.asarray(histogram.quantiles(QS))
    assert np.all(np.abs(estimate - truth) <= relative_error * truth * (1 + 1e-9) + histogram.min_value)
    assert np.all(np.diff(estimate) >= 0)  # monotone in q
    p0, p50, p90, p99, p100 = histogram.quantiles([0.0, 0.5, 0.9, 0.99, 1.0])
    assert p0 <= p50 <= p90 <= p99 <= p100
    assert (p0, p100) == (min(samples), max(samples))


def test_default_bucket_count_covers_one_nanosecond_to_a_million_seconds():
    gamma = 1.01 / 0.99
    assert LatencyHistogram().num_buckets == math.ceil(math.log(1e15) / math.log(gamma)) + 1 == 1728


def test_values_outside_the_bucket_range_stay_within_the_observed_extremes():
    histogram = filled([0.0, 1e-12, 5e6, 7e6], exact_samples=0)
    assert histogram.quantile(0.0) == 0.0 and histogram.quantile(1.0) == 7e6
    # Tiny values share bucket 0 (reported as 0); huge ones the top bucket, reported as about
    # max_value (the one error the bound does not cover).
    assert histogram.quantile(1 / 3) == 0.0
    assert histogram.quantile(2 / 3) == pytest.approx(1e6, rel=0.01)


def test_the_largest_samples_land_in_the_top_bucket():
    # value / min_value overflowed to inf: the index became INT64_MIN, clipped to bucket 1
    for exact_samples in (0, 3):
        histogram = filled([1e15, 1e15, 1e15, 1e-3, 1e-3], exact_samples=exact_samples)
        assert histogram.quantile(0.5) == pytest.approx(1e6, rel=0.01)  # the top bucket: about max_value
        assert histogram.quantile(1.0) == 1e15 and math.isfinite(histogram.total)
        histogram.check_invariants()


def test_an_empty_histogram_has_no_percentiles():
    assert LatencyHistogram().quantiles([0.5, 0.99]) == [None, None]


@pytest.mark.parametrize(
    "bad, message",
    [
        (-1e-3, r"latency sample -0.001 must be a number of seconds in \[0, 1e\+15\]"),
        (math.nan, r"latency sample nan must be a number of seconds in"),
        (math.inf, r"latency sample inf must be a number of seconds in"),
        (1e300, r"latency sample 1e\+300 must be a number of seconds in"),  # overflowed its bucket index, after counting
        ("fast", r"latency sample 'fast' must be a number of seconds"),
    ],
)
def test_bad_samples_are_rejected_and_change_nothing(bad, message):
    for exact_samples in (10, 0):
        histogram = filled([0.1, 0.2], exact_samples=exact_samples)
        with pytest.raises(ValueError, match=message):
            histogram.add(bad)
        assert (histogram.count, histogram.total, histogram.maximum) == (2, pytest.approx(0.3), 0.2)
        histogram.check_invariants()


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"relative_error": 0.0}, r"relative_error=0.0 must lie in \(0, 0.5\)"),
        ({"exact_samples": -1}, r"exact_samples=-1 must be a non-negative integer"),
        ({"exact_samples": 1.5}, r"exact_samples=1.5 must be a non-negative integer"),
        ({"min_value": 1.0, "max_value": 1.0}, r"min_value=1.0, max_value=1.0 must satisfy"),
    ],
)
def test_bad_options_are_rejected(kwargs, message):
    with pytest.raises(ValueError, match=message):
        LatencyHistogram(**kwargs)


def test_quantiles_outside_zero_one_are_rejected():
    with pytest.raises(ValueError, match=r"quantiles \[1.5\] must lie in \[0, 1\]"):
        LatencyHistogram().quantile(1.5)
