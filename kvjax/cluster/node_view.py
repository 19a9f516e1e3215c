"""What routing reads about a node: its load and, for one request, the prefix it holds.

Plain records with no Redis client behind them, so that the routing policy (and the cluster
replay, which simulates nodes) import without the cluster's extra packages.
``kvjax.cluster.directory`` builds them from Redis; the replay from simulated caches.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

__all__ = ["DEFAULT_BLOCK_TTL_S", "NodeLoad", "NodeView"]

DEFAULT_BLOCK_TTL_S = 1800.0
"""How long a block entry (and a dropped mark) lives in the directory after its last write or
refresh, by default (``Directory(block_ttl_s=...)``)."""


@dataclasses.dataclass(frozen=True, slots=True)
class NodeLoad:
    """A node's load: requests accepted and not finished, and the prompt tokens of those not
    yet started that its cache did not hold when they arrived."""

    inflight: int = 0  # requests
    prefill_tokens: int = 0  # uncached prompt tokens still to prefill


@dataclasses.dataclass(frozen=True, slots=True)
class NodeView:
    """One live node as a lookup saw it, for one request's block keys.

    ``prefix_blocks``: the leading run of the request's blocks the node holds in any tier;
    ``blocks_by_tier``: how many of those are fastest on each tier (device, then host, disk);
    ``first_dropped_ms``: when the node (in this epoch) last dropped the request's first block
    from its last tier, in ms of its clock (0: it holds it, or never held it, or forgot).
    """

    node_id: str
    epoch: int
    address: str  # base URL of its HTTP API
    load: NodeLoad
    prefix_blocks: int = 0
    blocks_by_tier: Mapping[str, int] = dataclasses.field(default_factory=dict)
    first_dropped_ms: int = 0
