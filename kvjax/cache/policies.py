"""Eviction policies by name: which unlocked, unpinned leaf of the prefix trie goes first.

Each policy is a small ``EvictionPolicy`` (see ``kvjax.cache.eviction``) with one
``priority(node, now)``; ``make_policy`` builds one by name and ``POLICIES`` lists them. Add
one by subclassing ``EvictionPolicy`` here and registering it in ``POLICIES``.

* ``lru``: least recently used first; ``lfu``: fewest hits first, then LRU;
* ``cost_aware``: smallest expected loss (reuse likelihood x the cost model's miss seconds);
* ``segmented`` and ``adaptive``: scan-resistant segments, below;
* ``reuse`` (the default): predicted reuse, learned per kind of node, below.

Predicted reuse (``reuse``). A node's priority is ``last_access + W[kind]``: LRU inside each
kind, and a kind that is reused less often within the cache's reach goes earlier. The kind of
a node, read off the node when it is observed, is where it sits and what it has lived through:
- where: at the root of its namespace (``first_page == 0``: a system prompt, a document a
  request starts with, a one-off scan) or deeper (a chat turn, a tool step, a query behind a
  template, a retrieved document behind others);
- its history: fresh (inserted, never used since), returned (inserted again after it had been
  evicted: its key is still in the history), hit once, hit twice or more.
For each kind the policy counts nodes observed in it (trials) and those used again within
the horizon ``H`` (seconds) after that observation; ``p[kind]`` is their ratio and
``W[kind] = H * ln p[kind]`` (seconds, <= 0). That is the ordering of
``value = p[kind] * exp(-age / H)``: a page's chance of being used again, fading with age on
the cache's own time scale, so equal rates give plain LRU and a kind reused 10x less often
goes ``H ln 10`` seconds earlier. A reuse seen after a node's pages were evicted counts as
much as one seen while cached, so a kind the cache keeps too briefly to be hit is not
condemned by its own evictions. ``H`` is the age that separates hits from misses in what the
policy sees: a hit older than ``H`` raises it, a return younger than ``H`` lowers it (a
stochastic boundary estimate in log space whose steps shrink as ``1/sqrt(events)`` from a
factor of e to ``horizon_step``: fast while nothing is known, steady after), so it follows the
cache's capacity and the workload without knowing either. Counts are halved every
``memory`` trials so the estimates follow a changing workload.

Learning from the first request on, without the first requests misleading it:
- a trial is counted once its outcome is known (censoring): as reused when its node is used
  again within ``H``, as not reused once ``H`` has passed without that. A trial still open
  counts neither way, so a kind whose nodes are young (at the start, or one growing) does not
  look unused merely because its reuses have not had time to come;
- the counts start from a prior of a few pseudo-trials per kind: a fresh node is reused with
  probability 0.1, one seen before (returned or hit) with 0.9: at full trust, a softened
  segmented LRU (a page used once goes ``H ln 9`` seconds before a page used again); a kind's
  own trials outweigh it after a few dozen;
- ``W`` is recomputed after 1, 2, 4, ... trials, then every 256;
- the learned order is trusted as far as evidence has accrued: ``priority`` adds
  ``trust * W[kind]`` with ``trust = n / (n + trust_trials)``, ``n`` the trials closed so far
  (never halved). With no evidence that is plain LRU; half-way after ``trust_trials`` (200)
  closed trials, nearly the full learned order after a few thousand. Early estimates (of
  ``p`` and, more, of ``H``, whose first steps are a factor of e) ranked hot kinds wrongly
  while a cache still filled: a cluster node's cache, which sees ~500 requests of the shared
  trace, lost up to 4% of its hits to LRU that way.

What ``reuse`` observes, O(1) per node: the node it is asked about and, walking up, each
ancestor whose access is newer than what the history holds for it (the request's path; the
walk stops at the first one already up to date). The history maps ``(first_page, key)`` (the
node's depth and the token bytes of its first page, ``node.key``) to its latest trial: last
access, kind and weight (``sqrt(num_pages)``: a long run counts more than a one-page node, less than
per page, so one hot system prompt does not stand for every page of its kind); it holds
``history_nodes`` entries, oldest dropped first, and at most as many trials are open (beyond
that the oldest is counted as not reused). A node evicted in part and inserted again
from the cut is seen as fresh (a miss of the history; costs a worse estimate, never wrong KV).

Scan resistance (``segmented``, ``adaptive``): probation and protected segments, a ghost
history, an adaptive balance. Leaves of the prefix trie fall into two segments:
- probation: pages used by one request only so far (``hits == 0``), e.g. a one-off long
  document or the newest turn of a chat;
- protected: pages used again, either while cached (``hits >= 1``) or after they had been
  evicted (their fingerprint is still in the ghost history).

Priority (lower goes first) is ``last_access`` for probation and ``last_access + W`` for
protected pages: LRU inside each segment, and a protected page outlives a probation page used
up to ``W`` seconds after it. ``segmented`` fixes ``W`` at infinity (strict: probation always
goes first). ``adaptive`` sets ``W = omega * R``, where ``R`` (seconds) is a
moving average of the age at which cached pages get hit (the workload's own time scale) and
``omega`` (dimensionless, in ``[0, max_omega]``) is steered by near misses, as in ARC: a page
that comes back within ``2 R`` after it was evicted from protected asks for a larger ``omega``;
one evicted from probation asks for a smaller one. Each step is weighted by the ratio of the
ghost's two populations, so a flood of one-off pages (a scan) makes probation misses count
for little.

The ghost remembers ``ghost_pages`` fingerprints ``(page index, token bytes of the page)``
with the last access and segment they had when last seen; it only ever changes priorities,
never which KV a request gets, so a fingerprint shared by two prefixes or two namespaces
costs at most a worse eviction choice. Observing a node costs O(its pages).

Sharing what a cluster learned (``statistics``, ``merge_peer_statistics``). A cluster node's
cache sees 1/N of the traffic, so its learner has 1/N of the evidence a single cache of the
cluster's size would have. Nodes can exchange what they learned, never their history: each
publishes its own counts (``ReuseStatistics``: per kind trials and reuses, the prior left out,
as halved by its own ``memory``; closed trials; its horizon and the boundary events behind
it), and merges the latest statistics of its live peers: ``p[kind]`` becomes
``(own reused + peers' reused) / (own trials + peers' trials)`` (own prior included once),
the trust ramp counts the peers' closed trials too, and the horizon H in use is the geometric
mean of the node's own (``own_horizon``: learned from its own cache's boundary events alone,
what it publishes) and the peers' horizons, weighted by boundary events. Each merge replaces
the last (statistics are snapshots, not deltas: one lost or repeated exchange changes
nothing, and a dead node's statistics are simply left out of the next merge). On the shared
Mooncake trace at 2,000 blocks per node, exchanging every 2 s closes 0.35 (4 nodes) and 0.92
(8 nodes) point of the served gap to one cache of the cluster's size, 0.75 and 0.42 on the
mean of four copies with 1% of the requests dropped: a spread of +-0.4 from trace to trace
(``benchmarks/bench_cluster_replay.py``).

``adaptive`` priorities are stamped when a node becomes evictable (``time_invariant``); a
later change of ``W`` applies to nodes pushed after it. ``reuse`` ranks with the offsets of
the moment: the queue keeps one lane per kind, LRU within it (all its nodes share an
offset), and evicts the lane head lowest by ``last_access + offset`` now (``num_lanes``,
``kvjax.cache.eviction``). Stamped at push, an offset goes stale as ``H`` and the trust in
the learned order grow: a node cached while trust was low keeps a near-LRU rank, and one of a
kind the policy has since learned to evict early outlives newer nodes of kinds it keeps. On
large caches, where nodes live longest, stamps left the policy below LRU on four traces (by
up to 0.16% of the hits, ``bench_policies.py --quick --fractions 0.2 0.5 0.8``), lanes on
one (mixed at 50%, by 0.03%).
"""

