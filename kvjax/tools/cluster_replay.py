"""Replay a request trace through a simulated cluster: the real router, real per-node caches.

``python -m kvjax replay TRACE --nodes N --device-blocks C [--host-blocks M]
[--router prefix|least_loaded|round_robin] --json``: capacity planning for a cluster of N
nodes of C device blocks each (and M host, K disk blocks each).

Model of the replay, request by request in timestamp order:

1. Every node's cache says how many leading blocks of the request it holds, any tier
   (``KVCache.match``; what the node would have published to the directory), and when it
   last dropped the request's first block from its last tier (folded from its cache's block
   events, as the node's publisher does: the directory's dropped entries, which expire
   ``DEFAULT_BLOCK_TTL_S`` after the drop here; another holder's refreshes can keep a real
   one longer).
2. The router's own policy (``kvjax.cluster.router.RoutingPolicy``, the code the HTTP router
   runs) chooses a node from those prefixes and each node's load at the arrival time.
3. The chosen node's cache serves the request as the single-node replay does
   (``kvjax.tools.replay.serve_request``: admit, commit, release; ``move_bytes=False``).

Remote fetch (``FetchModel``, on unless ``fetch=None``): past the chosen node's own hits, the
blocks the best other node holds are fetched when that is quicker than prefilling them (the
same rule as a node's: fetch time at the model's link against prefill time at the service
model's rate), and count as served; the chosen node then caches them like the rest of the
prompt. The router credits a node with what it could fetch at the model's cost ratio
(``RouterConfig.remote_fetch_cost``, unless the router config sets it).

Pooled caches (``ClusterSpec.pooled``): the nodes' caches become one cache of the cluster's
capacity with one eviction order, each node's blocks in a namespace of its own (no node hits
another's): capacity goes wherever the pressure is, everything else as above. A yardstick,
not a deployment: what cooperative caching (nodes handing what they drop to peers with colder
pages) could add at most; its gap to ``single_cache_block_hit_rate`` is what routing costs,
and the per-node replay's gap to it is what unpooled capacity costs.

Shared reuse statistics (``ClusterSpec.policy_share_s``, every 2 s by default; None: off):
nodes whose eviction policy is ``reuse`` exchange what their learners learned
(``ReusePolicy.statistics`` / ``merge_peer_statistics``: per kind trial and reuse counts,
horizon; never the history), as their publishers do through the directory at each heartbeat:
every ``policy_share_s`` seconds of the trace clock, each node publishes its statistics, then
merges the others'.

Load comes from a service-time model (``ServiceModel``, printed with the results): a node
prefills one request at a time, in arrival order, at ``prefill_tokens_per_s`` uncached prompt
tokens a second; a request then decodes its ``output_length`` tokens at
``decode_tokens_per_s`` (batched decoding: requests do not slow each other). At an arrival,
a node's load is what its HTTP server would report: requests whose modelled finish is later
(in flight), and the uncached prompt tokens of those whose modelled prefill ends later.

Figures (``ClusterReplayReport.as_dict``; rates are fractions of all prompt blocks):
``block_hit_rate`` served locally; ``remote_block_hit_rate`` served by a fetch from another
node; ``served_block_hit_rate`` the two together; ``reachable_remote_block_hit_rate`` blocks
past the chosen node's hits that another node held (what fetching could add at any cost);
``single_cache_block_hit_rate`` one cache of N x C device blocks (N x M host, N x K disk),
same policy; ``max_mean_requests`` the busiest node's requests over the mean;
``p95_window_max_mean_requests`` the same over every window of 50 x N consecutive arrivals,
95th percentile. The offline yardstick has every tier of every node's room, N x (C + M + K)
blocks, keeping a request's first C blocks as each node does; unlimited has no bound.
"""

from __future__ import annotations

