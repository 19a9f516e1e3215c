"""Block hit rate of every eviction policy on many trace shapes and capacities, next to offline.

Each trace is replayed through the real DeviceIndex (``kvjax.tools.replay.replay_trace``: device
only, one request at a time, one block per hash id) once per policy and capacity. Yardsticks at
the same capacity (``kvjax.tools.replay_bounds``): ``offline`` (farthest next use first, the
best any policy can do), ``oracle-lru`` (LRU told which blocks will never be used again: the
ceiling of predicting reuse without knowing when) and the unlimited-capacity hit rate.

Traces: the shared Mooncake trace (when found) and every shape of
``kvjax.tools.trace_family`` (chat, agent, fewshot, rag, scan, chat_scan, bursty, longtail,
mixed). Capacities are fractions of each trace's distinct blocks (small, middle, large), so
every shape is judged where its policies differ; ``--capacities`` gives absolute ones instead.

``--streams N`` replays each trace as N per-node streams (a request goes to stream
``hash_ids[0] % N``, its root block: what a prefix-affinity router keeps together), each
through its own cache of the capacity; cells sum the N caches' hits (the cluster replay's
local hits, without the router). ``--fractions 0.3 0.7`` judges large caches.

    .venv/bin/python benchmarks/bench_policies.py [--quick] [--shapes chat rag ...]
        [--fractions 0.01 0.03 0.1 | --capacities 2000 8000] [--num-requests 4000] [--seed 0]
        [--policies lru reuse ...] [--trace PATH | --no-trace] [--streams N] [--reuse-offset-scales K ...]
        [--warmup-fraction F]

Cells read ``hit% (share of offline)``. Under each trace a verdict line says whether the default
policy hits at least as much as LRU at every capacity, and, on conversation-like and scan-mixed
shapes (and on trace files), at least as much as strict ``segmented``; a summary ends the run.
``--quick`` replays only those three policies (same traces and capacities): about a minute on
two shared cores; the full table about two.

``--reuse-offset-scales K [K ...]`` adds columns ``reuse xK``: the default policy with every
learned offset times K (``ReusePolicy(offset_scale=K)``; 0 is LRU). No single K meets the
goal: with ``--quick --fractions 0.01 0.03 0.1 0.15 0.5 --reuse-offset-scales 0.25 0.5 2 4``
(4 minutes) small caches want sharper offsets and large ones softer. At 1% of the distinct
blocks x4 is best on seven of the nine generated shapes (chat 9.96% against 8.92% at x1, mixed
23.43% against 20.51%); x0.25 or x0.5 is best on chat at 15% (62.43% against 62.37%, LRU
62.41%) and at 50% on chat_scan, mixed (70.47% against 70.36%, LRU 70.47%) and the shared
trace (59.66% against 59.37%, strict segmented 60.34%), while scan at 15% still wants x4 and
rag x1 everywhere.
Mean share of offline over the 50 cells: x0.25 0.787, x0.5 0.802, x1 0.813, x2 0.817, x4
0.812 (LRU 0.760, segmented 0.788). The share of reuses that hit (cache pressure) does not
pick K either: scan at 95% of reuses hit wants x4, chat at 93% x0.25. What K should be
follows the shape of each kind's reuse-gap distribution near the eviction age, which one
exponential per kind on the horizon's time scale does not model.

``--warmup-fraction F`` replays the first F of each trace (of each stream) through every cache
and yardstick without counting it: the table then judges a cache that has seen the trace's
start, as a server that has run for a while has, instead of one that starts empty and, for a
learning policy, knowing nothing (the whole trace: ``replay_trace(..., warmup_requests=N)``).
With ``--quick --warmup-fraction 0.5`` (the second half of each trace, 70 s) the verdict flips
both ways: on scan the default meets strict segmented at every capacity (25.58 / 36.35 / 36.35%
against 24.98 / 36.35 / 36.35%; over the whole trace it is below at all three: what it loses
there, it loses while learning), and on the shared trace it is above segmented at 3% and 10%
(17.11 / 39.46% against 16.73 / 39.30%) but not at 1% (5.64 against 5.88%, LRU 5.64%). Below
LRU once learned: chat at 10% (46.47 against 46.66%), mixed at 10% (78.19 against 78.48%), rag
at 1% (40.54 against 40.71%), the shared trace at 1% (by 0.1% of its rate); below segmented:
chat_scan at 3% (24.35 against 24.67%). Five of ten traces meet the goal in the second half,
eight over the whole: the soft segmented prior the default starts from carries part of its
lead on chat, mixed and rag, and the learned order alone does not hold it there.

Stamped priorities against lanes (``ReusePolicy.num_lanes``: one queue per kind, LRU within
it, the victim chosen with the offsets of the pop); the figures of the other paragraphs were
measured with stamps. Stamped once when a node became evictable, an offset went stale as H
and the trust ramp grew: on large caches (``--quick --fractions 0.2 0.5 0.8``) the default was
below LRU on the shared trace at 80%, chat_scan at 50/80%, mixed at 50/80% and rag (by less
than 0.01 point), and met the goal on 4 of 10 traces; with lanes on 7 (mean share of offline
0.9709 -> 0.9713; left: mixed at 50%, 70.45% against LRU's 70.47%, and strict segmented on the
shared trace at 20% and chat at 80%). ``--quick``: 8 of 10 both ways (0.7263 -> 0.7266);
``--tiered --quick``: 6 -> 7 (chat_scan and rag now meet flat LRU, chat at 3% falls under it:
62.34% against 62.42%). Lanes still lose a little at some small and middle cells (mixed at 3%
47.03% against 47.43% stamped, at 10% 67.11% against 67.34%; the shared trace at 20% 41.48%
against 41.88%). Not from worse decisions: replaying the stamped run and asking, at each
eviction where the two rules differ, which candidate is used again later, the lanes' choice is
the better one 646 times to 238 (mixed at 3%), and lanes driven by the offsets the stamped run
learned (same times) beat the stamped run at mixed 1% and 3% (19.61 / 47.57% against 19.52 /
47.43%). The cost is in what lanes learn under their own evictions: a kind the policy learned
to evict early goes at once, so more of it comes back younger than H, which lowers H (mixed at
3%: 4.4 / 11.2 s against 5.7 / 14.3 s stamped after 4k / 8k trials) and softens every offset
by as much, where small caches want sharper ones (``--reuse-offset-scales`` above). At mixed
10% the rule itself costs (lanes with the stamped run's offsets: 67.08%). Pitfall: a lane must
rank each entry by the last access it was pushed with, as the stamped heap did. The trie
updates ``last_access`` in place on a node still queued (a hit locks it; it is pushed again
when released), and a lane head ranked by its new last access hides the older entries behind
it: that version lost up to 5.7 points (chat at 20%).

Where H comes from under lanes (``--quick`` as the bench prints it; the large-cache and tiered
runs replayed only the default and read the other columns from the lanes runs above, whose
cells that replay reproduces exactly). H is a boundary estimate: it settles where
hits older than H balance misses younger than H, so under LRU it is LRU's eviction age, and
under the default it is pulled down by misses its own offsets cause. Removing that pull in
either neutral way fails. H taken from an LRU-ordered run of the same trace (a second policy
with ``offset_scale=0``, its H replayed into the first) is worse, not better: scan at 3%
29.09% against 32.84% (LRU's H 24 s against the default's 279 s), mixed at 1% 19.06 against
19.39%; the default's H is above LRU's on most shapes, not below. Each reuse gap measured in
the queue's ranking, plus the kind's offset (``gap - offset[kind]``), converges to the age at
which a kind of offset 0 would go; where no such kind is queued (rag: the p = 1 kind is the
system prompt, never a leaf) that age grows with H itself and H runs away (rag at 1% H 9 ->
77 s, 40.86% -> 35.58%, under LRU's 40.70%; ``--quick`` 8 -> 6 of 10). Measured against the
most kept kind that has leaves queued (``gap + max(0, top - offset[kind])``, ``top`` the
largest offset among kinds with open trials of queued leaves) it stays bounded: ``--quick`` 8
of 10 (mean share 0.7266 -> 0.7299; the shared trace at 10% 27.49% against segmented's 27.52%,
scan at 3% 32.97% against 33.45%), ``--fractions 0.2 0.5 0.8`` 7 of 10 (0.9713 -> 0.9715;
mixed at 20% now under LRU, 69.49 against 69.51%, the shared trace at 20% 41.66% against
segmented's 42.04%), ``--tiered --quick`` 7 -> 8 (chat at 3% meets flat LRU; agent at 1% 72.24
against 72.33%, mixed at 10% 70.39 against 70.47%). Not landed yet: it changes what H
means (H now moves with the offsets applied, so the trust ramp changes what H is learned, and
tests that assume hits 1 s apart leave H alone need new fixtures).

``--tiered`` instead replays the real tiers: at each device capacity C (the same fractions) the
default policy on C device blocks above a host tier of M = ``--host-ratio`` x C blocks
(write-back, ``replay_trace(..., host_blocks=M)``), against one flat cache of C + M device
blocks with LRU and with the default policy, all three on the same prompts: each cut to its
first C blocks, as the tiered replay must (a prompt longer than the device cannot be computed;
only the agent shape at 1% has such prompts). Cells read ``hit%``; the verdict line says
whether the tiered cache hits at least as much as the flat LRU cache at every capacity.
Host victims follow a flat cache of C + M blocks without KV (``kvjax.tiers.shadow_cache``), so
the tiered column tracks the flat one under the same policy: on the shared trace 16.19%,
35.95%, 59.40% at C = 1%, 3%, 10% against flat LRU's 15.66%, 33.50%, 58.88% (ranked by the
device policy alone, the host held 15.34%, 32.98%, 58.75%). Where flat reuse stays under flat
LRU, so does the tiered cache: agent at 1% (-0.4%), mixed at 10% (-0.17%), chat_scan at 10%
(-0.04%), rag at 10% (-0.00%); at or above flat LRU on 6 of 10 traces. (Before pages
added below a hit node formed a fresh child of it, chat at 3% was under too, -0.2%, and agent
at 1% -0.1%; the host ratios below measured that form.) With ``--host-ratio 2`` it is at or above flat LRU on 9 of 10 traces
(not chat at 3%: -0.4%), with ``--host-ratio 8`` on 7 (shared trace at 10% -0.2%, bursty and
mixed -0.04% or less), the device policy's rank alone on 6 and 6.

    .venv/bin/python benchmarks/bench_policies.py --tiered [--host-ratio 4] [...as above]
"""

