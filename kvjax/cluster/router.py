"""Routing: which node serves a request, given what the directory says each live node holds.

Strategies (``STRATEGIES``):

* ``prefix`` (the default), affinity guarded by load balance: the node holding the longest
  cached prefix of the request (any tier), unless that node is overloaded, i.e. its load
  exceeds the least loaded node's by more than ``max(imbalance_abs, imbalance_rel * mean
  load)``; nodes tied on the longest prefix take turns (round robin) among those not
  overloaded; when every holder is overloaded, or nobody holds any of the prefix, the least
  loaded node takes it (ties round robin).
* ``least_loaded``: the node with the lowest load, ties round robin.
* ``round_robin``: every live node in turn.

Why a guard and not a weighted cost (matched blocks minus a weight times load): when every
request shares one system prompt, the node that cached it first wins every comparison that
the weight does not overturn, and a weight large enough to overturn it throws away affinity
everywhere else. Issue 13's simulation of the shared trace (4 nodes x 2,000 blocks, per-node
leaf LRU) measured weighted cost 24.2% block hits, guarded affinity 37.1% (one cache of 8,000
blocks: 37.3%) with requests per node max/mean 1.01; the cluster replay is where this
module's settings get measured on it. Under the guard the first holder takes requests until it is overloaded, the
next goes to the least loaded node, which caches the prompt too, and from then on the
holders tie and take turns.

Load is counted at routing time: a node's load is its in-flight requests plus its uncached
prefill tokens divided by ``tokens_per_load_unit`` (one request's worth of prefill work); the
router adds each request it sends (``Directory.add_load``) before the node's own figures
catch up, so a burst does not see stale zeros.

The policy is plain code over ``NodeView`` lists: the HTTP router, the benchmark and a cluster
replay (simulated nodes, no Redis) call the same ``RoutingPolicy.choose``.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Collection, Sequence

from kvjax.cluster.directory import NodeView

__all__ = ["STRATEGIES", "Decision", "RouterConfig", "RoutingPolicy"]

STRATEGIES = ("prefix", "least_loaded", "round_robin")


@dataclasses.dataclass(frozen=True, slots=True)
class RouterConfig:
    """How the router chooses; see the module docstring.

    ``imbalance_abs`` is in load units (requests); ``imbalance_rel`` a fraction of the mean
    load; ``tokens_per_load_unit`` converts uncached prefill tokens into load units.
    """

    strategy: str = "prefix"
    imbalance_abs: float = 2.0
    imbalance_rel: float = 0.25
    tokens_per_load_unit: int = 512

    def __post_init__(self) -> None:
        if self.strategy not in STRATEGIES:
            raise ValueError(f"strategy={self.strategy!r}; expected one of {STRATEGIES}")
        if not self.imbalance_abs >= 0 or not self.imbalance_rel >= 0:
            raise ValueError(f"imbalance_abs={self.imbalance_abs!r} and imbalance_rel={self.imbalance_rel!r} "
                             "must be >= 0")  # fmt: skip
        if not isinstance(self.tokens_per_load_unit, int) or self.tokens_per_load_unit < 1:
            raise ValueError(f"tokens_per_load_unit={self.tokens_per_load_unit!r} must be an int >= 1")


@dataclasses.dataclass(frozen=True, slots=True)
class Decision:
    """Where a request goes and why.

    ``reason``: "affinity" (longest prefix, one holder), "affinity_tie" (holders took turns),
    "imbalanced" (the holders were overloaded: least loaded instead), "no_prefix" (nobody
    holds any: least loaded), "least_loaded", "round_robin".
    """

    node: NodeView
    reason: str
    prefix_blocks: int  # blocks of the request the chosen node holds (leading run)
    uncached_tokens: int  # prompt tokens it will prefill

    @property
    def node_id(self) -> str:
        return self.node.node_id


class RoutingPolicy:
    """Chooses a node per request; thread-safe (one lock around the round-robin position)."""

    def __init__(self, config: RouterConfig | None = None):
        self.config = config or RouterConfig()
        self._lock = threading.Lock()
        self._last: str | None = None  # the node id chosen last: round robin continues after it

    def load(self, node: NodeView) -> float:
        """The node's load in units of one in-flight request."""
        return node.load.inflight + node.load.prefill_tokens / self.config.tokens_per_load_unit

    def choose(self, nodes: Sequence[NodeView], num_prompt_tokens: int, page_size: int,
               exclude: Collection[str] = ()) -> Decision:  # fmt: skip
        """The node for a request of ``num_prompt_tokens`` tokens, among ``nodes`` (a lookup
        of its block keys) minus ``exclude`` (ids that just failed).

        ValueError when no node is left, naming the excluded ones.
        """
        candidates = [node for node in nodes if node.node_id not in exclude]
        if not candidates:
            raise ValueError(f"no live node to route to ({len(nodes)} live, excluded: {sorted(exclude)})")
        strategy = self.config.strategy
        with self._lock:
            if strategy == "round_robin":
                node, reason = self._next_after(candidates), "round_robin"
            elif strategy == "least_loaded":
                node, reason = self._least_loaded(candidates), "least_loaded"
            else:
                node, reason = self._guarded_affinity(candidates)
            self._last = node.node_id
        prefix_tokens = min(node.prefix_blocks * page_size, num_prompt_tokens)
        return Decision(node, reason, node.prefix_blocks, num_prompt_tokens - prefix_tokens)

    # --- helpers ---------------------------------------------------------------------------

    def _guarded_affinity(self, nodes: list[NodeView]) -> tuple[NodeView, str]:
        best = max(node.prefix_blocks for node in nodes)
        if best == 0:
            return self._least_loaded(nodes), "no_prefix"
        loads = [self.load(node) for node in nodes]
        limit = min(loads) + max(self.config.imbalance_abs, self.config.imbalance_rel * sum(loads) / len(loads))
        holders = [node for node, load in zip(nodes, loads) if node.prefix_blocks == best and load <= limit]
        if not holders:
            return self._least_loaded(nodes), "imbalanced"
        if len(holders) == 1:
            return holders[0], "affinity"
        return self._next_after(holders), "affinity_tie"

    def _least_loaded(self, nodes: list[NodeView]) -> NodeView:
        lowest = min(self.load(node) for node in nodes)
        return self._next_after([node for node in nodes if self.load(node) == lowest])

    def _next_after(self, nodes: list[NodeView]) -> NodeView:
        """The first node (by id) after the last one chosen, cyclically: round robin that
        stays fair while the set of nodes changes."""
        ordered = sorted(nodes, key=lambda node: node.node_id)
        if self._last is not None:
            for node in ordered:
                if node.node_id > self._last:
                    return node
        return ordered[0]