import collections
import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from kvjax.cache.block_events import BlockEvent
from kvjax.cache.block_keys import Namespace, chained_block_keys
from kvjax.cache.policies import ReusePolicy, ReuseStatistics
from kvjax.cluster.node_view import DEFAULT_BLOCK_TTL_S, NodeLoad, NodeView
from kvjax.cluster.router import RECENT_PER_NODE, RouterConfig, RoutingPolicy
from kvjax.tiers.kv_cache import KVCache
from kvjax.tools.replay import (
    DEFAULT_POLICY,
    MAX_BLOCKS,
    REPLAY_NAMESPACE,
    ReplayReport,
    matched_blocks,
    replay_cache,
    replay_trace,  # fmt: skip
    serve_request,
)
from kvjax.tools.replay_bounds import HitCounter, HitCounts, intern_block_paths, offline_replay, unlimited_replay
from kvjax.tools.trace import MOONCAKE_BLOCK_TOKENS, TraceRequest

__all__ = [
    "DEFAULT_POLICY_SHARE_S",
    "WINDOW_REQUESTS_PER_NODE",
    "ClusterReplayReport",
    "ClusterSpec",
    "FetchModel",
    "ServiceModel",
    "cluster_replay",
    "format_cluster_report",
    "simulate_cluster",
    "window_max_mean",
    "yardsticks",
]

WINDOW_REQUESTS_PER_NODE = 50
"""Arrivals per node in a window of ``p95_window_max_mean_requests``."""

DEFAULT_POLICY_SHARE_S = 2.0
"""Seconds between exchanges of reuse statistics in the replay: a node's default heartbeat
(``DirectoryPublisher``: a third of the directory's 6 s node TTL)."""


