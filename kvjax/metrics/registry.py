"""The metrics registry: counters, gauges, latency percentiles and derived rates.

Every metric is declared once in ``kvjax.metrics.specs.METRICS`` (name with its unit, kind, at most one label and
the label's valid values); an update naming anything else is a ValueError that lists the valid
choices, and bad input never changes state. One lock serialises updates and snapshots, so the
engine, the transfer workers and a Prometheus scrape can share one ``Metrics``.

Three views of one snapshot:

* ``to_json()``: a dict of plain numbers with stable keys (``counters``, ``gauges``,
  ``latencies`` with count/sum/mean/min/max/p50/p90/p99, ``rates``), ``json.dumps``-safe
  (an undefined value, such as a hit rate before any lookup, is None);
* ``prometheus_text()`` / ``serve_prometheus(port)``: the Prometheus exposition format via
  ``prometheus_client``: names prefixed ``kvjax_``, counters suffixed ``_total``, latencies as
  summaries with ``quantile`` labels (see ``kvjax.metrics.export``);
* ``summary_table()``: a fixed-width table for the end of a run, one or two runs side by side.

Counters and unlabelled gauges start at 0. A labelled gauge's series start unset: a series never
set (``pool_occupancy_ratio`` of a tier the cache does not have) is None in ``to_json()``, has
no Prometheus sample and no table row, so a dashboard can tell a missing tier from an empty one.

Latency percentiles come from ``LatencyHistogram`` (exact up to 4,096 samples per series,
then log buckets with relative error <= 1%).

Hit rates (``rates``): ``token_hit_rate`` is hit tokens / (hit + miss tokens), every prompt
token of every request counted once, at its first admission; ``block_hit_rate`` the same in
blocks (a prompt's partial last page counts as one block). The engine never serves a prompt's
last page from cache (the last token's logits must be computed, see
``kvjax.serving.scheduler``), so those tokens always count as misses, under the cause of the
first missed page before them, or ``never_seen`` when every earlier page hit: a prompt of
``n`` tokens seen before in full reaches a token hit rate of ``page_size * ((n - 1) //
page_size) / n``, not 1.
"""

from __future__ import annotations

import math
import operator
import threading
import time
from collections.abc import Callable, Mapping

from kvjax.metrics.export import PrometheusExporter, summary_table
from kvjax.metrics.latency_histogram import LatencyHistogram
from kvjax.metrics.specs import (
    METRICS,
    QUANTILE_KEYS,
    QUANTILES,
    SPILL_LINKS,
    TIERS,
    MetricSpec,
)

__all__ = ["Metrics"]

_SPECS = {spec.name: spec for spec in METRICS}
_KIND_VERB = {"counter": "inc", "gauge": "set", "latency": "observe"}