from __future__ import annotations

import argparse
import dataclasses
import shlex
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvjax.cache.policies import DEFAULT_POLICY, POLICIES, ReusePolicy  # noqa: E402
from kvjax.tools.replay import replay_trace  # noqa: E402
from kvjax.tools.replay_bounds import (  # noqa: E402
    HitCounts,
    intern_block_paths,
    offline_replay,
    reuse_oracle_lru_replay,
    unlimited_replay,
)
from kvjax.tools.trace import MOONCAKE_BLOCK_TOKENS, TraceRequest, load_trace  # noqa: E402
from kvjax.tools.trace_family import CONVERSATION_LIKE, SHAPES, generate  # noqa: E402

_SHARED = Path(__file__).resolve().parents[2] / "shared/data/mooncake_synthetic_trace.jsonl"
_SCAN_MIXED = frozenset({"scan", "chat_scan"})
_SCALED = "reuse x"  # a column of --reuse-offset-scales: "reuse x0.5"


def main() -> None:
    args = _parse_args()
    print("command: " + " ".join(shlex.quote(a) for a in [sys.executable, *sys.argv]))
    print(f"default policy: {DEFAULT_POLICY}; cells: block hit rate (share of offline)\n")
    if args.tiered:
        return _main_tiered(args)
    summary = {policy: [] for policy in args.policies}  # per policy: share of offline per cell
    verdicts = []
    for name, vs_segmented, requests in _traces(args):
        distinct = len(intern_block_paths(requests)[1])
        streams = _streams(requests, args.streams)
        distinct_per_stream = distinct / len(streams)
        capacities = args.capacities or sorted({max(1, round(distinct_per_stream * f)) for f in args.fractions})
        if len(streams) > 1:
            name = f"{name}, {len(streams)} streams (capacity per stream)"
        rates, offline, text = _table(name, streams, distinct, capacities, args.policies, args.warmup_fraction)
        print(text)
        met, verdict = _verdict(rates, vs_segmented)
        verdicts.append((name, met))
        print(f"verdict: {verdict}\n")
        for policy in args.policies:
            summary[policy] += [rate / off if off else 0.0 for rate, off in zip(rates[policy], offline)]
    print("mean share of offline over all cells: "
          + ", ".join(f"{p} {sum(v) / len(v):.3f}" for p, v in summary.items() if v))  # fmt: skip
    failed = [name for name, met in verdicts if not met]
    print(f"default {DEFAULT_POLICY}: meets the goal on {len(verdicts) - len(failed)} of {len(verdicts)} traces"
          + (f"; not on: {', '.join(failed)}" if failed else ""))  # fmt: skip


