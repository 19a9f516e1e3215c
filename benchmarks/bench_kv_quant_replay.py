"""Replay hit rate at a fixed byte budget, per KV format: what quantized pages buy in hits.

A tier of ``B`` bytes holds ``B // bytes_per_trace_block`` of the trace's blocks, where a trace
block (``--block-tokens`` tokens, 512 in the Mooncake release) is ``block_tokens / page_size``
pool blocks of the stated model shape (``PoolConfig.bytes_per_block``, scales included). For
the unquantized bfloat16 pool and every quantized format x scale granularity, the trace is
replayed (``kvjax.tools.replay.replay_trace``: the real prefix cache and the default eviction
policies, a host tier below the device with write-back, no model) with those capacities, and
the table shows blocks per tier and block / token hit rates, next to the unlimited-capacity
bound. For the Llama-like shape a 512-token trace block is 64 MiB in bfloat16, so the default
2 GiB device holds 32 of them: a tight budget, where the host tier does most of the work.
Formats of the same size (int8 and fp8 of one granularity) fit the same number of
blocks, so they hit the same: each distinct capacity is replayed once.

    .venv/bin/python benchmarks/bench_kv_quant_replay.py [TRACE] [--device-gib 2]
        [--host-gib 16] [--disk-gib 0] [--quick]

``TRACE`` defaults to the shared Mooncake trace; when it is absent the benchmark says so and
exits 0. ``--quick`` replays the first 1000 requests.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from kv_quant_common import (
    ALL_FORMATS,
    GIB,
    LLAMA3_8B,
    ModelShape,
    blocks_in,
    command_line,
    format_table,
)

from kvjax.tools.replay import replay_trace
from kvjax.tools.replay_bounds import HitCounts, unlimited_replay
from kvjax.tools.trace import MOONCAKE_BLOCK_TOKENS, load_trace
from pallas_kernels.kv_format import KVFormat

DEFAULT_TRACE = "/work/shared/data/mooncake_synthetic_trace.jsonl"
QUICK_REQUESTS = 1000


def main() -> int:
    args = parse_args()
    if not Path(args.trace).is_file():
        print(f"trace {args.trace} not found: nothing to replay (pass a Mooncake-format trace)")
        return 0
    requests = load_trace(args.trace, block_tokens=args.block_tokens)
    if args.quick:
        requests = requests[:QUICK_REQUESTS]
    shape = LLAMA3_8B
    budgets = {"device": args.device_gib * GIB, "host": args.host_gib * GIB,
               "disk": args.disk_gib * GIB}
    print(f"trace {args.trace}: {len(requests)} requests, {args.block_tokens} tokens per block")
    print(f"model {shape.describe()}")
    print(f"budget: {args.device_gib:g} GiB device + {args.host_gib:g} GiB host + "
          f"{args.disk_gib:g} GiB disk; sequential replay, default policies, write-back\n")
    replays: dict[tuple[int, int, int], HitCounts] = {}
    results = []
    for fmt in ALL_FORMATS:
        capacity = tier_blocks(shape, fmt, budgets, args.block_tokens)
        if capacity["device"] < 1:
            print(f"{fmt.name()}: {args.device_gib:g} GiB holds no block of "
                  f"{trace_block_bytes(shape, fmt, args.block_tokens)} bytes; skipped")
            continue
        key = (capacity["device"], capacity["host"], capacity["disk"])
        if key not in replays:
            start = time.perf_counter()
            replays[key] = replay_trace(requests, key[0], host_blocks=key[1], disk_blocks=key[2],
                                        block_tokens=args.block_tokens)
            print(f"replayed {fmt.name()} capacity {key} in {time.perf_counter() - start:.1f}s")
        results.append((fmt, capacity, replays[key]))
    print(_table(shape, results, args.block_tokens))
    bound = unlimited_replay(requests, block_tokens=args.block_tokens)
    print(f"unlimited capacity: {bound.block_hit_rate:.2%} block hits, "
          f"{bound.token_hit_rate:.2%} token hits")
    print(f"\ncommand: {command_line()}")
    return 0


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("trace", nargs="?", default=DEFAULT_TRACE,
                        help="Mooncake-format trace (default: %(default)s)")
    parser.add_argument("--device-gib", type=float, default=2.0)
    parser.add_argument("--host-gib", type=float, default=16.0)
    parser.add_argument("--disk-gib", type=float, default=0.0)
    parser.add_argument("--block-tokens", type=int, default=MOONCAKE_BLOCK_TOKENS,
                        help="tokens per trace block (default: %(default)s)")
    parser.add_argument("--quick", action="store_true",
                        help=f"replay only the first {QUICK_REQUESTS} requests")
    return parser.parse_args()


def trace_block_bytes(shape: ModelShape, fmt: KVFormat, block_tokens: int) -> int:
    """Bytes of one trace block of ``block_tokens`` tokens: that many tokens' pool blocks."""
    if block_tokens % shape.page_size:
        raise ValueError(f"{block_tokens=} must be a multiple of page_size={shape.page_size}")
    return block_tokens // shape.page_size * shape.bytes_per_block(fmt)


def tier_blocks(shape: ModelShape, fmt: KVFormat, budgets: dict[str, float],
                block_tokens: int) -> dict[str, int]:
    """Trace blocks that fit in each tier's budget (bytes) in format ``fmt``."""
    size = trace_block_bytes(shape, fmt, block_tokens)
    return {tier: blocks_in(int(budget), size) for tier, budget in budgets.items()}


def _table(shape: ModelShape, results, block_tokens: int) -> str:
    base = next((counts.hit_blocks for fmt, _, counts in results if not fmt.quantized), 0)
    rows = []
    for fmt, capacity, counts in results:
        device_share = counts.device_hit_blocks / counts.blocks if counts.blocks else 0.0
        rows.append([fmt.name() if fmt.quantized else f"none ({shape.dtype})",
                     f"{trace_block_bytes(shape, fmt, block_tokens) / 2**20:.1f}",
                     capacity["device"], capacity["host"], capacity["disk"],
                     f"{counts.block_hit_rate:.2%}", f"{counts.token_hit_rate:.2%}",
                     f"{device_share:.2%}", f"{counts.hit_blocks / base:.2f}" if base else "-"])
    headers = ["format", "MiB/block", "device blocks", "host blocks", "disk blocks",
               "block hits", "token hits", "of which device", "x float block hits"]
    return format_table(headers, rows)


if __name__ == "__main__":
    sys.exit(main())
