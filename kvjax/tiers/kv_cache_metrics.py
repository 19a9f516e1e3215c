"""What ``KVCache`` records in a ``kvjax.metrics.registry.Metrics`` at admission and on ``poll``.

Transfers record themselves as they finish (``kv_cache_moves``: spills, fetch latency,
fetch failures, disk errors, hits of fetched pages by tier).
"""

from __future__ import annotations

from kvjax.cache.allocator import BlockAllocator
from kvjax.cache.records import SeqHandle
from kvjax.metrics.registry import Metrics
from kvjax.tiers.tier_index import TierIndex

__all__ = ["record_admission", "record_occupancy"]


def record_admission(metrics: Metrics | None, handle: SeqHandle, page_size: int, device_pages: int,
                     lower_missed: int, refused_lossy: int = 0) -> None:  # fmt: skip
    """A new sequence's device hits, and its misses: ``lower_missed`` host/disk pages it
    recomputes ("evicted"), ``refused_lossy`` lossy pages it refused ("lossy_refused"), the
    prompt past every tier's match ("never_seen")."""
    if metrics is None:
        return
    if device_pages:
        metrics.record_hit("device", device_pages * page_size, device_pages)
    if lower_missed:
        metrics.record_miss("evicted", lower_missed * page_size, lower_missed)
    if refused_lossy:
        metrics.record_miss("lossy_refused", refused_lossy * page_size, refused_lossy)
    never_seen = handle.num_tokens - handle.num_hit_tokens - (lower_missed + refused_lossy) * page_size
    if never_seen > 0:
        metrics.record_miss("never_seen", never_seen, -(-never_seen // page_size))


def record_occupancy(metrics: Metrics, allocator: BlockAllocator, index: TierIndex) -> None:
    """Fraction of each tier in use: device blocks, host blocks, disk bytes."""
    metrics.set("pool_occupancy_ratio", allocator.occupancy, tier="device")
    if index.host_capacity:
        metrics.set("pool_occupancy_ratio", min(1.0, index.host_used / index.host_capacity), tier="host")
    disk = index.disk
    if disk is not None and disk.capacity_bytes:
        metrics.set("pool_occupancy_ratio", min(1.0, disk.bytes_used / disk.capacity_bytes), tier="disk")