from __future__ import annotations

import dataclasses
import math
from collections import OrderedDict, deque
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

from kvjax.cache.cost_model import CostModel
from kvjax.cache.eviction import EvictionPolicy
from kvjax.config.checks import int_arg

__all__ = [
    "DEFAULT_POLICY",
    "POLICIES",
    "AdaptiveSegmentedPolicy",
    "CostAwarePolicy",
    "LFUPolicy",
    "LRUPolicy",
    "ReusePolicy",
    "ReuseStatistics",
    "SegmentedPolicy",
    "make_policy",
]

_LOWER_TIERS = 2 | 4  # Tier.HOST | Tier.DISK (kvjax.cache.trie_node): a copy below the device


class LRUPolicy(EvictionPolicy):
    """Least recently used first (``last_access``, seconds)."""

    name = "lru"

    def priority(self, node: Any, now: float) -> float:
        return node.last_access


class LFUPolicy(EvictionPolicy):
    """Fewest hits first; equal hit counts fall back to least recently used."""

    name = "lfu"

    def priority(self, node: Any, now: float) -> float:
        return float(node.hits)


class CostAwarePolicy(EvictionPolicy):
    """Evict the page whose expected loss is smallest.

    value = reuse likelihood x cost of a miss on that page, where
      reuse likelihood = (hits + 1) * 2 ** -((now - last_access) / half_life_s)
      cost of a miss   = ``CostModel.miss_seconds`` of the page: its recompute (grows with its
                         depth), or, if a copy survives on host or disk, the cheaper of
                         recomputing and fetching it.
    Priority is log2(value); the ``now`` term is common to all nodes, so it is dropped and
    the ordering is time-invariant (the heap stays valid as time passes).
    ``cost_model`` None: the cache's (given at ``bind``).
    """

    name = "cost_aware"

    def __init__(self, *, half_life_s: float = 60.0, cost_model: CostModel | None = None):
        if not 0 < half_life_s < math.inf:  # NaN too
            raise ValueError(f"{half_life_s=} must be a finite number of seconds > 0")
        self.half_life_s = half_life_s
        self.cost_model = cost_model or CostModel()
        self._own_model = cost_model is not None
        self._page_size, self._block_nbytes = 16, 0

    def bind(self, page_size: int, block_nbytes: int, cost_model: CostModel) -> None:
        self._page_size, self._block_nbytes = page_size, block_nbytes
        if not self._own_model:
            self.cost_model = cost_model

    def priority(self, node: Any, now: float) -> float:
        tail_page = node.first_page + node.num_pages - 1
        loss = self.cost_model.miss_seconds(tail_page, self._page_size, self._block_nbytes,
                                            lower_copy=bool(node.tail_tiers & _LOWER_TIERS))  # fmt: skip
        return math.log2(node.hits + 1) + node.last_access / self.half_life_s + math.log2(max(loss, 1e-300))