class Metrics:
    """A thread-safe registry of the metrics in ``METRICS``.

    ``clock`` (seconds, monotonic) measures ``elapsed_seconds`` for per-second rates;
    ``relative_error`` and ``exact_samples`` configure every latency series.

    >>> m = Metrics()
    >>> m.record_hit("device", tokens=96, blocks=6)
    >>> m.record_miss("never_seen", tokens=32, blocks=2)
    >>> m.observe("ttft_seconds", 0.120)
    >>> snapshot = m.to_json()
    >>> snapshot["rates"]["token_hit_rate"], snapshot["latencies"]["ttft_seconds"]["p50"]
    (0.75, 0.12)
    """

    def __init__(
        self,
        *,
        clock: Callable[[], float] = time.monotonic,
        relative_error: float = 0.01,
        exact_samples: int = 4096,
    ) -> None:
        self._lock = threading.Lock()
        self._clock = clock
        self._start = clock()
        self._histogram_options = {"relative_error": relative_error, "exact_samples": exact_samples}
        LatencyHistogram(**self._histogram_options)  # validate the options now, not on first use
        self._counters = {s.name: _series(s, 0) for s in METRICS if s.kind == "counter"}
        # a labelled gauge's series start unset (None): its label values are what may be there
        # (a tier the cache lacks is never set, and exports no sample rather than a 0)
        self._gauges = {s.name: _series(s, None if s.label else 0.0) for s in METRICS if s.kind == "gauge"}
        self._latencies = {
            s.name: _series(s, None, lambda: LatencyHistogram(**self._histogram_options))
            for s in METRICS
            if s.kind == "latency"
        }
        self._exporter: PrometheusExporter | None = None  # made on first use

    # -- updates ----------------------------------------------------------------------------

    def inc(self, name: str, amount: int = 1, **label: str) -> None:
        """Add ``amount`` (an int >= 0) to counter ``name``: ``inc("preemptions")``."""
        key = _label_key(_spec(name, "counter"), label)
        amount = _count(name, amount)
        with self._lock:
            self._counters[name][key] += amount

    def set(self, name: str, value: float, **label: str) -> None:
        """Set gauge ``name``, e.g. ``set("pool_occupancy_ratio", 0.93, tier="device")``."""
        spec = _spec(name, "gauge")
        key = _label_key(spec, label)
        value = _gauge_value(spec, value)
        with self._lock:
            self._gauges[name][key] = value

    def observe(self, name: str, seconds: float, **label: str) -> None:
        """Record a latency in seconds (>= 0): ``observe("fetch_seconds", 4e-3, tier="host")``."""
        key = _label_key(_spec(name, "latency"), label)
        with self._lock:
            self._latencies[name][key].add(seconds)  # validates before it changes anything

    def record_hit(self, tier: str, tokens: int, blocks: int) -> None:
        """A request reused ``blocks`` cached blocks (``tokens`` tokens) held in ``tier``."""
        self._record_pair("hit", "tier", tier, tokens, blocks)

    def record_miss(self, cause: str, tokens: int, blocks: int) -> None:
        """A request prefilled ``tokens`` tokens (``blocks`` blocks) without a match, by cause."""
        self._record_pair("miss", "cause", cause, tokens, blocks)

    def record_spill(self, link: str, blocks: int, num_bytes: int) -> None:
        """``blocks`` blocks (``num_bytes`` bytes) were copied down ``link``."""
        key = _label_key(_SPECS["spilled_blocks"], {"link": link})
        blocks, num_bytes = _count("blocks", blocks), _count("num_bytes", num_bytes)
        with self._lock:
            self._counters["spilled_blocks"][key] += blocks
            self._counters["spilled_bytes"][key] += num_bytes

    # -- views ------------------------------------------------------------------------------

    def to_json(self) -> dict:
        """Snapshot as plain dicts, numbers and None (see the module docstring for the keys)."""
        with self._lock:
            elapsed = max(self._clock() - self._start, 0.0)
            counters = {name: _unwrap(_SPECS[name], dict(v)) for name, v in self._counters.items()}
            gauges = {name: _unwrap(_SPECS[name], dict(v)) for name, v in self._gauges.items()}
            latencies = {
                name: _unwrap(_SPECS[name], {key: _latency_stats(h) for key, h in series.items()})
                for name, series in self._latencies.items()
            }
        return {
            "elapsed_seconds": elapsed,
            "counters": counters,
            "gauges": gauges,
            "latencies": latencies,
            "rates": _derived_rates(counters, elapsed),
        }

    def prometheus_text(self) -> str:
        """The current snapshot in Prometheus text exposition format (needs prometheus_client)."""
        return self._prometheus_exporter().text()

    def serve_prometheus(self, port: int = 0, addr: str = "127.0.0.1"):
        """Serve ``/metrics`` over HTTP on ``addr:port`` (0 = any free port) in a daemon thread.

        Returns a ``kvjax.metrics.export.MetricsServer`` (``.port``, ``.url``, ``.close()``).
        Binds to loopback by default: exposing it wider is the deployment's choice.
        """
        return self._prometheus_exporter().serve(port, addr)

    def summary_table(
        self, other: Metrics | Mapping | None = None, labels: tuple[str, ...] | None = None
    ) -> str:
        """Fixed-width text table of this run, or of this run and ``other`` side by side.

        ``other`` is another ``Metrics`` or a ``to_json()`` snapshot (e.g. loaded from a file).
        """
        snapshots = [self.to_json()]
        if other is not None:
            snapshots.append(other.to_json() if isinstance(other, Metrics) else other)
        return summary_table(snapshots, labels)

    def check_invariants(self) -> None:
        """RuntimeError if a counter is negative or not an int, or a latency series disagrees."""
        with self._lock:
            for name, series in self._counters.items():
                for key, value in series.items():
                    if type(value) is not int or value < 0:
                        raise RuntimeError(f"counter {name}{key or ''} holds {value!r}")
            for series in self._latencies.values():
                for histogram in series.values():
                    histogram.check_invariants()

    # -- helpers ----------------------------------------------------------------------------

    def _record_pair(self, prefix: str, label: str, value: str, tokens: int, blocks: int) -> None:
        key = _label_key(_SPECS[f"{prefix}_tokens"], {label: value})
        tokens, blocks = _count("tokens", tokens), _count("blocks", blocks)
        with self._lock:
            self._counters[f"{prefix}_tokens"][key] += tokens
            self._counters[f"{prefix}_blocks"][key] += blocks

    def _prometheus_exporter(self) -> PrometheusExporter:
        with self._lock:
            if self._exporter is None:
                self._exporter = PrometheusExporter(self.to_json)
            return self._exporter