def _parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true",
                        help="only the policies the verdict compares (lru, segmented, the default)")  # fmt: skip
    parser.add_argument("--trace", type=Path, default=_SHARED if _SHARED.exists() else None,
                        help="a Mooncake-format trace file (default: the shared one, if present)")  # fmt: skip
    parser.add_argument("--no-trace", action="store_true", help="generated shapes only")
    parser.add_argument("--shapes", nargs="*", default=sorted(SHAPES), choices=sorted(SHAPES))
    parser.add_argument("--num-requests", type=int, default=4000, help="requests a trace (and of --trace)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the generated traces")
    parser.add_argument("--fractions", type=float, nargs="+", default=[0.01, 0.03, 0.1],
                        help="capacities as fractions of each trace's distinct blocks")  # fmt: skip
    parser.add_argument("--capacities", type=int, nargs="+", default=None, help="absolute capacities (blocks)")
    parser.add_argument("--policies", nargs="+", default=None, choices=sorted(POLICIES))
    parser.add_argument("--reuse-offset-scales", type=float, nargs="+", default=[], metavar="K",
                        help="also replay reuse with its offsets times K (ReusePolicy(offset_scale=K))")  # fmt: skip
    parser.add_argument("--streams", type=int, default=1,
                        help="per-node streams: requests split by their root block, one cache each")  # fmt: skip
    parser.add_argument("--tiered", action="store_true",
                        help="device + host tiers against one flat cache of their total blocks")  # fmt: skip
    parser.add_argument("--host-ratio", type=int, default=4, help="with --tiered: host blocks per device block")
    parser.add_argument("--warmup-fraction", type=float, default=0.0, metavar="F",
                        help="the first F of each trace (of each stream) warms the caches uncounted (0 <= F < 1)")
    args = parser.parse_args()
    if not 0.0 <= args.warmup_fraction < 1.0:
        parser.error(f"--warmup-fraction {args.warmup_fraction:g}: expected a share of the requests in [0, 1)")
    if args.policies is None:
        args.policies = [] if args.quick else sorted(POLICIES)
    for policy in (DEFAULT_POLICY, "lru", "segmented"):  # the verdict compares these
        if policy not in args.policies:
            args.policies.append(policy)
    for scale in args.reuse_offset_scales:
        try:
            ReusePolicy(offset_scale=scale)  # the policy's own check, before anything replays
        except ValueError as err:
            parser.error(f"--reuse-offset-scales {scale:g}: {err}")
        args.policies.append(f"{_SCALED}{scale:g}")
    return args


