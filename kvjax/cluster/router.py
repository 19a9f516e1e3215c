"""Routing: which node serves a request, given what the directory says each live node holds.

Strategies (``STRATEGIES``):

* ``prefix`` (the default), affinity guarded by load balance: the node holding the longest
  cached prefix of the request (any tier), unless that node is overloaded; nodes tied on the
  longest prefix take fair turns among those not overloaded; when every holder is
  overloaded the least loaded node takes it; when nobody holds any of the prefix, every node
  ties at zero blocks and the ones not overloaded take fair turns. Before all that, a node
  starved of requests (fewer than half its share of the recent ones) that is not overloaded
  takes the request even though it holds less of the prefix: it caches it, and from then on
  ties with the other holders.
* ``least_loaded``: the node with the lowest load, ties round robin.
* ``round_robin``: every live node in turn.

Overloaded, for a request: a node's load *with the request placed on it* (its load plus the
request's uncached prefill there) exceeds the mean of those loads over the live nodes by more
than ``max(imbalance_abs, imbalance_rel * that mean)``. Three choices in that rule, each
measured with the cluster replay on the shared trace (``benchmarks/bench_cluster_replay.py``;
4 and 8 nodes of 2,000 and 8,000 blocks):

* the mean, not the least loaded node, is the reference: the least of N loads falls as N
  grows, so against it nearly every holder looked overloaded at 8 nodes (affinity thrown away
  for two more requests in flight);
* the request is counted where it would land: a holder is credited with the prefill its hit
  saves, so a 40-block prefix is not recomputed elsewhere to avoid one more decode in flight;
* uncached prefill tokens count in units of the mean uncached prompt the router has routed
  (``tokens_per_load_unit=None``, the default; an int fixes the unit): a load unit stays one
  typical request whether prompts are 500 tokens or 15,000. A fixed 512 made one 15k-token
  prompt look like 30 requests and cost 14 points of hits on the trace.

Fair turns: among the candidates, the node sent the fewest of the router's last
``fair_window`` requests goes first (ties round robin). A plain round-robin pointer lets the
requests that affinity pins to a node pile up on top of its share of the others; fair turns
give the others to the nodes affinity left behind, so requests per node stay even over a
window, not only over the run.

Starvation is the one case the guard cannot see: when every request shares one system
prompt and the holders are busy but not overloaded, a node that never cached the prompt
looks more expensive than any holder (it would prefill the whole prompt) and would wait
forever.

Why a guard and not a weighted cost (matched blocks minus a weight times load): when every
request shares one system prompt, the node that cached it first wins every comparison that
the weight does not overturn, and a weight large enough to overturn it throws away affinity
everywhere else. Under the guard the first holder takes requests until it is overloaded,
the next goes to the least loaded node, which caches the prompt too, and from then on the
holders tie and take turns.

Load is counted at routing time: a node's load is its in-flight requests plus its uncached
prefill tokens in load units; the router adds each request it sends (``Directory.add_load``)
before the node's own figures catch up, so a burst does not see stale zeros. The fair-turn
history and the learned token unit are the router's only memory: a restarted router starts
them afresh and is even again within one window.

The policy is plain code over ``NodeView`` lists: the HTTP router, the benchmark and the
cluster replay (simulated nodes, no Redis) call the same ``RoutingPolicy.choose``.
"""

from __future__ import annotations

import collections
import dataclasses
import threading
from collections.abc import Collection, Sequence

from kvjax.cluster.node_view import NodeView

__all__ = ["STRATEGIES", "Decision", "RouterConfig", "RoutingPolicy"]

STRATEGIES = ("prefix", "least_loaded", "round_robin")
_STARVED_MIN_SHARE = 8  # recent requests per node before a short count means starved


@dataclasses.dataclass(frozen=True, slots=True)
class RouterConfig:
    """How the router chooses; see the module docstring.

    ``imbalance_abs`` is in load units (requests); ``imbalance_rel`` a fraction of the mean
    load; ``tokens_per_load_unit`` converts uncached prefill tokens into load units (None:
    the mean uncached prompt of recent requests); ``fair_window``: how many recent decisions
    fair turns count.
    """

    strategy: str = "prefix"
    imbalance_abs: float = 2.0
    imbalance_rel: float = 0.25
    tokens_per_load_unit: int | None = None
    fair_window: int = 256

    def __post_init__(self) -> None:
        if self.strategy not in STRATEGIES:
            raise ValueError(f"strategy={self.strategy!r}; expected one of {STRATEGIES}")
        if not self.imbalance_abs >= 0 or not self.imbalance_rel >= 0:
            raise ValueError(f"imbalance_abs={self.imbalance_abs!r} and imbalance_rel={self.imbalance_rel!r} "
                             "must be >= 0")  # fmt: skip
        unit = self.tokens_per_load_unit
        if unit is not None and (isinstance(unit, bool) or not isinstance(unit, int) or unit < 1):
            raise ValueError(f"tokens_per_load_unit={unit!r} must be an int >= 1, or None (learned)")
        if isinstance(self.fair_window, bool) or not isinstance(self.fair_window, int) or self.fair_window < 1:
            raise ValueError(f"fair_window={self.fair_window!r} must be an int >= 1 (decisions)")


