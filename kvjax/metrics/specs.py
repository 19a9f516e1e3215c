"""What kvjax measures: every metric declared once, with its unit, kind and label values.

A metric's ``name`` carries its unit (``_tokens``, ``_blocks``, ``_bytes``, ``_seconds``,
``_ratio``); its kind is "counter" (monotonic int), "gauge" (float) or "latency" (seconds,
kept as a histogram); at most one label, with a fixed set of values. ``Metrics`` (the
registry) refuses anything not declared here, and the exporters render from these specs.
"""

from __future__ import annotations

import dataclasses

__all__ = [
    "FETCH_TIERS",
    "METRICS",
    "MISS_CAUSES",
    "QUANTILES",
    "QUANTILE_KEYS",
    "SPILL_LINKS",
    "TIERS",
    "MetricSpec",
]

TIERS = ("device", "host", "disk")
MISS_CAUSES = ("never_seen", "evicted", "other_namespace", "different_template", "lossy_refused", "recomputed")
SPILL_LINKS = ("device_to_host", "host_to_disk")
FETCH_TIERS = ("host", "disk")
QUANTILES = (0.5, 0.9, 0.99)
QUANTILE_KEYS = ("p50", "p90", "p99")
"""JSON keys of ``QUANTILES``."""


@dataclasses.dataclass(frozen=True, slots=True)
class MetricSpec:
    """One metric: ``kind`` is "counter" (monotonic int), "gauge" (float) or "latency" (seconds).

    ``name`` carries the unit (``_tokens``, ``_blocks``, ``_bytes``, ``_seconds``, ``_ratio``).
    ``ratio`` gauges must lie in [0, 1]; other gauges must be >= 0.
    """

    name: str
    kind: str
    help: str
    label: str | None = None
    label_values: tuple[str, ...] = ()
    ratio: bool = False


METRICS: tuple[MetricSpec, ...] = (
    MetricSpec("hit_tokens", "counter", "Prompt tokens served from cached KV, by tier that held it",
               "tier", TIERS),
    MetricSpec("hit_blocks", "counter", "Cached blocks reused by a request, by tier that held them",
               "tier", TIERS),
    MetricSpec("miss_tokens", "counter",
               "Prompt tokens prefilled without a cached match, by cause (a prompt's last page always is)",
               "cause", MISS_CAUSES),
    MetricSpec("miss_blocks", "counter",
               "Prompt blocks prefilled without a cached match, by cause (a prompt's last page always is)",
               "cause", MISS_CAUSES),
    MetricSpec("spilled_blocks", "counter", "Blocks copied down a tier link", "link", SPILL_LINKS),
    MetricSpec("spilled_bytes", "counter", "Bytes copied down a tier link", "link", SPILL_LINKS),
    MetricSpec("preemptions", "counter", "Running sequences preempted to free device blocks"),
    MetricSpec("rejections", "counter", "Requests rejected at admission"),
    MetricSpec("compilations", "counter",
               "XLA executables built by warm-up and steps (model step, tier moves, swaps): a new shape each"),
    MetricSpec("prefill_tokens", "counter",
               "Tokens the model computed in prefill chunks (recomputation included)"),
    MetricSpec("decode_tokens", "counter", "Tokens the model computed in decode steps"),
    MetricSpec("fetch_failures", "counter",
               "Fetch jobs from host or disk to device (prefetches too) that landed fewer blocks than asked"),
    MetricSpec("disk_errors", "counter", "Disk tier read, write or checksum errors"),
    MetricSpec("pool_occupancy_ratio", "gauge",
               "Fraction of a tier's blocks in use (a series for each tier the cache has)", "tier", TIERS, ratio=True),
    MetricSpec("pool_fragmentation_ratio", "gauge", "Device pool fragmentation (0 = none)",
               ratio=True),
    MetricSpec("queued_requests", "gauge", "Requests waiting for admission"),
    MetricSpec("running_sequences", "gauge", "Sequences in the running batch"),
    MetricSpec("generated_tokens_per_second", "gauge",
               "Tokens generated per second of wall time over the last engine run (a node: over its last second)"),
    MetricSpec("ttft_seconds", "latency", "Time from a request's arrival to its first token"),
    MetricSpec("inter_token_seconds", "latency", "Time between consecutive tokens of a sequence"),
    MetricSpec("queue_seconds", "latency",
               "Time from a request's arrival to its first step (a fetch of its cached prefix included)"),
    MetricSpec("request_seconds", "latency", "Time from a request's arrival to its last token"),
    MetricSpec("fetch_seconds", "latency", "Time to bring blocks to the device, by source tier",
               "tier", FETCH_TIERS),
)