def _traces(args: argparse.Namespace):
    """(name, whether the default must match segmented on it, requests) per trace."""
    if args.trace is not None and not args.no_trace:
        yield args.trace.name, True, load_trace(args.trace)[: args.num_requests]
    for shape in args.shapes:
        requests = generate(shape, num_requests=args.num_requests, seed=args.seed)
        yield f"{shape} (seed {args.seed})", shape in CONVERSATION_LIKE | _SCAN_MIXED, requests


def _streams(requests: list[TraceRequest], count: int) -> list[list[TraceRequest]]:
    """``requests`` split into ``count`` streams by root block (order kept; empty ones dropped)."""
    if count <= 1:
        return [requests]
    parts: list[list[TraceRequest]] = [[] for _ in range(count)]
    for request in requests:
        parts[request.hash_ids[0] % count if request.hash_ids else 0].append(request)
    return [part for part in parts if part]


def _summed(replay, streams: list[list[TraceRequest]], *args, warmup: float = 0.0, **kwargs) -> HitCounts:
    """The counts of ``replay`` summed over the streams (one cache each; a ``policy`` named
    ``reuse x K`` is a fresh ``ReusePolicy(offset_scale=K)`` per stream), each stream's first
    ``warmup`` share of requests replayed uncounted."""
    policy = kwargs.pop("policy", None)
    counts = [replay(stream, *args, warmup_requests=_warmup_requests(stream, warmup), **kwargs,
                     **({} if policy is None else {"policy": _policy(policy)})) for stream in streams]  # fmt: skip
    return HitCounts(*(sum(getattr(c, field.name) for c in counts) for field in dataclasses.fields(HitCounts)))