_PROBATION, _PROTECTED = 0, 1


class SegmentedPolicy(EvictionPolicy):
    """Strict segmented LRU with a ghost history: probation pages always go first."""

    name = "segmented"

    def __init__(self, *, ghost_pages: int = 65536):
        self.ghost_pages = int_arg(ghost_pages, "ghost_pages")
        self._page_bytes = 4 * 16
        # (page index, page token bytes) -> (last_access s, segment); oldest first
        # OrderedDict, not dict: popping the oldest of a dict with many deletions scans them.
        self._ghost: OrderedDict[tuple[int, bytes], tuple[float, int]] = OrderedDict()
        self._population = [0, 0]  # ghost records per segment: [probation, protected]

    def bind(self, page_size: int, block_nbytes: int, cost_model: CostModel) -> None:
        self._page_bytes = 4 * page_size  # int32 tokens

    def priority(self, node: Any, now: float) -> float:
        segment = self._observe(node)
        return node.last_access + (self.protection() if segment == _PROTECTED else 0.0)

    def protection(self) -> float:
        """Seconds a protected page outlives a probation page of the same last access."""
        return math.inf

    def check_invariants(self) -> None:
        """The ghost holds at most ``ghost_pages`` records, counted right per segment."""
        if len(self._ghost) > self.ghost_pages:
            raise RuntimeError(f"ghost holds {len(self._ghost)} pages > {self.ghost_pages=}")
        counted = [0, 0]
        for _, segment in self._ghost.values():
            counted[segment] += 1
        if counted != self._population:
            raise RuntimeError(f"ghost population {self._population} != counted {counted}")

    # --- what adaptive policies hook into ------------------------------------------------------

    def _on_hit(self, age: float) -> None:
        """A cached page was used again ``age`` seconds after its previous use."""

    def _on_ghost_hit(self, gap: float, evicted_from: int) -> None:
        """A page evicted from segment ``evicted_from`` came back ``gap`` seconds after its use."""

    # --- the ghost history ---------------------------------------------------------------------

    def _observe(self, node: Any) -> int:
        """The node's segment; records its pages in the ghost and reports hits and ghost hits."""
        last_access, hits = node.last_access, node.hits
        segment = _PROTECTED if hits else _PROBATION
        record = self._first_record(node)
        if record is not None:
            recorded_access, recorded_segment = record
            if last_access > recorded_access and hits == 0:  # evicted, now inserted again
                segment = _PROTECTED
                self._on_ghost_hit(last_access - recorded_access, recorded_segment)
            elif last_access > recorded_access:  # hit while cached
                self._on_hit(last_access - recorded_access)
            else:  # seen in this state before (pushed again, or the head of a split)
                segment = max(segment, recorded_segment)
        if record != (last_access, segment):  # else recorded whole already (a split's head)
            self._record(node, (last_access, segment))
        return segment

    def _pages(self, node: Any) -> Iterator[tuple[int, bytes]]:
        # bytes(): the label may be a view of a request's buffer; the ghost must not pin it.
        label, size, first = node.label, self._page_bytes, node.first_page
        for start in range(0, len(label), size):
            yield first + start // size, bytes(label[start : start + size])

    def _first_record(self, node: Any) -> tuple[float, int] | None:
        ghost = self._ghost
        for page in self._pages(node):
            record = ghost.get(page)
            if record is not None:
                return record
        return None

    def _record(self, node: Any, record: tuple[float, int]) -> None:
        ghost, population = self._ghost, self._population
        for page in self._pages(node):
            old = ghost.get(page)
            if old is not None:
                population[old[1]] -= 1
                ghost.move_to_end(page)  # the young end
            ghost[page] = record
            population[record[1]] += 1
        while len(ghost) > self.ghost_pages:
            population[ghost.popitem(last=False)[1][1]] -= 1