@dataclasses.dataclass(frozen=True, slots=True)
class Decision:
    """Where a request goes and why.

    ``reason``: "affinity" (longest prefix, one holder), "affinity_tie" (holders took turns),
    "imbalanced" (the holders were overloaded: least loaded instead), "no_prefix" (nobody
    holds any: fair turns), "starved" (a node short of requests took it), "least_loaded",
    "round_robin".
    """

    node: NodeView
    reason: str
    prefix_blocks: int  # blocks of the request the chosen node holds (leading run)
    uncached_tokens: int  # prompt tokens it will prefill

    @property
    def node_id(self) -> str:
        return self.node.node_id


class RoutingPolicy:
    """Chooses a node per request; thread-safe (one lock around its memory: the round-robin
    position, the recent decisions and the learned token unit)."""

    _UNIT_WEIGHT = 1 / 64  # the learned unit follows about the last 64 requests

    def __init__(self, config: RouterConfig | None = None):
        self.config = config or RouterConfig()
        self._lock = threading.Lock()
        self._last: str | None = None  # the node id chosen last: round robin continues after it
        self._recent: collections.deque[str] = collections.deque()  # the last fair_window choices
        self._recent_counts: collections.Counter[str] = collections.Counter()
        self._learned_unit: float | None = None  # mean uncached prompt tokens of recent requests

    def tokens_per_load_unit(self, num_prompt_tokens: int = 1) -> float:
        """Uncached prefill tokens per load unit: the configured value, else the learned
        mean (before any request: ``num_prompt_tokens``, the first request's own size)."""
        if self.config.tokens_per_load_unit is not None:
            return float(self.config.tokens_per_load_unit)
        return self._learned_unit or float(max(num_prompt_tokens, 1))

    def load(self, node: NodeView, extra_prefill_tokens: int = 0, num_prompt_tokens: int = 1) -> float:
        """The node's load in units of one in-flight request, with ``extra_prefill_tokens``
        more to prefill."""
        unit = self.tokens_per_load_unit(num_prompt_tokens)
        return node.load.inflight + (node.load.prefill_tokens + extra_prefill_tokens) / unit

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
                loads = [self.load(node, num_prompt_tokens=num_prompt_tokens) for node in candidates]
                node, reason = self._least_loaded(candidates, loads), "least_loaded"
            else:
                node, reason = self._guarded_affinity(candidates, num_prompt_tokens, page_size)
            uncached = num_prompt_tokens - _prefix_tokens(node, num_prompt_tokens, page_size)
            self._remember(node.node_id, max(uncached, page_size))
        return Decision(node, reason, node.prefix_blocks, uncached)

    # --- helpers ---------------------------------------------------------------------------

    def _guarded_affinity(self, nodes: list[NodeView], num_prompt_tokens: int, page_size: int) -> tuple[NodeView, str]:
        loads = [self.load(node, num_prompt_tokens - _prefix_tokens(node, num_prompt_tokens, page_size),
                           num_prompt_tokens) for node in nodes]  # fmt: skip
        mean = sum(loads) / len(loads)
        limit = mean + max(self.config.imbalance_abs, self.config.imbalance_rel * mean)
        best = max(node.prefix_blocks for node in nodes)
        starved = [node for node, load in zip(nodes, loads) if load <= limit and node.prefix_blocks < best
                   and self._starved(node, len(nodes))]  # fmt: skip
        if starved:
            return self._fair_turn(starved), "starved"
        if best == 0:
            return self._fair_turn([node for node, load in zip(nodes, loads) if load <= limit]), "no_prefix"
        holders = [node for node, load in zip(nodes, loads) if node.prefix_blocks == best and load <= limit]
        if not holders:
            return self._least_loaded(nodes, loads), "imbalanced"
        if len(holders) == 1:
            return holders[0], "affinity"
        return self._fair_turn(holders), "affinity_tie"

    def _least_loaded(self, nodes: list[NodeView], loads: list[float]) -> NodeView:
        lowest = min(loads)
        return self._next_after([node for node, load in zip(nodes, loads) if load == lowest])

    def _fair_turn(self, nodes: list[NodeView]) -> NodeView:
        """The node sent the fewest of the recent requests; ties round robin. (Never empty:
        the least loaded node is always within the limit.)"""
        fewest = min(self._recent_counts[node.node_id] for node in nodes)
        return self._next_after([node for node in nodes if self._recent_counts[node.node_id] == fewest])

    def _starved(self, node: NodeView, num_nodes: int) -> bool:
        """Whether ``node`` was sent fewer than half its share of the recent requests (judged
        once the share is ``_STARVED_MIN_SHARE`` requests: fewer say nothing yet)."""
        share = len(self._recent) / num_nodes
        return share >= _STARVED_MIN_SHARE and self._recent_counts[node.node_id] < share / 2

    def _remember(self, node_id: str, uncached_tokens: int) -> None:
        self._last = node_id
        self._recent.append(node_id)
        self._recent_counts[node_id] += 1
        if len(self._recent) > self.config.fair_window:
            self._recent_counts[self._recent.popleft()] -= 1
        unit = self._learned_unit
        self._learned_unit = uncached_tokens if unit is None else unit + (uncached_tokens - unit) * self._UNIT_WEIGHT

    def _next_after(self, nodes: list[NodeView]) -> NodeView:
        """The first node (by id) after the last one chosen, cyclically: round robin that
        stays fair while the set of nodes changes."""
        ordered = sorted(nodes, key=lambda node: node.node_id)
        if self._last is not None:
            for node in ordered:
                if node.node_id > self._last:
                    return node
        return ordered[0]


def _prefix_tokens(node: NodeView, num_prompt_tokens: int, page_size: int) -> int:
    """Prompt tokens of the request ``node`` holds."""
    return min(node.prefix_blocks * page_size, num_prompt_tokens)