def _warmup_requests(requests: list[TraceRequest], warmup: float) -> int:
    """How many of ``requests`` warm the caches: the first ``warmup`` share of them."""
    return int(warmup * len(requests))


def _policy(name: str):
    """The policy a column names: a registered name as it is, ``reuse x K`` a new instance."""
    if name.startswith(_SCALED):
        return ReusePolicy(offset_scale=float(name[len(_SCALED):]))
    return name


def _table(name: str, streams, distinct: int, capacities: list[int], policies: list[str], warmup: float = 0.0):
    """(hit rates per policy, offline rate per capacity, the printed table)."""
    unlimited = _summed(unlimited_replay, streams, warmup=warmup)
    counted = "" if not warmup else f" counted after {sum(map(len, streams)) - unlimited.requests} warm-up requests"
    header = (f"{name}: {unlimited.requests} requests{counted}, {unlimited.blocks:,} blocks ({distinct:,} distinct); "
              f"unlimited capacity hits {unlimited.block_hit_rate:.2%}")  # fmt: skip
    lines = [header]
    marked = [f"{p}*" if p == DEFAULT_POLICY else p for p in policies]
    lines.append(f"{'capacity':>8} {'offline':>8} {'oracle-lru':>15} | " + " ".join(f"{p:>15}" for p in marked))
    rates: dict[str, list[float]] = {policy: [] for policy in policies}
    offline_rates, seconds = [], dict.fromkeys(policies, 0.0)
    for capacity in capacities:
        offline = _summed(offline_replay, streams, capacity, warmup=warmup).block_hit_rate
        oracle = _summed(reuse_oracle_lru_replay, streams, capacity, warmup=warmup).block_hit_rate
        offline_rates.append(offline)
        for policy in policies:
            start = time.perf_counter()
            rates[policy].append(_summed(replay_trace, streams, capacity, policy=policy, warmup=warmup).block_hit_rate)
            seconds[policy] += time.perf_counter() - start
        cells = [_cell(oracle, offline)] + [_cell(rates[p][-1], offline) for p in policies]
        lines.append(f"{capacity:>8} {offline:>8.2%} " + f"{cells[0]:>15} | " + " ".join(f"{c:>15}" for c in cells[1:]))
    lines.append(f"{'s/replay':>8} {'':>8} {'':>15} | "
                 + " ".join(f"{seconds[p] / len(capacities):>15.2f}" for p in policies))  # fmt: skip
    return rates, offline_rates, "\n".join(lines)


