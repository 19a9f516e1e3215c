"""Cluster replay: the three routing strategies side by side, against one cache of the same
total capacity (``kvjax.tools.cluster_replay``: real router code, real per-node caches).

Rows: the shared Mooncake trace at N in {4, 8} nodes x C in {2,000, 8,000} device blocks per
node, then a generated trace where every request shares one system prompt (the case where a
weighted-cost router sends everything to one node). Columns: block hits served locally, blocks
past them another node held, one cache of N x C blocks (same eviction policy), the gap in
points, requests per node max/mean over the run and its 95th percentile over windows of
50 x N arrivals. Issue 13's targets for ``prefix``: gap <= 1 point, max/mean <= 1.05, window
p95 <= 1.15 on the shared trace; max/mean <= 1.10 on the system-prompt trace.

    .venv/bin/python benchmarks/bench_cluster_replay.py [--trace PATH] [--nodes 4 8]
        [--device-blocks 2000 8000]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvjax.cluster.router import STRATEGIES, RouterConfig  # noqa: E402
from kvjax.tools.cluster_replay import ClusterSpec, ServiceModel, simulate_cluster, yardsticks  # noqa: E402
from kvjax.tools.replay import DEFAULT_POLICY  # noqa: E402
from kvjax.tools.trace import MOONCAKE_BLOCK_TOKENS, TraceRequest, load_trace  # noqa: E402

SHARED_TRACE = "/work/shared/data/mooncake_synthetic_trace.jsonl"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trace", default=SHARED_TRACE, help="Mooncake-format trace (default: the shared one)")
    parser.add_argument("--nodes", type=int, nargs="+", default=[4, 8])
    parser.add_argument("--device-blocks", type=int, nargs="+", default=[2000, 8000], help="per node")
    parser.add_argument("--system-prompt-device-blocks", type=int, default=2000, help="per node, second table")
    args = parser.parse_args()
    service = ServiceModel()
    print(f"cluster replay, eviction policy {DEFAULT_POLICY} (the default); router defaults {RouterConfig()}")
    print(service.describe() + "\n")
    start = time.perf_counter()
    requests = load_trace(args.trace)
    rows = [row for nodes in args.nodes for blocks in args.device_blocks
            for row in compare(requests, nodes, blocks, service)]  # fmt: skip
    print(f"trace {args.trace}: {len(requests)} requests\n")
    print_table(rows)
    shared = shared_system_prompt_trace()
    rows = [row for nodes in args.nodes for row in compare(shared, nodes, args.system_prompt_device_blocks, service)]
    print(f"\ngenerated trace: {len(shared)} requests, every one behind the same "
          f"{SYSTEM_PROMPT_BLOCKS}-block system prompt (target for prefix: max/mean <= 1.10)\n")  # fmt: skip
    print_table(rows)
    print(f"\n{time.perf_counter() - start:.0f} s; command: {' '.join(sys.argv)}")


def compare(requests: list[TraceRequest], nodes: int, device_blocks: int, service: ServiceModel) -> list[tuple]:
    """One row per strategy: (nodes, blocks, strategy, report, single-cache block hit rate)."""
    spec = ClusterSpec(nodes, device_blocks)
    single = yardsticks(requests, spec)["single_cache"].block_hit_rate
    return [(nodes, device_blocks, strategy, simulate_cluster(requests, spec, router=RouterConfig(strategy),
                                                              service=service), single)
            for strategy in STRATEGIES]  # fmt: skip


def print_table(rows: list[tuple]) -> None:
    print("| nodes | blocks/node | router | local hits | another node held | one cache of N x C | gap (pts) "
          "| max/mean | window p95 | routing reasons |")  # fmt: skip
    print("|---:|---:|---|---:|---:|---:|---:|---:|---:|---|")
    for nodes, blocks, strategy, report, single in rows:
        local = report.local.block_hit_rate
        reasons = ", ".join(f"{reason} {count}" for reason, count in report.reasons.items())
        print(f"| {nodes} | {blocks:,} | {strategy} | {local:.2%} | {report.remote_block_hit_rate:.2%} | {single:.2%} "
              f"| {100 * (single - local):+.2f} | {report.max_mean_requests:.3f} | {report.p95_window_max_mean:.3f} "
              f"| {reasons} |")  # fmt: skip


# --- the shared-system-prompt trace --------------------------------------------------------

SYSTEM_PROMPT_BLOCKS = 4


def shared_system_prompt_trace(num_requests: int = 3000, rate_per_s: float = 8.0, seed: int = 0) -> list[TraceRequest]:
    """Every request: the same ``SYSTEM_PROMPT_BLOCKS``-block system prompt, then a question
    of its own (1-4 blocks, the last one partial); Poisson arrivals at ``rate_per_s``; output
    lengths log-normal around 100 tokens."""
    rng = np.random.default_rng(seed)
    arrivals_ms = np.cumsum(rng.exponential(1000.0 / rate_per_s, num_requests))
    next_id = SYSTEM_PROMPT_BLOCKS
    requests = []
    for arrival in arrivals_ms:
        question_blocks = int(rng.integers(1, 5))
        ids = tuple(range(SYSTEM_PROMPT_BLOCKS)) + tuple(range(next_id, next_id + question_blocks))
        next_id += question_blocks
        input_length = (len(ids) - 1) * MOONCAKE_BLOCK_TOKENS + int(rng.integers(1, MOONCAKE_BLOCK_TOKENS + 1))
        output_length = int(np.clip(rng.lognormal(np.log(100), 0.7), 1, 2000))
        requests.append(TraceRequest(float(round(arrival)), input_length, output_length, ids))
    return requests


if __name__ == "__main__":
    main()
