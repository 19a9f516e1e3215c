"""Block hit rate of every eviction policy, as a share of the offline policy's, per capacity.

Each trace is replayed through the real DeviceIndex (``kvjax.tools.replay.replay_trace``: one
request at a time, one block per hash id) at every capacity, once per policy; the yardstick is
the offline farthest-next-use policy at the same capacity (``kvjax.tools.replay_bounds``). Traces:
the shared Mooncake trace (when found) and two generated ones of ``kvjax.tools.trace_family``
(multi-turn chat on Zipf system prompts; one-off long documents mixed with a hot set), which
have a structure unlike it, so a policy tuned to one trace shows it.

    .venv/bin/python benchmarks/bench_policies.py [--trace PATH] [--capacities 1000 2000 4000 16000]
        [--policies lru adaptive ...] [--seed 0] [--no-synthetic | --no-trace]

Cells read ``hit% (share of offline)``; ``s/replay`` is the mean wall time of one replay. The
``oracle-lru`` column is a second yardstick (``reuse_oracle_lru_replay``): LRU that knows which
blocks will never be used again and evicts those first. Like the offline policy it sees the
future, but only whether a block is reused, not when.
"""

from __future__ import annotations

import argparse
import shlex
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvjax.cache.policies import POLICIES  # noqa: E402
from kvjax.tools.replay import DEFAULT_POLICY, replay_trace  # noqa: E402
from kvjax.tools.replay_bounds import (  # noqa: E402
    offline_replay,
    reuse_oracle_lru_replay,
    unlimited_replay,
)
from kvjax.tools.trace import load_trace  # noqa: E402
from kvjax.tools.trace_family import chat_trace, scan_trace  # noqa: E402

_SHARED = Path(__file__).resolve().parents[2] / "shared/data/mooncake_synthetic_trace.jsonl"


def main() -> None:
    args = _parse_args()
    print("command: " + " ".join(shlex.quote(a) for a in [sys.executable, *sys.argv]))
    print(f"default policy: {DEFAULT_POLICY}\n")
    for name, requests in _traces(args):
        print(_table(name, requests, args.capacities, args.policies))
        print()


def _parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trace", type=Path, default=_SHARED if _SHARED.exists() else None,
                        help="a Mooncake-format trace (default: the shared one, if present)")  # fmt: skip
    parser.add_argument("--capacities", type=int, nargs="+", default=[1000, 2000, 4000, 16000])
    parser.add_argument("--policies", nargs="+", default=sorted(POLICIES), choices=sorted(POLICIES))
    parser.add_argument("--seed", type=int, default=0, help="seed of the synthetic traces")
    parser.add_argument("--no-synthetic", action="store_true", help="skip the synthetic traces")
    parser.add_argument("--no-trace", action="store_true", help="only the synthetic traces")
    return parser.parse_args()


def _traces(args: argparse.Namespace):
    if args.trace is not None and not args.no_trace:
        yield args.trace.name, load_trace(args.trace)
    if not args.no_synthetic:
        yield f"synthetic chat (seed {args.seed})", chat_trace(seed=args.seed)
        yield f"synthetic scan (seed {args.seed})", scan_trace(seed=args.seed)


def _table(name: str, requests, capacities: list[int], policies: list[str]) -> str:
    unlimited = unlimited_replay(requests)
    lines = [f"{name}: {unlimited.requests} requests, {unlimited.blocks} blocks, "
             f"unlimited capacity hits {unlimited.block_hit_rate:.2%}"]  # fmt: skip
    lines.append(f"{'capacity':>8} {'offline':>8} {'oracle-lru':>16} | "
                 + " ".join(f"{p:>16}" for p in policies))  # fmt: skip
    seconds = dict.fromkeys(policies, 0.0)
    for capacity in capacities:
        offline = offline_replay(requests, capacity).block_hit_rate
        oracle = reuse_oracle_lru_replay(requests, capacity).block_hit_rate
        cells = []
        for policy in policies:
            start = time.perf_counter()
            rate = replay_trace(requests, capacity, policy=policy).block_hit_rate
            seconds[policy] += time.perf_counter() - start
            share = rate / offline if offline else 0.0
            cells.append(f"{rate:>7.2%} ({share:>4.0%})")
        oracle_cell = f"{oracle:>7.2%} ({oracle / offline if offline else 0.0:>4.0%})"
        lines.append(f"{capacity:>8} {offline:>8.2%} {oracle_cell:>16} | "
                     + " ".join(f"{c:>16}" for c in cells))  # fmt: skip
    lines.append(f"{'s/replay':>8} {'':>8} {'':>16} | "
                 + " ".join(f"{seconds[p] / len(capacities):>16.2f}" for p in policies))  # fmt: skip
    return "\n".join(lines)


if __name__ == "__main__":
    main()
