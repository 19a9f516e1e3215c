"""Routing: which node serves a request, given what the directory says each live node holds.

Strategies (``STRATEGIES``):

* ``prefix`` (the default), affinity bounded by each node's share of the recent requests:
  the node holding the longest cached prefix of the request (any tier), among the nodes
  that are within their share and not overloaded; nodes tied on that prefix take fair
  turns; when nobody eligible holds any of it, every eligible node ties at zero blocks.
* ``least_loaded``: the node with the lowest load, ties round robin.
* ``round_robin``: every live node in turn.

Within its share, for a request: the node was sent at most ``share + max(share_slack_abs,
share_slack_rel * share)`` of the recent requests counting this one, where the recent
requests are the router's last ``fair_window`` decisions (default: ``RECENT_PER_NODE`` per
live node) and ``share`` their number over the live nodes. A bounded-load rule, as in
consistent hashing with bounded loads: a holder keeps its prefix's requests until it is
over its share, then the longest prefix among the others takes them, and from then on the
two hold it and take turns. With a stable set of nodes, every run of ``fair_window``
consecutive requests has per-node counts within that bound, beyond the requests the safety
valve below sent the node (the last other request a node took in the run was within the
bound, and the run's earlier ones were counted with it; a node within its share always
exists, since the counts average below the share). A property test checks this on random
holdings and loads. When every
request shares one system prompt, the first holder takes requests up to the bound, then
the next node caches the prompt too, and so on until all hold it and take turns: the
failure of a weighted cost (matched blocks minus a weight times load), where the node
that cached the prompt first wins every comparison the weight does not overturn, cannot
happen.

Overloaded, for a request: a node's load *with the request placed on it* (its load plus the
request's uncached prefill there) exceeds the mean of those loads over the live nodes by more
than ``max(imbalance_abs, imbalance_rel * that mean)``. An overloaded node is skipped like
one over its share; when every node within its share is overloaded, the least loaded node
of all takes the request (reason "overloaded"). A safety valve for a node that fell behind
(slow, stalled, a queue of long prompts), not the balancer: in-flight load is a poor
proxy for a share of requests when outputs run from 4 to 900 tokens, so a tight guard breaks
affinity for nothing. Measured with the cluster replay on the shared trace
(``benchmarks/bench_cluster_replay.py``; 4 and 8 nodes of 2,000 and 8,000 blocks): the
former default (2 load units, 25% of the mean, no share bound) broke affinity on 2-3% of
requests and lost 1.5-3 points of hits at 2,000 blocks while windows of 50 x N requests
still reached max/mean 1.18-1.22 (p95); the share bound at 15% meets max/mean 1.15 in every
window by construction, and the guard at (16 units, 50% of the mean) costs no measurable
hits. Choices
kept from before:

* the mean, not the least loaded node, is the reference: the least of N loads falls as N
  grows;
* the request is counted where it would land: a holder is credited with the prefill its hit
  saves;
* uncached prefill tokens count in units of the mean uncached prompt the router has routed
  (``tokens_per_load_unit=None``, the default; an int fixes the unit).

Fair turns: among the candidates, the node sent the fewest of the recent requests goes
first (ties round robin). A plain round-robin pointer lets the requests that affinity pins
to a node pile up on top of its share of the others; fair turns give the others to the
nodes affinity left behind, which keeps the share bound from having to move pinned ones.

Returning prefixes (``follow_dropped``, on by default): when no node holds a request's first
block, the node that dropped that block last (the directory keeps, per node and epoch, when a
node's first blocks left its last tier) takes the request if it is eligible, else fair turns
as above. The prefix comes back to the cache that saw it before: that node's eviction policy
remembers it (``reuse`` counts a page that returns after eviction as one seen before and
keeps it longer), so a conversation or document that outlived every cache is treated as the
repeat it is rather than as a stranger wherever fair turns put it. Drop times are each node's
own clock: clocks further apart than two drops can pick the earlier dropper, a worse hint and
never wrong KV. Measured with the cluster replay on
the shared trace (``benchmarks/bench_cluster_replay.py [--no-follow-dropped]``; 4/8 nodes x
2,000/8,000 blocks, eviction policy reuse): local gap to one cache of N x C +3.41, +0.46,
+2.37, +0.79 points without it, +1.42, +0.59, +1.66, +0.79 with it; served (local +
fetched) +3.21, +0.08, +1.72, +0.00 -> +1.13, +0.19, +1.16, +0.00 (the 8,000-block rows move
within the tie-breaking noise); 640 and 249 of 3,993 requests returned at 2,000 blocks, with
max/mean <= 1.009 and window p95 <= 1.12 as before. With lru: +0.82, +0.49, +1.06, +0.79.
Generated shapes (``--shape``, 4,000 requests): scan +1.52 -> +0.75 and +0.74 -> +0.54 at
2,000 blocks, the others unchanged or within 0.4 points (mixed 8 x 2,000 +1.54 -> +1.94
local, served +0.01 both); most of them fit their caches and drop nothing.

The trade-off, and what is left on the table: a request moved off a holder over its share
recomputes its prefix (or fetches it), and when conversations continue in bursts the bound
moves some; the ones that hurt are follow-ups of long conversations, whose prefix is long.
So the slack has two levels: ``share_slack_rel`` (0.10) for any request, and
``long_prefix_slack`` times that (1.5: 0.15) for a request whose longest holders would save
more than ``long_prefix_units`` (4) typical prompts of prefill against the best node within
the plain slack. Cheap requests leave a busy holder first and the expensive ones stay, and
every window still holds the wide bound (1.15 of the share, plus the absolute slack).
``bench_cluster_replay.py --share-slack-rel`` prints the frontier. Measured (4/8 nodes x
2,000/8,000 blocks, remote fetch on; local gap to one cache of N x C in points, window p95
of max/mean):

* shared trace, eviction policy lru (routing apart from the policy): local gap +1.02, +0.38,
  +0.99, +0.79, window p95 1.08, 1.10, 1.12, 1.12; served (local + fetched) +0.67, +0.06,
  +0.38, +0.00. One slack of 0.15 for every request: local +1.08, +0.60, +1.08, +1.19, p95
  up to 1.14; no bound: p95 1.14-1.26. At 2,000 blocks about a point is lost to capacity
  that is not pooled, bound or not.
* the same with the default policy (reuse): local gap +3.70, +1.37, +5.55, +0.79, served
  +3.57, +0.81, +5.25, +0.00: reuse learns from one node's share of the traffic, and at
  2,000 blocks per node it does worse than lru there (49.9% vs 52.0% local at 8 x 2,000)
  while one cache of 16,000 blocks does better (55.4% vs 53.0%); the router is not the cause.
* generated ``chat`` (trace_family): local gap +0.37 to +0.88, served <= 0.04, window p95
  1.10 (one slack of 0.15: +0.90 to +1.61, p95 1.14; no bound: <= 0.08 but max/mean 1.32
  and window p95 2.18 at 8 nodes, a popular conversation pins a node).
* generated ``rag``: local gap +0.37 to +0.50, window p95 1.10 (one slack of 0.15: +0.17 to
  +0.31, p95 1.12-1.14).

Load is counted at routing time: a node's load is its in-flight requests plus its uncached
prefill tokens in load units; the router adds each request it sends (``Directory.add_load``)
before the node's own figures catch up, so a burst does not see stale zeros. The recent
decisions and the learned token unit are the router's only memory: a restarted router
starts them afresh and is even again within one window.

Remote fetch (``remote_fetch_cost``, off when None): nodes that fetch a prefix another node
holds (``kvjax.cluster.remote_fetch``) prefill less than their own cache says. When the
longest holders are skipped (over their share or overloaded) and the request goes
elsewhere, the least loaded of the other nodes is chosen (instead of the longest prefix
among them) by loads that credit each node, on top of its own prefix, with the blocks past it that the best
other node holds, each counted as cached minus ``remote_fetch_cost`` (seconds to fetch a
block over seconds to recompute it; ``remote_credit_tokens``). The guard and affinity still
go by each node's own prefix: measured with the cluster replay on the shared trace (4/8
nodes x 2,000/8,000 blocks, cost 0.21), crediting fetchable blocks in the guard's loads too
sent 1.6-2.6x as many requests away from their holders, served up to 0.4 points fewer blocks
(local + fetched) and fetched 4.4% of all blocks at 4 x 8,000 (1.3% without): a fetched
block is one copy more, and copies cost the cluster capacity.

The policy is plain code over ``NodeView`` lists: the HTTP router, the benchmark and the
cluster replay (simulated nodes, no Redis) call the same ``RoutingPolicy.choose``.
"""