class AdaptiveSegmentedPolicy(SegmentedPolicy):
    """Segmented LRU whose protection ``W = omega * R`` adapts to near misses.

    ``initial_omega``/``max_omega``: start and ceiling of ``omega``; ``step``: change of
    ``omega`` per near miss (before weighting); ``near_miss``: a ghost hit within
    ``near_miss * R`` seconds counts; ``smoothing``: weight of each new hit age in ``R``.
    """

    name = "adaptive"

    def __init__(
        self,
        *,
        ghost_pages: int = 65536,
        initial_omega: float = 1.0,
        max_omega: float = 64.0,
        step: float = 0.1,
        near_miss: float = 2.0,
        smoothing: float = 0.02,
    ):
        super().__init__(ghost_pages=ghost_pages)
        if not 0.0 <= initial_omega <= max_omega < math.inf:
            raise ValueError(f"need 0 <= {initial_omega=} <= {max_omega=} < inf")
        for label, value in (("step", step), ("near_miss", near_miss), ("smoothing", smoothing)):
            if not 0 < value < math.inf:
                raise ValueError(f"{label}={value!r} must be a finite number > 0")
        if smoothing > 1:
            raise ValueError(f"{smoothing=} must be in (0, 1]")
        self.omega = initial_omega
        self.max_omega = max_omega
        self.step = step
        self.near_miss = near_miss
        self.smoothing = smoothing
        self.hit_age: float | None = None  # R, seconds; None until the first hit

    def protection(self) -> float:
        return self.omega * (self.hit_age or 0.0)

    def check_invariants(self) -> None:
        super().check_invariants()
        if not 0.0 <= self.omega <= self.max_omega:
            raise RuntimeError(f"omega={self.omega} left [0, {self.max_omega=}]")
        if self.hit_age is not None and not self.hit_age >= 0.0:
            raise RuntimeError(f"hit_age={self.hit_age} must be >= 0 seconds")

    def _on_hit(self, age: float) -> None:
        if self.hit_age is None:
            self.hit_age = age
        else:
            self.hit_age += self.smoothing * (age - self.hit_age)

    def _on_ghost_hit(self, gap: float, evicted_from: int) -> None:
        if self.hit_age is None or gap > self.near_miss * self.hit_age:
            return  # too late to have been saved by a moderately different balance
        probation, protected = self._population
        if evicted_from == _PROTECTED:
            weight = max(1.0, probation / max(protected, 1))
            self.omega = min(self.max_omega, self.omega + self.step * weight)
        else:
            weight = max(1.0, protected / max(probation, 1))
            self.omega = max(0.0, self.omega - self.step * weight)


_ROOT_FRESH, _ROOT_RETURNED, _ROOT_HIT_ONCE, _ROOT_HIT_MORE = range(4)
_DEEPER = 4  # added to the kind of a node below the root's children
_NUM_KINDS = 8
_MIN_RATE = 1e-3  # floor of p: W >= H ln(1e-3) ~ -6.9 H, finite for kinds never reused
_REFRESH = 256  # trials between recomputations of W (O(kinds) each); sooner at the start
# The prior, as pseudo-trials of each kind: a page used once is rarely used again, one used
# again often is (segmented LRU's assumption, softened); real trials outweigh it after a few.
_PRIOR_TRIALS = 4.0
_MIN_TRIALS = _PRIOR_TRIALS * 2.0**-60  # the floor of a kind's (halved) count: p stays defined
_PRIOR_FRESH_RATE, _PRIOR_SEEN_RATE = 0.1, 0.9
_MAX_STATISTIC = 2.0**53  # bound of every shared count and horizon: exact as a float, summed over
# any number of peers without overflow; no node comes near it (2**53 closed trials: centuries)
_PRIOR_REUSED = tuple(_PRIOR_TRIALS * (_PRIOR_FRESH_RATE if kind % 4 == _ROOT_FRESH else _PRIOR_SEEN_RATE)
                      for kind in range(_NUM_KINDS))  # fmt: skip


