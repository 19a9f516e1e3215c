"""Exporting a ``Metrics`` snapshot: Prometheus exposition and the end-of-run summary table.

Both read the plain dict of ``Metrics.to_json()``, so the three views can never disagree and
a table can be rendered from a snapshot saved by an earlier run.

Prometheus output goes through ``prometheus_client`` (>= 0.20, whose ``start_http_server``
returns the server so it can be shut down), imported on first use: the library runs without
it, and only ``prometheus_text()`` / ``serve_prometheus()`` need it. Names: ``kvjax_<name>``;
counters are exposed as ``kvjax_<name>_total``; latencies as summaries with ``quantile`` labels
0.5/0.9/0.99 plus ``_count`` and ``_sum``; the overall token and block hit rates as the gauges
``kvjax_token_hit_ratio`` and ``kvjax_block_hit_ratio`` (NaN before any lookup). A labelled
gauge series that was never set (None in the snapshot: the occupancy of a tier the cache does
not have) gets no sample, and no table row when no run has it.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Mapping, Sequence

from kvjax.metrics.specs import METRICS, QUANTILE_KEYS, QUANTILES, TIERS, MetricSpec

__all__ = ["MetricsServer", "PrometheusExporter", "summary_table"]

_PREFIX = "kvjax_"


class PrometheusExporter:
    """A ``prometheus_client`` registry whose one collector reads ``snapshot()`` per scrape."""

    def __init__(self, snapshot: Callable[[], dict]) -> None:
        self._client = _prometheus_client()
        self.registry = self._client.CollectorRegistry(auto_describe=False)
        self.registry.register(_SnapshotCollector(snapshot, self._client))

    def text(self) -> str:
        """Exposition text (format 0.0.4) of the current snapshot."""
        return self._client.generate_latest(self.registry).decode("utf-8")

    def serve(self, port: int, addr: str) -> MetricsServer:
        if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
            raise ValueError(f"{port=} must be an int in [0, 65535] (0 = any free port)")
        started = self._client.start_http_server(port, addr=addr, registry=self.registry)
        if not isinstance(started, tuple):
            raise RuntimeError("prometheus_client >= 0.20 is needed to stop the metrics server")
        return MetricsServer(*started)


class MetricsServer:
    """A running ``/metrics`` endpoint; ``close()`` stops it and frees the port."""

    def __init__(self, server, thread: threading.Thread) -> None:
        self._server, self._thread = server, thread

    @property
    def port(self) -> int:
        return self._server.server_port

    @property
    def url(self) -> str:
        host = self._server.server_address[0]
        host = f"[{host}]" if ":" in host else host
        return f"http://{host}:{self.port}/metrics"

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()  # without it the port stays bound until exit
        self._thread.join(timeout=5.0)

    def __enter__(self) -> MetricsServer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def summary_table(snapshots: Sequence[Mapping], labels: Sequence[str] | None = None) -> str:
    """Fixed-width table of one or more ``to_json()`` snapshots, one column per run.

    Rows: hit rates (overall and per tier), counters, latency percentiles in milliseconds,
    spill rate, then gauges. A value a run lacks prints as ``-``; a row that no run has (a
    latency never observed) is left out.
    """
    count = len(snapshots)
    if not count:
        raise ValueError("summary_table needs at least one snapshot")
    labels = tuple(labels) if labels is not None else (
        ("value",) if count == 1 else tuple(f"run {i}" for i in range(1, count + 1))
    )
    if len(labels) != count:
        raise ValueError(f"{labels=} must name each of the {count} runs")
    columns = [_table_rows(snapshot) for snapshot in snapshots]
    kept = [row for row in range(len(columns[0])) if any(c[row][1] != "-" for c in columns)]
    names = [columns[0][row][0] for row in kept]
    cells = [[column[row][1] for row in kept] for column in columns]
    name_width = max([len("metric"), *(len(name) for name in names)])  # a list: no row left is fine
    widths = [max([len(label), *(len(v) for v in column)]) for label, column in zip(labels, cells)]
    lines = [
        "  ".join(["metric".ljust(name_width), *map(str.rjust, labels, widths)]),
        "  ".join(["-" * name_width, *("-" * w for w in widths)]),
    ]
    for row, name in enumerate(names):
        values = (column[row].rjust(width) for column, width in zip(cells, widths))
        lines.append("  ".join([name.ljust(name_width), *values]).rstrip())
    return "\n".join(lines)


# -- Prometheus -----------------------------------------------------------------------------


class _SnapshotCollector:
    def __init__(self, snapshot: Callable[[], dict], client) -> None:
        self._snapshot, self._client = snapshot, client

    def collect(self):
        snapshot = self._snapshot()
        core = self._client.core
        for spec in METRICS:
            if spec.kind == "latency":
                yield _summary_family(core, spec, snapshot["latencies"][spec.name])
            else:
                section = "counters" if spec.kind == "counter" else "gauges"
                family = {"counter": core.CounterMetricFamily, "gauge": core.GaugeMetricFamily}
                yield _value_family(family[spec.kind], spec, snapshot[section][spec.name])
        for unit in ("token", "block"):
            rate = snapshot["rates"][f"{unit}_hit_rate"]
            yield core.GaugeMetricFamily(
                f"{_PREFIX}{unit}_hit_ratio",
                f"Prompt {unit}s served from cache / prompt {unit}s looked up (all tiers)",
                value=math.nan if rate is None else rate,
            )


def _value_family(family_type, spec: MetricSpec, value):
    if spec.label is None:
        return family_type(_PREFIX + spec.name, spec.help, value=value)
    family = family_type(_PREFIX + spec.name, spec.help, labels=[spec.label])
    for label_value, series_value in value.items():
        if series_value is not None:  # a gauge series never set (a tier the cache lacks): no sample
            family.add_metric([label_value], series_value)
    return family


def _summary_family(core, spec: MetricSpec, stats):
    name = _PREFIX + spec.name
    family = core.SummaryMetricFamily(name, spec.help, labels=[spec.label] if spec.label else [])
    series = stats.items() if spec.label else [(None, stats)]
    for label_value, one in series:
        labels = {spec.label: label_value} if spec.label else {}
        for q, key in zip(QUANTILES, QUANTILE_KEYS):
            value = math.nan if one[key] is None else one[key]
            family.add_sample(name, {**labels, "quantile": str(q)}, value)
        family.add_metric(list(labels.values()), one["count"], one["sum"])
    return family


def _prometheus_client():
    try:
        import prometheus_client
        import prometheus_client.core  # noqa: F401  (the metric family classes)
    except ImportError:
        raise ImportError(
            "prometheus_client is needed for Prometheus output: "
            "pip install 'prometheus_client>=0.20'"
        ) from None
    return prometheus_client


# -- summary table --------------------------------------------------------------------------


def _table_rows(snapshot: Mapping) -> list[tuple[str, str]]:
    rates, counters = snapshot.get("rates", {}), snapshot.get("counters", {})
    rows = []
    for unit in ("token", "block"):
        rows.append((f"{unit} hit rate", _percent(rates.get(f"{unit}_hit_rate"))))
        by_tier = rates.get(f"{unit}_hit_rate_by_tier") or {}
        rows += [(f"  from {tier}", _percent(by_tier.get(tier))) for tier in TIERS]
    for spec in METRICS:
        if spec.kind == "counter":
            rows += _labelled_rows(spec, counters.get(spec.name), _integer)
    for spec in METRICS:
        if spec.kind == "latency":
            rows += _latency_rows(spec, snapshot.get("latencies", {}).get(spec.name))
    rows.append(("spilled blocks per second", _decimal(rates.get("spilled_blocks_per_second"))))
    for spec in METRICS:
        if spec.kind == "gauge":
            rows += _labelled_rows(spec, snapshot.get("gauges", {}).get(spec.name),
                                   _percent if spec.ratio else _decimal)
    return rows


def _labelled_rows(spec: MetricSpec, value, formatter) -> list[tuple[str, str]]:
    if spec.label is None:
        return [(spec.name, formatter(value))]
    series = value or {}
    return [(f"{spec.name} ({v})", formatter(series.get(v))) for v in spec.label_values]


def _latency_rows(spec: MetricSpec, stats) -> list[tuple[str, str]]:
    base, stats = spec.name.removesuffix("_seconds"), stats or {}
    series = [(v, stats.get(v) or {}) for v in spec.label_values] if spec.label else [(None, stats)]
    rows = []
    for label_value, one in series:
        name = base if label_value is None else f"{base} {label_value}"
        for key in QUANTILE_KEYS:
            rows.append((f"{name} {key} (ms)", _millis(one.get(key))))
    return rows


def _percent(value) -> str:
    return "-" if value is None else f"{100 * value:.1f}%"


def _integer(value) -> str:
    return "-" if value is None else f"{value:,}"


def _decimal(value) -> str:
    if value is None:
        return "-"
    return f"{value:,.0f}" if float(value).is_integer() else f"{value:,.2f}"


def _millis(seconds) -> str:
    return "-" if seconds is None else f"{1e3 * seconds:,.3f}"