from __future__ import annotations

import collections
import dataclasses
import threading
from collections.abc import Collection, Sequence

from kvjax.cluster.node_view import NodeView

__all__ = ["RECENT_PER_NODE", "STRATEGIES", "Decision", "RouterConfig", "RoutingPolicy", "remote_credit_tokens"]

STRATEGIES = ("prefix", "least_loaded", "round_robin")
RECENT_PER_NODE = 50
"""Recent decisions per live node that fair turns and the share bound count by default: the
window of ``p95_window_max_mean_requests`` in the cluster replay (50 x N requests)."""


@dataclasses.dataclass(frozen=True, slots=True)
class RouterConfig:
    """How the router chooses; see the module docstring.

    ``share_slack_abs`` (requests) and ``share_slack_rel`` (a fraction of the share): how far
    over its share of the recent requests a node may go; ``long_prefix_slack`` (a multiple
    of that slack): how far for a request its longest holders would save more than
    ``long_prefix_units`` typical prompts of prefill (in load units) against the best node
    within the plain slack; ``imbalance_abs`` is in load units
    (requests), ``imbalance_rel`` a fraction of the mean load; ``tokens_per_load_unit``
    converts uncached prefill tokens into load units (None: the mean uncached prompt of
    recent requests); ``fair_window``: how many recent decisions fair turns and the share
    bound count (None: ``RECENT_PER_NODE`` per live node); ``remote_fetch_cost``: seconds to
    fetch a block from another node over seconds to recompute it, in [0, 1] (None: nodes do
    not fetch; see the module docstring); ``follow_dropped``: a request whose first block no
    node holds goes to the node that dropped that block last, if it is eligible (see the
    module docstring).
    """

    strategy: str = "prefix"
    share_slack_abs: float = 2.0
    share_slack_rel: float = 0.10
    long_prefix_slack: float = 1.5
    long_prefix_units: float = 4.0
    imbalance_abs: float = 16.0
    imbalance_rel: float = 0.5
    tokens_per_load_unit: int | None = None
    fair_window: int | None = None
    remote_fetch_cost: float | None = None
    follow_dropped: bool = True

    def __post_init__(self) -> None:
        if self.strategy not in STRATEGIES:
            raise ValueError(f"strategy={self.strategy!r}; expected one of {STRATEGIES}")
        if not self.share_slack_abs >= 1 or not self.share_slack_rel >= 0:
            raise ValueError(f"share_slack_abs={self.share_slack_abs!r} must be >= 1 (requests) and "
                             f"share_slack_rel={self.share_slack_rel!r} >= 0")  # fmt: skip
        if not self.long_prefix_slack >= 1 or not self.long_prefix_units >= 0:
            raise ValueError(f"long_prefix_slack={self.long_prefix_slack!r} must be >= 1 (a multiple of the "
                             f"share slack) and long_prefix_units={self.long_prefix_units!r} >= 0")  # fmt: skip
        if not self.imbalance_abs >= 0 or not self.imbalance_rel >= 0:
            raise ValueError(f"imbalance_abs={self.imbalance_abs!r} and imbalance_rel={self.imbalance_rel!r} "
                             "must be >= 0")  # fmt: skip
        unit = self.tokens_per_load_unit
        if unit is not None and (isinstance(unit, bool) or not isinstance(unit, int) or unit < 1):
            raise ValueError(f"tokens_per_load_unit={unit!r} must be an int >= 1, or None (learned)")
        window = self.fair_window
        if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
            raise ValueError(f"fair_window={window!r} must be an int >= 1 (decisions), or None "
                             f"({RECENT_PER_NODE} per live node)")  # fmt: skip
        if not isinstance(self.follow_dropped, bool):
            raise ValueError(f"follow_dropped={self.follow_dropped!r} must be a bool")
        cost = self.remote_fetch_cost
        if cost is not None and (isinstance(cost, bool) or not isinstance(cost, (int, float)) or not 0 <= cost <= 1):
            raise ValueError(f"remote_fetch_cost={cost!r} must be a number in [0, 1] (fetch over recompute "
                             "seconds), or None (nodes do not fetch)")  # fmt: skip