def _main_tiered(args: argparse.Namespace) -> None:
    """The tiered table of every trace, a verdict under each and a summary."""
    ratio, failed, count = args.host_ratio, [], 0
    print(f"tiered: {DEFAULT_POLICY} on C device blocks above a host tier of {ratio} x C (write-back); "
          f"flat: one cache of C + M device blocks\n")  # fmt: skip
    for name, _, requests in _traces(args):
        distinct = len(intern_block_paths(requests)[1])
        capacities = args.capacities or sorted({max(1, round(distinct * f)) for f in args.fractions})
        warm = _warmup_requests(requests, args.warmup_fraction)
        print(f"{name}: {len(requests)} requests, {distinct:,} distinct blocks"
              + (f"; hits counted after {warm} warm-up requests" if warm else ""))  # fmt: skip
        print(f"{'C':>8} {'M':>8} {'tiered':>8} {'flat lru':>9} {'flat ' + DEFAULT_POLICY:>11} {'vs lru':>7}")
        margins = []
        for capacity in capacities:
            host, clipped = ratio * capacity, _clip(requests, capacity)
            tiered = replay_trace(clipped, capacity, host_blocks=host, warmup_requests=warm).block_hit_rate
            flat_lru = replay_trace(clipped, capacity + host, policy="lru", warmup_requests=warm).block_hit_rate
            flat = replay_trace(clipped, capacity + host, warmup_requests=warm).block_hit_rate
            margins.append(tiered / flat_lru - 1.0 if flat_lru else 0.0)
            print(f"{capacity:>8} {host:>8} {tiered:>8.2%} {flat_lru:>9.2%} {flat:>11.2%} {margins[-1]:>+7.1%}")
        met = min(margins) >= 0.0
        count += 1
        failed += [] if met else [name]
        print(f"verdict: tiered >= flat lru: {'yes' if met else 'NO'} "
              f"(worst {min(margins):+.2%}, best {max(margins):+.2%})\n")  # fmt: skip
    print(f"tiered {DEFAULT_POLICY}: at or above flat LRU on {count - len(failed)} of {count} traces"
          + (f"; not on: {', '.join(failed)}" if failed else ""))  # fmt: skip


def _clip(requests: list[TraceRequest], num_blocks: int) -> list[TraceRequest]:
    """Each request cut to its first ``num_blocks`` blocks (whole blocks of 512 tokens)."""
    return [request if len(request.hash_ids) <= num_blocks else dataclasses.replace(
        request, input_length=num_blocks * MOONCAKE_BLOCK_TOKENS, hash_ids=request.hash_ids[:num_blocks])
        for request in requests]  # fmt: skip


def _cell(rate: float, offline: float) -> str:
    return f"{rate:.2%} ({rate / offline if offline else 0.0:.0%})"


def _verdict(rates: dict[str, list[float]], vs_segmented: bool) -> tuple[bool, str]:
    """(whether the default met the goal on this trace, the verdict line)."""
    rivals = ["lru", "segmented"] if vs_segmented else ["lru"]
    results = [_compare(rates, rival) for rival in rivals]
    return all(met for met, _ in results), "; ".join(text for _, text in results)


def _compare(rates: dict[str, list[float]], rival: str) -> tuple[bool, str]:
    """Whether the default hit at least as much as ``rival`` at every capacity, and the margins
    (relative to the rival's hit rate)."""
    margins = [mine / theirs - 1.0 if theirs else 0.0 for mine, theirs in zip(rates[DEFAULT_POLICY], rates[rival])]
    met = min(margins) >= 0.0
    return met, (f"{DEFAULT_POLICY} >= {rival}: {'yes' if met else 'NO'} "
                 f"(worst {min(margins):+.1%}, best {max(margins):+.1%})")  # fmt: skip


if __name__ == "__main__":
    main()