def _spec(name: str, kind: str) -> MetricSpec:
    spec = _SPECS.get(name)
    if spec is None or spec.kind != kind:
        valid = sorted(s.name for s in METRICS if s.kind == kind)
        verb = _KIND_VERB[kind]
        raise ValueError(f"unknown {kind} {name!r} for {verb}(); expected one of {valid}")
    return spec


def _label_key(spec: MetricSpec, label: Mapping[str, str]) -> str | None:
    """The series key: the label's value, or None for an unlabelled metric."""
    if spec.label is None:
        if label:
            raise ValueError(f"{spec.name} takes no label, got {dict(label)}")
        return None
    if set(label) != {spec.label}:
        raise ValueError(f"{spec.name} needs exactly one label {spec.label}=..., got {dict(label)}")
    value = label[spec.label]
    if value not in spec.label_values:
        valid = list(spec.label_values)
        raise ValueError(f"unknown {spec.label} {value!r} for {spec.name}; expected one of {valid}")
    return value


def _series(spec: MetricSpec, initial, factory=None) -> dict:
    keys = spec.label_values if spec.label is not None else (None,)
    return {key: (factory() if factory is not None else initial) for key in keys}


def _unwrap(spec: MetricSpec, series: dict):
    """An unlabelled metric is its value; a labelled one a dict keyed by label value."""
    return series[None] if spec.label is None else series


def _count(name: str, amount) -> int:
    """``amount`` as a Python int (numpy ints accepted); floats and bools are not counts."""
    try:
        count = operator.index(amount)
    except TypeError:
        count = -1
    if isinstance(amount, bool) or count < 0:
        raise ValueError(f"{name}={amount!r} must be an int >= 0")
    return count


def _gauge_value(spec: MetricSpec, value) -> float:
    try:
        value = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{spec.name}={value!r} must be a number") from None
    upper = 1.0 if spec.ratio else math.inf
    if not 0.0 <= value <= upper or math.isinf(value):
        expected = "in [0, 1]" if spec.ratio else "finite and >= 0"
        raise ValueError(f"{spec.name}={value!r} must be {expected}")
    return value


def _latency_stats(histogram: LatencyHistogram) -> dict:
    quantiles = histogram.quantiles(QUANTILES)
    count = histogram.count
    return {
        "count": count,
        "sum": histogram.total,
        "mean": histogram.total / count if count else None,
        "min": histogram.minimum if count else None,
        "max": histogram.maximum if count else None,
        **dict(zip(QUANTILE_KEYS, quantiles)),
    }


def _derived_rates(counters: dict, elapsed: float) -> dict:
    rates = {}
    for unit in ("token", "block"):
        hits, misses = counters[f"hit_{unit}s"], counters[f"miss_{unit}s"]
        looked_up = sum(hits.values()) + sum(misses.values())
        rates[f"{unit}_hit_rate"] = sum(hits.values()) / looked_up if looked_up else None
        rates[f"{unit}_hit_rate_by_tier"] = {
            tier: (hits[tier] / looked_up if looked_up else None) for tier in TIERS
        }
    spilled = counters["spilled_blocks"]
    rates["spilled_blocks_per_second"] = sum(spilled.values()) / elapsed if elapsed else None
    rates["spilled_blocks_per_second_by_link"] = {
        link: (spilled[link] / elapsed if elapsed else None) for link in SPILL_LINKS
    }
    return rates