@dataclasses.dataclass(frozen=True, slots=True)
class Decision:
    """Where a request goes and why.

    ``reason``: "affinity" (longest prefix, one holder), "affinity_tie" (holders took turns),
    "over_share" (the longest holders were over their share: the longest prefix among the
    others), "imbalanced" (the longest holders were overloaded: the same), "overloaded"
    (every node within its share was overloaded: the least loaded of all, the safety valve),
    "returning" (nobody holds any; the node that dropped the first block last, see
    ``follow_dropped``), "no_prefix" (nobody holds any: fair turns), "least_loaded",
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
        self._recent: collections.deque[str] = collections.deque()  # the last choices, newest last
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
                node, reason = self._guarded_affinity(candidates, num_prompt_tokens, page_size, len(nodes))
            uncached = num_prompt_tokens - _prefix_tokens(node, num_prompt_tokens, page_size)
            self._remember(node.node_id, max(uncached, page_size))
        return Decision(node, reason, node.prefix_blocks, uncached)

    # --- helpers ---------------------------------------------------------------------------

    def _guarded_affinity(self, nodes: list[NodeView], num_prompt_tokens: int, page_size: int,
                          num_live: int) -> tuple[NodeView, str]:  # fmt: skip
        within, within_wide = self._within_share(nodes, num_live)
        top = max(node.prefix_blocks for node in nodes)
        if top and not all(ok for node, ok in zip(nodes, within) if node.prefix_blocks == top):
            # moving this request off its longest holders recomputes (top - rest) pages: when
            # that is more than long_prefix_units typical prompts, they keep it up to the wide bound
            rest = max((node.prefix_blocks for node, ok in zip(nodes, within) if ok), default=0)
            if (top - rest) * page_size > self.config.long_prefix_units * self.tokens_per_load_unit(num_prompt_tokens):
                within = [ok or (wide and node.prefix_blocks == top)
                          for node, ok, wide in zip(nodes, within, within_wide)]  # fmt: skip
        loads = [self.load(node, num_prompt_tokens - _prefix_tokens(node, num_prompt_tokens, page_size),
                           num_prompt_tokens) for node in nodes]  # fmt: skip
        mean = sum(loads) / len(loads)
        limit = mean + max(self.config.imbalance_abs, self.config.imbalance_rel * mean)
        eligible = [node for node, load, ok in zip(nodes, loads, within) if ok and load <= limit]
        if not eligible:  # every node within its share is overloaded: the safety valve
            credited = self._fetch_credited(nodes, loads, nodes, num_prompt_tokens, page_size)
            return self._least_loaded(nodes, credited), "overloaded"
        best = max(node.prefix_blocks for node in eligible)
        holders = [node for node in eligible if node.prefix_blocks == best]
        if best < top:  # the longest holders are over their share or overloaded
            over = any(node.prefix_blocks == top and not ok for node, ok in zip(nodes, within))
            reason = "over_share" if over else "imbalanced"
            if self.config.remote_fetch_cost is None:
                return self._fair_turn(holders), reason
            eligible_loads = [load for load, ok in zip(loads, within) if ok and load <= limit]
            credited = self._fetch_credited(eligible, eligible_loads, nodes, num_prompt_tokens, page_size)
            return self._least_loaded(eligible, credited), reason
        if best == 0:
            dropped = max(node.first_dropped_ms for node in holders) if self.config.follow_dropped else 0
            if dropped:
                return self._fair_turn([node for node in holders if node.first_dropped_ms == dropped]), "returning"
            return self._fair_turn(holders), "no_prefix"
        if len(holders) == 1:
            return holders[0], "affinity"
        return self._fair_turn(holders), "affinity_tie"

    def _within_share(self, nodes: list[NodeView], num_live: int) -> tuple[list[bool], list[bool]]:
        """Per node: whether one more request keeps it within its share of the recent ones
        (this one included), with the plain slack and with the long-prefix one; the share
        taken over the ``num_live`` live nodes (candidates excluded for a retry included, so a
        retry keeps the window). The recent window is trimmed to the live nodes' size first."""
        window = self.config.fair_window or RECENT_PER_NODE * num_live
        while len(self._recent) >= window:  # room for this request
            self._recent_counts[self._recent.popleft()] -= 1
        share = (len(self._recent) + 1) / num_live
        slack = max(self.config.share_slack_abs, self.config.share_slack_rel * share)
        counts = [self._recent_counts[node.node_id] + 1 for node in nodes]
        wide = share + self.config.long_prefix_slack * slack
        return [count <= share + slack for count in counts], [count <= wide for count in counts]

    def _fetch_credited(self, nodes: list[NodeView], loads: list[float], live: list[NodeView],
                        num_prompt_tokens: int, page_size: int) -> list[float]:  # fmt: skip
        """``loads`` of ``nodes`` less what each would not prefill because it fetches it from
        the best of ``live`` (the remote-fetch term; ``loads`` as they are without
        ``remote_fetch_cost``)."""
        cost = self.config.remote_fetch_cost
        if cost is None:
            return loads
        unit = self.tokens_per_load_unit(num_prompt_tokens)
        return [load - remote_credit_tokens(node, live, num_prompt_tokens, page_size, cost) / unit
                for node, load in zip(nodes, loads)]  # fmt: skip

    def _least_loaded(self, nodes: list[NodeView], loads: list[float]) -> NodeView:
        lowest = min(loads)
        return self._next_after([node for node, load in zip(nodes, loads) if load == lowest])

    def _fair_turn(self, nodes: list[NodeView]) -> NodeView:
        """The node sent the fewest of the recent requests; ties round robin."""
        fewest = min(self._recent_counts[node.node_id] for node in nodes)
        return self._next_after([node for node in nodes if self._recent_counts[node.node_id] == fewest])

    def _remember(self, node_id: str, uncached_tokens: int) -> None:
        self._last = node_id
        self._recent.append(node_id)
        self._recent_counts[node_id] += 1
        # the prefix strategy trims to the live nodes' window before it chooses; a fixed
        # window (or the default at the largest cluster seen) bounds the memory otherwise
        window = self.config.fair_window or RECENT_PER_NODE * max(len(self._recent_counts), 1)
        while len(self._recent) > window:
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


def remote_credit_tokens(node: NodeView, nodes: Sequence[NodeView], num_prompt_tokens: int, page_size: int,
                         fetch_cost: float) -> int:  # fmt: skip
    """The remote-fetch term of a node's score: prompt tokens past ``node``'s own prefix that
    the best other node holds, times ``1 - fetch_cost`` (what fetching them saves, in tokens
    of prefill); 0 when nobody holds more."""
    own = _prefix_tokens(node, num_prompt_tokens, page_size)
    best = max((_prefix_tokens(other, num_prompt_tokens, page_size) for other in nodes if other is not node), default=0)
    return int(max(0, best - own) * (1.0 - fetch_cost))


def _prefix_tokens(node: NodeView, num_prompt_tokens: int, page_size: int) -> int:
    """Prompt tokens of the request ``node`` holds."""
    return min(node.prefix_blocks * page_size, num_prompt_tokens)