@dataclasses.dataclass(frozen=True, slots=True)
class ServiceModel:
    """How long a request keeps a node busy (see the module docstring).

    The defaults are of the order of an 8B model in bf16 on one current accelerator: prefill
    20,000 tokens/s, decode 50 tokens/s per request.
    """

    prefill_tokens_per_s: float = 20_000.0  # uncached prompt tokens a node prefills per second
    decode_tokens_per_s: float = 50.0  # output tokens per second of one request

    def __post_init__(self) -> None:
        for name in ("prefill_tokens_per_s", "decode_tokens_per_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
                raise ValueError(f"{name}={value!r} must be a finite number > 0 (tokens per second)")

    def describe(self) -> str:
        return (f"service-time model: a node prefills one request at a time at {self.prefill_tokens_per_s:,.0f} "
                f"uncached prompt tokens/s, then the request decodes at {self.decode_tokens_per_s:,.0f} "
                "tokens/s (batched: no contention); load at an arrival = requests in flight + uncached "
                "prompt tokens not yet prefilled")  # fmt: skip


@dataclasses.dataclass(frozen=True, slots=True)
class FetchModel:
    """What fetching a block from another node costs, against prefilling it (see the module
    docstring). The defaults are an 8B model's KV in bf16 (32 layers x 8 KV heads x 128 x K, V
    x 2 bytes = 128 KiB a token) over a 100 Gb/s link: a 512-token block in 5.4 ms against
    25.6 ms of prefill at the default service model's rate."""

    kv_bytes_per_token: int = 131072
    link_bytes_per_s: float = 12.5e9
    latency_s: float = 1e-3  # per fetch: the ask and the transfer's start

    def __post_init__(self) -> None:
        for name in ("kv_bytes_per_token", "link_bytes_per_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
                raise ValueError(f"{name}={value!r} must be a finite number > 0")
        latency = self.latency_s  # its siblings' type check: "1" raised a TypeError, True passed for 1 s
        if isinstance(latency, bool) or not isinstance(latency, (int, float)) or not 0 <= latency < math.inf:
            raise ValueError(f"latency_s={self.latency_s!r} must be a finite number >= 0 (seconds)")

    def cost_ratio(self, service: ServiceModel) -> float:
        """Seconds to fetch a token's KV over seconds to prefill it (the router's
        ``remote_fetch_cost``), capped at 1."""
        return min(1.0, self.kv_bytes_per_token / self.link_bytes_per_s * service.prefill_tokens_per_s)

    def blocks_to_fetch(self, block_tokens: Sequence[int], service: ServiceModel) -> int:
        """How many of these blocks (their token counts, in order) to fetch: the leading run
        that saves the most seconds, 0 when none saves anything."""
        if not len(block_tokens):
            return 0
        tokens = np.cumsum(block_tokens, dtype=np.float64)
        saved = tokens / service.prefill_tokens_per_s - (self.latency_s + tokens * self.kv_bytes_per_token /
                                                          self.link_bytes_per_s)  # fmt: skip
        best = int(np.argmax(saved))
        return best + 1 if saved[best] > 0 else 0

    def describe(self, service: ServiceModel) -> str:
        return (f"remote fetch: {self.kv_bytes_per_token:,} bytes of KV a token over "
                f"{self.link_bytes_per_s / 1e9:g} GB/s, {1e3 * self.latency_s:g} ms a fetch: a token fetched costs "
                f"{self.cost_ratio(service):.2f} of one prefilled")  # fmt: skip


@dataclasses.dataclass(frozen=True, slots=True)
class ClusterSpec:
    """The simulated cluster: ``nodes`` nodes of ``device_blocks`` / ``host_blocks`` /
    ``disk_blocks`` blocks each (write-through or write-back to the host), every cache with
    eviction ``policy``; ``block_tokens`` tokens per trace block; ``policy_share_s``: seconds
    between exchanges of reuse statistics (``reuse`` policy only; None: every node learns
    alone); ``pooled``: the nodes' caches are one of the cluster's capacity (see the module
    docstring; nothing to share then)."""

    nodes: int
    device_blocks: int
    host_blocks: int = 0
    disk_blocks: int = 0
    write_through: bool = False
    policy: str = DEFAULT_POLICY
    block_tokens: int = MOONCAKE_BLOCK_TOKENS
    policy_share_s: float | None = DEFAULT_POLICY_SHARE_S
    pooled: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.nodes, bool) or not isinstance(self.nodes, int) or self.nodes < 1:
            raise ValueError(f"nodes={self.nodes!r} must be an int >= 1")
        share = self.policy_share_s
        if share is not None and (isinstance(share, bool) or not isinstance(share, (int, float))
                                  or not 0 < share < float("inf")):  # fmt: skip
            raise ValueError(f"policy_share_s={share!r} must be a positive finite number of seconds, or None")
        if not isinstance(self.pooled, bool):
            raise ValueError(f"pooled={self.pooled!r} must be a bool")
        for name in ("device_blocks", "host_blocks", "disk_blocks"):  # the yardsticks hold nodes x each
            per_node = getattr(self, name)
            if isinstance(per_node, int) and self.nodes * per_node > MAX_BLOCKS:
                raise ValueError(f"nodes x {name} = {self.nodes} x {per_node} = {self.nodes * per_node} blocks "
                                 f"exceeds {MAX_BLOCKS} (the one cache of the whole cluster's capacity)")

    @property
    def shares_statistics_s(self) -> float | None:
        """``policy_share_s`` where an exchange happens (several unpooled nodes under ``reuse``),
        else None."""
        shares = self.nodes > 1 and self.policy == ReusePolicy.name and not self.pooled
        return self.policy_share_s if shares else None

    def cache(self, nodes: int = 1) -> tuple[KVCache, list[float]]:
        """A cache of ``nodes`` nodes' capacities (one node's by default) and its clock
        (``replay_cache``; ValueError for a bad capacity)."""
        return replay_cache(nodes * self.device_blocks, policy=self.policy, host_blocks=nodes * self.host_blocks,
                            disk_blocks=nodes * self.disk_blocks, write_through=self.write_through)  # fmt: skip

    def node_caches(self) -> list[tuple[KVCache, list[float], Namespace]]:
        """Per node: its cache, the cache's clock and the namespace its blocks live in (one
        cache and clock shared by every node, a namespace each, when ``pooled``)."""
        if not self.pooled:
            return [(*self.cache(), REPLAY_NAMESPACE) for _ in range(self.nodes)]
        cache, clock = self.cache(self.nodes)
        return [(cache, clock, Namespace(tenant=f"{REPLAY_NAMESPACE.tenant}/node{node}")) for node in range(self.nodes)]


@dataclasses.dataclass(frozen=True, slots=True)
class ClusterReplayReport:
    """A cluster replay next to one cache of the cluster's whole capacity."""

    spec: ClusterSpec
    router: RouterConfig
    service: ServiceModel
    local: HitCounts  # served by the chosen node's cache
    remote_blocks: int  # blocks past the local hits that another node held
    requests_per_node: tuple[int, ...]
    p95_window_max_mean: float
    reasons: dict[str, int]  # routing decisions by ``Decision.reason``
    fetch: FetchModel | None = None
    fetched_blocks: int = 0  # of the remote blocks, those fetched (and so served)
    single_cache: HitCounts | None = None  # one cache of nodes x the capacities, same policy
    offline: HitCounts | None = None  # farthest-next-use at offline_blocks(spec): every tier of every node
    unlimited: HitCounts | None = None

    @property
    def max_mean_requests(self) -> float:
        counts = self.requests_per_node
        return max(counts) / (sum(counts) / len(counts)) if sum(counts) else 0.0

    @property
    def reachable_remote_block_hit_rate(self) -> float:
        return self.remote_blocks / self.local.blocks if self.local.blocks else 0.0

    @property
    def remote_block_hit_rate(self) -> float:
        """Blocks served by fetches from other nodes, over all blocks."""
        return self.fetched_blocks / self.local.blocks if self.local.blocks else 0.0

    @property
    def served_block_hit_rate(self) -> float:
        return self.local.block_hit_rate + self.remote_block_hit_rate

    def as_dict(self) -> dict[str, Any]:
        """The single-node replay's keys (``ReplayReport.as_dict``: the local hits, capacities
        per node, offline at the cluster's capacity) plus the cluster's; rates are fractions."""
        spec = self.spec
        single_node_keys = ReplayReport(spec.policy, spec.device_blocks, self.local, self.offline, self.unlimited,
                                        spec.host_blocks, spec.disk_blocks, spec.write_through).as_dict()  # fmt: skip
        return {
            **single_node_keys,
            "offline_blocks": offline_blocks(spec),
            "nodes": spec.nodes,
            "policy_share_s": spec.shares_statistics_s,  # None where nothing was shared
            "pooled": spec.pooled,
            "router": self.router.strategy,
            "share_slack_abs": self.router.share_slack_abs,
            "share_slack_rel": self.router.share_slack_rel,
            "long_prefix_slack": self.router.long_prefix_slack,
            "long_prefix_units": self.router.long_prefix_units,
            "imbalance_abs": self.router.imbalance_abs,
            "imbalance_rel": self.router.imbalance_rel,
            "tokens_per_load_unit": self.router.tokens_per_load_unit,
            "fair_window": self.router.fair_window,
            "prefill_tokens_per_s": self.service.prefill_tokens_per_s,
            "decode_tokens_per_s": self.service.decode_tokens_per_s,
            "remote_fetch_cost": self.router.remote_fetch_cost,
            "remote_fetch": None if self.fetch is None else dataclasses.asdict(self.fetch),
            "remote_block_hit_rate": self.remote_block_hit_rate,
            "served_block_hit_rate": self.served_block_hit_rate,
            "reachable_remote_block_hit_rate": self.reachable_remote_block_hit_rate,
            "single_cache_block_hit_rate": self.single_cache.block_hit_rate,
            "single_cache_token_hit_rate": self.single_cache.token_hit_rate,
            "requests_per_node": list(self.requests_per_node),
            "max_mean_requests": self.max_mean_requests,
            "p95_window_max_mean_requests": self.p95_window_max_mean,
            "route_reasons": dict(self.reasons),
        }


_DEFAULT_FETCH = FetchModel()


def cluster_replay(requests: Sequence[TraceRequest], spec: ClusterSpec, *, router: RouterConfig | None = None,
                   service: ServiceModel | None = None,
                   fetch: FetchModel | None = _DEFAULT_FETCH) -> ClusterReplayReport:  # fmt: skip
    """Replays ``requests`` (in the given order) through the cluster of ``spec``, routed by
    ``router`` (default ``RouterConfig()``) with load from ``service`` (default
    ``ServiceModel()``) and remote fetch by ``fetch`` (None: no fetch), next to the
    yardsticks at the cluster's whole capacity; see the module docstring. ValueError naming
    the value, before replaying anything, for a capacity out of range or an unknown policy."""
    run = simulate_cluster(requests, spec, router=router, service=service, fetch=fetch)
    return dataclasses.replace(run, **yardsticks(requests, spec))


def simulate_cluster(requests: Sequence[TraceRequest], spec: ClusterSpec, *, router: RouterConfig | None = None,
                     service: ServiceModel | None = None,
                     fetch: FetchModel | None = _DEFAULT_FETCH) -> ClusterReplayReport:  # fmt: skip
    """The cluster part of ``cluster_replay``, without the yardsticks (left None): a
    benchmark comparing strategies computes those once."""
    router, service = router or RouterConfig(), service or ServiceModel()
    if fetch is not None and router.remote_fetch_cost is None:
        router = dataclasses.replace(router, remote_fetch_cost=fetch.cost_ratio(service))
    caches = spec.node_caches()
    distinct = list({id(cache): cache for cache, _, _ in caches}.values())  # one when pooled
    drops = [_FirstBlockDrops(cache, namespace) for cache, _, namespace in caches] if router.follow_dropped else None
    first_keys: dict[tuple[Namespace, int], bytes] = {}
    node_ids = [f"n{index:0{len(str(spec.nodes - 1))}d}" for index in range(spec.nodes)]  # sort as the indices
    loads = _LoadModel(spec.nodes, service)
    routing = RoutingPolicy(router)
    paths, _ = intern_block_paths(requests)
    counter = HitCounter(spec.block_tokens)
    chosen = np.zeros(len(requests), np.int64)
    remote_blocks = fetched_blocks = 0
    reasons: collections.Counter[str] = collections.Counter()
    learners = [cache.trie.policy for cache in distinct]
    share_s = spec.shares_statistics_s
    next_share = -float("inf")
    for index, (request, path) in enumerate(zip(requests, paths)):
        now = request.timestamp_ms / 1000.0
        if share_s is not None and now >= next_share:
            next_share = now + share_s
            _share_statistics(learners)
        blocks = path[: spec.device_blocks]
        held = []
        for cache, clock, namespace in caches:
            clock[0] = now
            held.append(matched_blocks(cache, blocks, namespace))
        dropped = [0] * spec.nodes
        if drops is not None and blocks:
            oldest = request.timestamp_ms - DEFAULT_BLOCK_TTL_S * 1000  # older marks expired with their key
            for node, (drop, (_, _, namespace)) in enumerate(zip(drops, caches)):
                first = first_keys.get((namespace, blocks[0]))
                if first is None:
                    first = first_keys[namespace, blocks[0]] = chained_block_keys([blocks[0]], 1, namespace)[0]
                ms = drop.dropped_ms.get(first, 0)
                dropped[node] = ms if ms >= oldest else 0
        views = [NodeView(node_id, 1, "", loads.at(node, now), held[node], first_dropped_ms=dropped[node])
                 for node, node_id in enumerate(node_ids)]  # fmt: skip
        decision = routing.choose(views, request.input_length, spec.block_tokens)
        node = node_ids.index(decision.node_id)
        hit_blocks, lower_tiers = serve_request(caches[node][0], blocks, caches[node][2])
        for drop in drops or ():  # every node's: in a pooled cache a request evicts any node's blocks
            drop.update(max(1, round(request.timestamp_ms)))
        counter.add(request, hit_blocks, lower_tiers)
        reachable = max([0, *(held[other] - hit_blocks for other in range(spec.nodes) if other != node)])
        block_tokens = request.block_tokens(spec.block_tokens)
        fetched = 0 if fetch is None else fetch.blocks_to_fetch(block_tokens[hit_blocks : hit_blocks + reachable],
                                                                 service)  # fmt: skip
        remote_blocks += reachable
        fetched_blocks += fetched
        loads.add(node, now, sum(block_tokens[hit_blocks + fetched :]), request.output_length)
        chosen[index] = node
        reasons[decision.reason] += 1
    evicted = sum(cache.trie.dropped_pages for cache in distinct)
    for cache in distinct:
        cache.close()
    return ClusterReplayReport(
        spec=spec, router=router, service=service, local=counter.result(evicted_blocks=evicted),
        remote_blocks=remote_blocks, fetch=fetch, fetched_blocks=fetched_blocks,
        requests_per_node=tuple(int(count) for count in np.bincount(chosen, minlength=spec.nodes)),
        p95_window_max_mean=window_max_mean(chosen, spec.nodes, WINDOW_REQUESTS_PER_NODE * spec.nodes),
        reasons=dict(sorted(reasons.items())),
    )  # fmt: skip


def _share_statistics(learners: list[ReusePolicy]) -> None:
    """One exchange: every node publishes its statistics, then merges the others' (pooled:
    those before it and those after it, each pool built once; see ``ReuseStatistics.pooled``)."""
    published = [learner.statistics() for learner in learners]
    before: list[ReuseStatistics | None] = [None]
    for stats in published[:-1]:
        before.append(ReuseStatistics.pooled(filter(None, (before[-1], stats))))
    after = None
    for node in reversed(range(len(learners))):
        learners[node].merge_peer_statistics(filter(None, (before[node], after)))
        after = ReuseStatistics.pooled(filter(None, (published[node], after)))


class _FirstBlockDrops:
    """When one node's cache dropped each first block (no parent) of ``namespace`` from its
    last tier, in ms of the trace clock: what its publisher writes as dropped entries, folded
    from the cache's block events."""

    def __init__(self, cache: KVCache, namespace: Namespace = REPLAY_NAMESPACE):
        self._namespace = namespace.digest()
        self._subscription = cache.subscribe()
        self._tiers: dict[bytes, set[str]] = {}  # first blocks held: key -> tiers
        self.dropped_ms: dict[bytes, int] = {}

    def update(self, now_ms: int) -> None:
        for batch in self._subscription.poll():
            for event in batch:
                if event.kind == "cleared" or event.namespace == self._namespace:
                    self._fold(event, now_ms)

    def _fold(self, event: BlockEvent, now_ms: int) -> None:
        if event.kind == "cleared":
            for key, tiers in list(self._tiers.items()):
                tiers.discard(event.tier)
                if not tiers:
                    del self._tiers[key]
                    self.dropped_ms[key] = now_ms
        elif event.parent is None:
            if event.kind == "stored":
                self._tiers.setdefault(event.key, set()).add(event.tier)
                self.dropped_ms.pop(event.key, None)
            elif event.key in self._tiers:
                tiers = self._tiers[event.key]
                tiers.discard(event.tier)
                if not tiers:
                    del self._tiers[event.key]
                    self.dropped_ms[event.key] = now_ms


def yardsticks(requests: Sequence[TraceRequest], spec: ClusterSpec) -> dict[str, HitCounts]:
    """``single_cache``, ``offline`` and ``unlimited`` at the capacity of the whole cluster,
    as ``ClusterReplayReport`` fields."""
    total = spec.nodes * spec.device_blocks
    return {
        "single_cache": replay_trace(requests, total, policy=spec.policy, block_tokens=spec.block_tokens,
                                     host_blocks=spec.nodes * spec.host_blocks,
                                     disk_blocks=spec.nodes * spec.disk_blocks, write_through=spec.write_through),
        "offline": offline_replay(requests, offline_blocks(spec), block_tokens=spec.block_tokens,
                                  kept_blocks=spec.device_blocks),  # as every node computes no more
        "unlimited": unlimited_replay(requests, block_tokens=spec.block_tokens),
    }  # fmt: skip


def offline_blocks(spec: ClusterSpec) -> int:
    """The offline yardstick's room: every tier of every node."""
    return spec.nodes * (spec.device_blocks + spec.host_blocks + spec.disk_blocks)


def window_max_mean(chosen: np.ndarray, nodes: int, window: int, quantile: float = 95.0) -> float:
    """The ``quantile`` of max/mean requests per node over every ``window`` consecutive
    requests (sliding by one; the whole run if it is shorter). ``chosen``: node per request."""
    if len(chosen) == 0:
        return 0.0
    window = min(window, len(chosen))
    one_hot = np.zeros((len(chosen) + 1, nodes), np.int64)
    one_hot[np.arange(1, len(chosen) + 1), chosen] = 1
    running = one_hot.cumsum(axis=0)
    counts = running[window:] - running[:-window]  # [num_windows, nodes]
    return float(np.percentile(counts.max(axis=1) / (window / nodes), quantile))


def format_cluster_report(trace: str, report: ClusterReplayReport) -> str:
    """Human-readable summary: the configuration, the service model, hit rates next to one
    cache of the same total capacity, and how evenly the requests spread."""
    local, router, spec = report.local, report.router, report.spec
    total = spec.nodes * spec.device_blocks
    write = "write-through" if spec.write_through else "write-back"
    rates = [("served locally", local), (f"one cache of {total} device blocks", report.single_cache),
             (f"offline at {offline_blocks(spec)} blocks", report.offline),
             ("unlimited capacity", report.unlimited)]  # fmt: skip
    lines = [
        f"trace {trace}: {local.requests} requests, {local.blocks} blocks, {local.tokens} prompt tokens",
        (f"cluster: {spec.nodes} nodes x {spec.device_blocks} device blocks ({spec.host_blocks} host, "
         f"{spec.disk_blocks} disk; {write}), policy {spec.policy}"
         + (", pooled into one cache (one eviction order; a namespace per node)" if spec.pooled else "")),
        (f"router {router.strategy} (share_slack_abs={router.share_slack_abs:g}, "
         f"share_slack_rel={router.share_slack_rel:g}, long_prefix_slack={router.long_prefix_slack:g}, "
         f"long_prefix_units={router.long_prefix_units:g}, imbalance_abs={router.imbalance_abs:g}, "
         f"imbalance_rel={router.imbalance_rel:g}, tokens_per_load_unit={router.tokens_per_load_unit or 'learned'}, "
         f"fair_window={router.fair_window or f'{RECENT_PER_NODE} per node'})"),
        report.service.describe(),
        report.fetch.describe(report.service) if report.fetch is not None else "remote fetch: off",
        f"{'':<36}{'block hits':>12}{'token hits':>12}",
    ]  # fmt: skip
    for label, counts in rates:
        if counts is not None:
            lines.append(f"{label:<36}{counts.block_hit_rate:>12.2%}{counts.token_hit_rate:>12.2%}")
        if counts is local:
            lines.append(f"{'  fetched from another node':<36}{report.remote_block_hit_rate:>12.2%}")
            lines.append(f"{'  served (local + fetched)':<36}{report.served_block_hit_rate:>12.2%}")
            lines.append(f"{'  another node held more':<36}{report.reachable_remote_block_hit_rate:>12.2%}")
    lines.append(f"requests per node: {', '.join(map(str, report.requests_per_node))}; max/mean "
                 f"{report.max_mean_requests:.3f}; windows of {WINDOW_REQUESTS_PER_NODE * spec.nodes} arrivals: "
                 f"p95 max/mean {report.p95_window_max_mean:.3f}")  # fmt: skip
    lines.append("routing reasons: " + ", ".join(f"{reason} {count}" for reason, count in report.reasons.items()))
    return "\n".join(lines)


class _LoadModel:
    """Modelled finish times of the requests each node was given (see ``ServiceModel``)."""

    def __init__(self, nodes: int, service: ServiceModel):
        self.service = service
        self.prefill_free = [0.0] * nodes  # when each node's prefill queue empties
        # per node: [prefill end, finish, uncached tokens] of requests not yet finished
        self.running: list[list[tuple[float, float, int]]] = [[] for _ in range(nodes)]

    def at(self, node: int, now: float) -> NodeLoad:
        running = self.running[node] = [entry for entry in self.running[node] if entry[1] > now]
        return NodeLoad(len(running), sum(tokens for prefilled, _, tokens in running if prefilled > now))

    def add(self, node: int, now: float, uncached_tokens: int, output_tokens: int) -> None:
        prefilled = max(now, self.prefill_free[node]) + uncached_tokens / self.service.prefill_tokens_per_s
        self.prefill_free[node] = prefilled
        self.running[node].append((prefilled, prefilled + output_tokens / self.service.decode_tokens_per_s,
                                   uncached_tokens))  # fmt: skip
