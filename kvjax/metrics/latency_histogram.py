"""Streaming percentiles of latencies: exact up to a cap, then fixed log buckets.

Averages hide the tail that users feel (a fetch that waits behind a spill, a step that
recompiles), so the metrics report p50/p90/p99. Keeping every sample is exact but grows
without bound in a long-running server; this structure keeps every sample up to
``exact_samples`` and then moves to a fixed logarithmic histogram (the HDR/DDSketch idea):

* bucket ``i >= 1`` holds values in ``(min_value * g**(i-1), min_value * g**i]`` with
  ``g = (1 + a) / (1 - a)``, ``a = relative_error``; bucket 0 holds values below
  ``min_value`` (and exact zeros);
* a bucket reports ``min_value * 2 * g**i / (g + 1)``, which lies within a factor
  ``1 +- a`` of every value in the bucket.

Error bound. Percentiles use numpy's default definition (linear interpolation between the
order statistics around rank ``q * (n - 1)``). In histogram mode each order statistic is
replaced by its bucket's value, so for samples in ``[min_value, max_value]`` every reported
percentile is within relative error ``a`` of ``numpy.percentile`` over all samples (a convex
combination of two values each within ``1 +- a`` of the truth stays within it), up to float
rounding at bucket edges. Samples below ``min_value`` count as 0 (absolute error below
``min_value``); samples above ``max_value`` share the top bucket and read as about
``max_value``. The smallest and largest samples are kept exactly (p0 and p100 are exact) and
every result is clamped between them. Memory is fixed: ``exact_samples`` floats, then
``ceil(log(max_value / min_value) / log(g)) + 1`` counters
(1,728 for the defaults, a = 1%, 1 ns .. 11.6 days).

Not thread-safe on its own; ``kvjax.metrics.registry.Metrics`` serialises access with its lock.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

__all__ = ["LatencyHistogram"]


class LatencyHistogram:
    """Percentiles of non-negative samples (seconds), exact up to ``exact_samples`` samples.

    >>> hist = LatencyHistogram(exact_samples=4)
    >>> for ms in (1, 2, 3, 4, 100):
    ...     hist.add(ms / 1000)
    >>> hist.exact, hist.count, abs(hist.quantile(0.5) / 0.003 - 1) <= 0.01, hist.quantile(1.0)
    (False, 5, True, 0.1)
    """

    __slots__ = (
        "relative_error", "exact_samples", "min_value", "max_value",
        "num_buckets", "_gamma_log", "_samples", "_buckets", "count", "total", "minimum", "maximum",
    )

    def __init__(
        self,
        relative_error: float = 0.01,
        exact_samples: int = 4096,
        min_value: float = 1e-9,
        max_value: float = 1e6,
    ) -> None:
        if not 0.0 < relative_error < 0.5:
            raise ValueError(f"{relative_error=} must lie in (0, 0.5)")
        if type(exact_samples) is not int or exact_samples < 0:
            raise ValueError(f"{exact_samples=} must be a non-negative integer")
        if not 0.0 < min_value < max_value < math.inf:
            raise ValueError(f"{min_value=}, {max_value=} must satisfy 0 < min_value < max_value")
        self.relative_error, self.exact_samples = relative_error, exact_samples
        self.min_value, self.max_value = min_value, max_value
        self._gamma_log = math.log((1 + relative_error) / (1 - relative_error))
        self.num_buckets = math.ceil(math.log(max_value / min_value) / self._gamma_log) + 1
        self._samples: list[float] | None = []  # None once the buckets take over
        self._buckets: list[int] | None = None  # [num_buckets] sample counts
        self.count, self.total = 0, 0.0
        self.minimum, self.maximum = math.inf, -math.inf

    @property
    def exact(self) -> bool:
        """True while every sample is kept (percentiles equal numpy's exactly)."""
        return self._samples is not None

    def add(self, value: float) -> None:
        """Record one sample; ValueError for a negative, NaN or infinite value."""
        value = _checked_sample(value)
        self.count += 1
        self.total += value
        # Plain comparisons and a list of ints: this runs once per token on the decode path.
        if value < self.minimum:
            self.minimum = value
        if value > self.maximum:
            self.maximum = value
        if self._samples is None:
            self._buckets[self._bucket_index(value)] += 1
            return
        self._samples.append(value)
        if len(self._samples) > self.exact_samples:
            self._switch_to_buckets()

    def quantile(self, q: float) -> float | None:
        """The ``q``-quantile (``0 <= q <= 1``) in numpy's linear definition; None when empty."""
        return self.quantiles([q])[0]

    def quantiles(self, qs: Sequence[float]) -> list[float | None]:
        """Several quantiles at once (one pass over the buckets)."""
        qs = [float(q) for q in qs]
        if not all(0.0 <= q <= 1.0 for q in qs):
            raise ValueError(f"quantiles {qs} must lie in [0, 1]")
        if self.count == 0:
            return [None] * len(qs)
        if self._samples is not None:
            return [float(v) for v in np.percentile(self._samples, [100 * q for q in qs])]
        cumulative = np.cumsum(self._buckets)
        results = []
        for q in qs:
            rank = q * (self.count - 1)
            low = math.floor(rank)
            high = min(low + 1, self.count - 1)
            x_low = self._order_statistic(cumulative, low)
            x_high = self._order_statistic(cumulative, high)
            estimate = x_low + (rank - low) * (x_high - x_low)
            results.append(min(max(estimate, self.minimum), self.maximum))
        return results

    def check_invariants(self) -> None:
        """RuntimeError if the sample count, bucket counts and extremes disagree."""
        held = len(self._samples) if self._samples is not None else sum(self._buckets)
        if held != self.count:
            raise RuntimeError(f"histogram holds {held} samples but count={self.count}")
        if self.count and not 0.0 <= self.minimum <= self.maximum:
            raise RuntimeError(f"bad extremes minimum={self.minimum} maximum={self.maximum}")
        if self._samples is not None and len(self._samples) > self.exact_samples:
            raise RuntimeError(f"{len(self._samples)} exact samples exceed {self.exact_samples=}")

    # -- helpers ----------------------------------------------------------------------------

    def _bucket_index(self, value: float) -> int:
        if value < self.min_value:
            return 0
        # a difference of logs: value / min_value overflows to inf for values near the largest float
        index = math.ceil((math.log(value) - math.log(self.min_value)) / self._gamma_log)
        if index < 1:  # value == min_value exactly
            return 1
        return index if index < self.num_buckets else self.num_buckets - 1

    def _switch_to_buckets(self) -> None:
        samples = np.asarray(self._samples, np.float64)
        buckets = np.zeros(self.num_buckets, np.int64)
        large = samples[samples >= self.min_value]
        index = np.ceil((np.log(large) - math.log(self.min_value)) / self._gamma_log).astype(np.int64)
        np.add.at(buckets, np.clip(index, 1, self.num_buckets - 1), 1)
        buckets[0] = samples.size - large.size
        self._buckets, self._samples = buckets.tolist(), None

    def _order_statistic(self, cumulative: np.ndarray, k: int) -> float:
        """The ``k``-th smallest sample (0-based): exact at both ends, else its bucket's value."""
        if k == 0:
            return self.minimum
        if k == self.count - 1:
            return self.maximum
        index = int(np.searchsorted(cumulative, k, side="right"))
        if index == 0:
            return 0.0
        gamma = math.exp(self._gamma_log)
        return self.min_value * 2.0 * math.exp(index * self._gamma_log) / (gamma + 1.0)


def _checked_sample(value: float) -> float:
    try:
        value = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"latency sample {value!r} must be a number of seconds") from None
    if not 0.0 <= value <= _MAX_SAMPLE_S:  # also rejects NaN and infinities
        raise ValueError(f"latency sample {value!r} must be a number of seconds in [0, {_MAX_SAMPLE_S:g}]")
    return value


_MAX_SAMPLE_S = 1e15  # 30 million years: anything larger is a clock bug; and sums of samples stay finite