@dataclasses.dataclass(frozen=True, slots=True)
class ReuseStatistics:
    """What one ``ReusePolicy`` learned from its own trials, to share with its peers.

    ``trials`` / ``reused``: per kind (``ReusePolicy.NUM_KINDS`` of them), the weighted trials
    closed and those reused within the horizon, prior left out, halved by the policy's
    ``memory``; ``closed``: trials closed (never halved); ``horizon``: H (seconds);
    ``boundary_events``: the steps of H so far (its evidence). Every number is at most 2**53
    (a peer's record must not overflow the merge); ValueError naming the value for anything
    out of range; ``from_dict`` reads ``as_dict``'s output (JSON-safe).
    """

    trials: tuple[float, ...]
    reused: tuple[float, ...]
    closed: int
    horizon: float
    boundary_events: int

    def __post_init__(self) -> None:
        for name in ("trials", "reused"):
            values = getattr(self, name)
            if not isinstance(values, tuple) or len(values) != _NUM_KINDS:
                raise ValueError(f"{name}={values!r} must be a tuple of {_NUM_KINDS} counts, one per kind")
            for value in values:
                if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= value <= _MAX_STATISTIC:
                    raise ValueError(f"{name}={values!r}: every count must be a number in [0, 2**53], not {value!r}")
        for kind, (reused, trials) in enumerate(zip(self.reused, self.trials)):
            if reused > trials * (1 + 1e-9) + 1e-9:
                raise ValueError(f"kind {kind}: reused={reused!r} > trials={trials!r}")
        for name in ("closed", "boundary_events"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= _MAX_STATISTIC:
                raise ValueError(f"{name}={value!r} must be an int in [0, 2**53]")
        if isinstance(self.horizon, bool) or not isinstance(self.horizon, (int, float)) or \
                not 0.0 < self.horizon <= _MAX_STATISTIC:  # fmt: skip
            raise ValueError(f"horizon={self.horizon!r} must be a positive number of seconds <= 2**53")

    def as_dict(self) -> dict[str, Any]:
        return {"trials": list(self.trials), "reused": list(self.reused), "closed": self.closed,
                "horizon": self.horizon, "boundary_events": self.boundary_events}  # fmt: skip

    @classmethod
    def pooled(cls, peers: Iterable[ReuseStatistics]) -> ReuseStatistics | None:
        """One peer whose merge weighs as the given ones' together (None for none): counts
        summed, H their geometric mean weighted by ``boundary_events + 1``, and
        ``boundary_events`` so that its weight is the sum of theirs. Pooling pools changes
        nothing but rounding, so a simulated cluster gives each of N nodes the pool of the
        others from prefix and suffix pools (O(N) an exchange, not O(N**2))."""
        peers = list(peers)
        if not peers:
            return None
        trials = tuple(math.fsum(peer.trials[kind] for peer in peers) for kind in range(_NUM_KINDS))
        reused = tuple(min(math.fsum(peer.reused[kind] for peer in peers), total) for kind, total in enumerate(trials))
        weight = sum(peer.boundary_events + 1 for peer in peers)
        log_horizon = math.fsum((peer.boundary_events + 1) * math.log(peer.horizon) for peer in peers) / weight
        return cls(trials, reused, sum(peer.closed for peer in peers), math.exp(log_horizon), weight - 1)

    @classmethod
    def from_dict(cls, fields: Mapping[str, Any]) -> ReuseStatistics:
        """The statistics ``as_dict`` wrote; ValueError naming what is missing or malformed."""
        if not isinstance(fields, Mapping):
            raise ValueError(f"reuse statistics must be a mapping, not {type(fields).__name__}: {fields!r}")
        names = ("trials", "reused", "closed", "horizon", "boundary_events")
        missing = [name for name in names if name not in fields]
        if missing:
            raise ValueError(f"reuse statistics lack {missing}; have {sorted(fields)}")
        lists = {}
        for name in ("trials", "reused"):
            if not isinstance(fields[name], (list, tuple)):
                raise ValueError(f"{name}={fields[name]!r} must be a list of {_NUM_KINDS} counts")
            lists[name] = tuple(fields[name])
        return cls(lists["trials"], lists["reused"], fields["closed"], fields["horizon"], fields["boundary_events"])


class _Trial:
    """An observation of a node: one trial of its kind, open until it is reused or H passes."""

    __slots__ = ("last_access", "kind", "weight", "open")

    def __init__(self, last_access: float, kind: int, weight: float):
        self.last_access = last_access  # seconds
        self.kind = kind
        self.weight = weight
        self.open = True  # not in the counts yet


class ReusePolicy(EvictionPolicy):
    """Predicted reuse: ``last_access + H * ln p[kind]``, learned online (the default).

    ``history_nodes``: entries of the node history (and most trials open at once);
    ``horizon_step``: the smallest log-space step of the horizon estimate per boundary event
    (the first ones are larger); ``memory``: trials between halvings of the counts;
    ``initial_horizon_s``: the horizon before any reuse is seen (seconds); ``trust_trials``:
    closed trials at which the learned offsets count half (0: in full from the start);
    ``offset_scale``: a factor on every offset (1: the model; 0: plain LRU; between or above,
    the kinds' order softened or sharpened: what ``bench_policies.py --reuse-offset-scales``
    compares). See the module docstring for the model.
    """

    name = "reuse"
    NUM_KINDS = _NUM_KINDS
    num_lanes = _NUM_KINDS  # the queue ranks each kind by last access, with the offsets of the pop

    def __init__(self, *, history_nodes: int = 65536, horizon_step: float = 0.02,
                 memory: int = 16384, initial_horizon_s: float = 10.0,
                 trust_trials: float = 200.0, offset_scale: float = 1.0):  # fmt: skip
        history_nodes = int_arg(history_nodes, "history_nodes", 1)
        if not 0.0 < horizon_step <= 1.0:
            raise ValueError(f"{horizon_step=} must be in (0, 1]")
        memory = int_arg(memory, "memory", 1)  # trials
        if not 0.0 < initial_horizon_s < math.inf:
            raise ValueError(f"{initial_horizon_s=} must be a positive number of seconds")
        if not 0.0 <= trust_trials < math.inf:
            raise ValueError(f"{trust_trials=} must be a finite number of trials >= 0")
        if isinstance(offset_scale, bool) or not isinstance(offset_scale, (int, float)) or \
                not 0.0 <= offset_scale < math.inf:  # fmt: skip
            raise ValueError(f"{offset_scale=} must be a finite number >= 0 (1: the learned offsets as they are)")
        self.trust_trials = trust_trials
        self.offset_scale = float(offset_scale)
        self._closed = 0  # trials closed so far (never halved): the evidence behind the order
        self.history_nodes = history_nodes
        self.horizon_step = horizon_step
        self.memory = memory
        self.horizon = initial_horizon_s  # H, seconds: own_horizon blended with the peers' (if any)
        self.own_horizon = initial_horizon_s  # this node's own boundary estimate, seconds
        self._boundary_events = 0  # steps of own_horizon so far
        self._peer_log_horizon = 0.0  # the peers' sum of weight * ln H (last merge)
        self._peer_horizon_weight = 0.0  # and of their weights (0: no peers' horizons)
        # (first_page, key) -> the node's latest trial; oldest first
        self._history: OrderedDict[tuple[int, bytes], _Trial] = OrderedDict()
        self._open: deque[_Trial] = deque()  # trials not counted yet, oldest first
        self._trials = [_PRIOR_TRIALS] * _NUM_KINDS
        self._reused = list(_PRIOR_REUSED)
        self._num_trials = 0
        self._prior_scale = 1.0  # the prior's share of the counts, halved with them
        self._peer_trials = [0.0] * _NUM_KINDS  # the peers' latest statistics, summed
        self._peer_reused = [0.0] * _NUM_KINDS
        self._peer_closed = 0
        self._refresh()

    def priority(self, node: Any, now: float) -> float:
        kind = self.lane(node, now)  # first: observing may refresh the offsets
        return node.last_access + self._offsets[kind]

    def lane(self, node: Any, now: float) -> int:
        """The node's kind, observing it (and its ancestors not yet up to date): the queue's
        lane, where it ranks by ``last_access + offsets()[kind]`` with the offsets of the pop."""
        kind = self._observe(node)
        ancestor = node.parent
        while ancestor is not None and ancestor.parent is not None:
            seen = self._history.get((ancestor.first_page, ancestor.key))
            if seen is not None and seen.last_access >= ancestor.last_access:
                break  # up to date, and so is every node above it
            self._observe(ancestor)
            ancestor = ancestor.parent
        self._close_expired(now)
        return kind

    def lane_offsets(self) -> list[float]:
        """The offsets now, per kind (the list itself, not a copy: read once per pop)."""
        return self._offsets

    def reuse_rates(self) -> list[float]:
        """``p[kind]``: share of each kind's closed trials reused within the horizon (0 to 1),
        the prior included."""
        return [reused / trials for reused, trials in zip(self._reused, self._trials)]

    def offsets(self) -> list[float]:
        """``offset_scale * trust * W[kind]`` (seconds, <= 0) added to ``last_access`` by
        ``priority`` now."""
        return list(self._offsets)

    def learned_offsets(self) -> list[float]:
        """``H * ln p[kind]`` (seconds, <= 0): the offsets with full trust."""
        return list(self._learned)

    def trust(self) -> float:
        """Weight (0 to 1) of the learned offsets in ``offsets``: closed trials over closed
        trials plus ``trust_trials``."""
        closed = self._closed + self._peer_closed
        return closed / (closed + self.trust_trials) if self.trust_trials else 1.0

    def statistics(self) -> ReuseStatistics:
        """What this policy learned from its own trials (the prior and the peers' left out):
        what a cluster node publishes for its peers."""
        scale = self._prior_scale
        trials = [max(0.0, count - _PRIOR_TRIALS * scale) for count in self._trials]
        reused = [min(max(0.0, count - prior * scale), trial)
                  for count, prior, trial in zip(self._reused, _PRIOR_REUSED, trials)]  # fmt: skip
        return ReuseStatistics(tuple(trials), tuple(reused), self._closed, self.own_horizon, self._boundary_events)

    def merge_peer_statistics(self, peers: Iterable[ReuseStatistics], *, horizon: bool = True) -> None:
        """Estimate from the peers' evidence too: ``peers`` (each live peer's latest
        ``statistics()``, this policy's own excluded) replace those of the last merge; their
        counts add to this policy's own in ``p[kind]`` and the trust ramp; with ``horizon``,
        H is the geometric mean of ``own_horizon`` and the peers' horizons, weighted by their
        boundary events (+1 each), until the next merge (``own_horizon`` goes on learning from
        this cache alone). Merging the same statistics again changes nothing. No peers: this
        policy's own evidence only. TypeError naming an entry that is not ``ReuseStatistics``."""
        peers = list(peers)
        for peer in peers:
            if not isinstance(peer, ReuseStatistics):
                raise TypeError(f"peer statistics must be ReuseStatistics, not {type(peer).__name__}: {peer!r}")
        self._peer_trials = [sum(peer.trials[kind] for peer in peers) for kind in range(_NUM_KINDS)]
        self._peer_reused = [min(sum(peer.reused[kind] for peer in peers), trials)  # each peer's within
                             for kind, trials in enumerate(self._peer_trials)]  # tolerance: not the sum's
        self._peer_closed = sum(peer.closed for peer in peers)
        weighted = [(peer.boundary_events + 1.0, math.log(peer.horizon)) for peer in peers] if horizon else []
        self._peer_horizon_weight = sum(weight for weight, _ in weighted)
        self._peer_log_horizon = sum(weight * log for weight, log in weighted)
        self._blend_horizon()
        self._refresh()

    def open_trials(self) -> int:
        """Trials observed but not counted yet (neither reused nor older than ``H``)."""
        return sum(trial.open for trial in self._open)

    def check_invariants(self) -> None:
        """History and open trials within their bound, counts consistent, horizon and offsets
        finite."""
        if len(self._history) > self.history_nodes:
            raise RuntimeError(f"history holds {len(self._history)} nodes > {self.history_nodes=}")
        if len(self._open) > self.history_nodes:
            raise RuntimeError(f"{len(self._open)} trials queued as open > {self.history_nodes=}")
        for kind, (reused, trials) in enumerate(zip(self._reused, self._trials)):
            if not 0.0 <= reused <= trials:
                raise RuntimeError(f"kind {kind}: reused={reused} outside [0, trials={trials}]")
        for kind, (reused, trials) in enumerate(zip(self._peer_reused, self._peer_trials)):
            if not 0.0 <= reused <= trials * (1 + 1e-9) + 1e-9:
                raise RuntimeError(f"kind {kind}: peers' reused={reused} outside [0, peers' trials={trials}]")
        for name in ("horizon", "own_horizon"):
            if not 0.0 < getattr(self, name) < math.inf:
                raise RuntimeError(f"{name}={getattr(self, name)} must be a positive number of seconds")
        if not self._peer_horizon_weight and self.horizon != self.own_horizon:
            raise RuntimeError(f"horizon={self.horizon} != own_horizon={self.own_horizon} without peers' horizons")
        for kind, offset in enumerate(self._offsets):
            if not -math.inf < offset <= 0.0:
                raise RuntimeError(f"kind {kind}: offset={offset} must be finite and <= 0")
        for trial in self._history.values():
            if not 0 <= trial.kind < _NUM_KINDS or not trial.weight >= 1.0:
                raise RuntimeError(f"history entry (kind={trial.kind}, weight={trial.weight}) is malformed")

    # --- learning ----------------------------------------------------------------------------

    def _observe(self, node: Any) -> int:
        """The node's kind; opens its trial, and closes the one the history held for it as
        reused (when within the horizon)."""
        key = (node.first_page, node.key)
        history = self._history
        seen = history.get(key)
        last_access, hits = node.last_access, node.hits
        deeper = _DEEPER if node.first_page else 0
        if seen is not None:
            if last_access <= seen.last_access:
                return seen.kind  # pushed again unchanged: a split's head, a cut tail, a tier bit
            self._reused_after(seen, last_access - seen.last_access, cached=hits > 0)
            history.move_to_end(key)
            kind = deeper + (_ROOT_RETURNED if hits == 0 else _ROOT_HIT_ONCE if hits == 1 else _ROOT_HIT_MORE)
        else:
            kind = deeper + (_ROOT_FRESH if hits == 0 else _ROOT_HIT_ONCE if hits == 1 else _ROOT_HIT_MORE)
        trial = history[key] = _Trial(last_access, kind, math.sqrt(node.num_pages) if node.num_pages > 1 else 1.0)
        if len(history) > self.history_nodes:
            history.popitem(last=False)
        self._open.append(trial)
        if len(self._open) > self.history_nodes:  # bounded: the oldest counts as not reused
            self._close(self._open.popleft(), reused=False)
        self._num_trials += 1
        count = self._num_trials
        if count % _REFRESH == 0 or (count < _REFRESH and count & (count - 1) == 0):
            self._refresh()  # every _REFRESH trials, and after 1, 2, 4, ... at the start
        if count % self.memory == 0:  # forget: halve every count
            # a kind never observed would reach 0 trials after ~1,000 halvings (0/0 in p): its
            # count stops at a floor, with its reuses (halved on) never above it
            self._trials = [max(trials / 2, _MIN_TRIALS) for trials in self._trials]
            self._reused = [reused / 2 for reused in self._reused]
            self._prior_scale /= 2
        return kind

    def _close(self, trial: _Trial, *, reused: bool) -> None:
        """Count ``trial`` (once): a trial of its kind, and a reuse if ``reused``."""
        if trial.open:
            trial.open = False
            self._closed += 1
            self._trials[trial.kind] += trial.weight
            if reused:
                self._reused[trial.kind] += trial.weight

    def _close_expired(self, now: float) -> None:
        """Open trials older than the horizon were not reused within it: count them so."""
        queue, horizon = self._open, self.horizon
        while queue and (not queue[0].open or now - queue[0].last_access > horizon):
            self._close(queue.popleft(), reused=False)

    def _reused_after(self, trial: _Trial, gap: float, *, cached: bool) -> None:
        """``trial``'s node was used again ``gap`` seconds after it was seen; ``cached``: it
        was still on device (a hit), else it had been evicted and came back (a miss)."""
        if gap <= self.horizon:
            self._close(trial, reused=True)
        # Robbins-Monro steps in log space: large while little is known, then horizon_step.
        # The boundary is this cache's own (what it keeps); peers' horizons only blend in.
        own = self.own_horizon
        step = max(self.horizon_step, 1.0 / math.sqrt(1.0 + self._boundary_events))
        if cached and gap > own:
            self.own_horizon = own * math.exp(step)
        elif not cached and gap < own:
            self.own_horizon = own * math.exp(-step)
        else:
            return
        self._boundary_events += 1
        self._blend_horizon()

    def _blend_horizon(self) -> None:
        """H: ``own_horizon``, or its geometric mean with the peers' (weighted) from the last merge."""
        weight = self._peer_horizon_weight
        if not weight:
            self.horizon = self.own_horizon
            return
        own = self._boundary_events + 1.0
        self.horizon = math.exp((own * math.log(self.own_horizon) + self._peer_log_horizon) / (own + weight))

    def _refresh(self) -> None:
        horizon, trust = self.horizon, self.trust()
        self._learned = [horizon * math.log(max(min((reused + peer_reused) / (trials + peer_trials), 1.0), _MIN_RATE))
                         for reused, trials, peer_reused, peer_trials
                         in zip(self._reused, self._trials, self._peer_reused, self._peer_trials)]  # fmt: skip
        scale = trust * self.offset_scale
        self._offsets = [scale * offset for offset in self._learned]


POLICIES: dict[str, type[EvictionPolicy]] = {
    policy.name: policy
    for policy in (LRUPolicy, LFUPolicy, CostAwarePolicy, SegmentedPolicy, AdaptiveSegmentedPolicy, ReusePolicy)
}

DEFAULT_POLICY = "reuse"
"""The eviction policy the CLI, the replay and the engine use unless told otherwise."""


def make_policy(name: str | EvictionPolicy, **kwargs: Any) -> EvictionPolicy:
    """Build the policy registered as ``name`` (an instance is returned unchanged)."""
    if isinstance(name, EvictionPolicy):
        return name
    if name not in POLICIES:
        raise ValueError(f"unknown eviction policy {name!r}; valid policies: {sorted(POLICIES)}")
    return POLICIES[name](**kwargs)
