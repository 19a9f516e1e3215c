"""Blocks per GiB in each tier, per KV format: what the block codecs buy below the device.

For the tiny preset's shape and a Llama-3-8B-like one, and for the float pool, every quantized
pool format (its blocks go to host and disk packed with their scales, bit-exact) and every
lossy offload format of the float pool (``KVCacheConfig.offload_quant``: the device keeps
float pages, host and disk get quantized copies):

* device: ``GiB // PoolConfig.bytes_per_block``;
* host: the blocks a ``HostPool`` of 1 GiB holds (``GiB // block_nbytes`` slots, the
  codec's bytes);
* disk: measured, not computed: one full segment (``--segment-mib``) of random blocks is
  written through a ``DiskTier`` with the codec, and its bytes on disk (orbax files and the
  manifest with one checksum per block) give bytes per block, so GiB / that.

"x float" is the tier's blocks over the float pool's in the same tier.

Then the codecs' own cost, Llama-like shape: median time to encode ``--batch`` gathered blocks
(what an offload adds to the pool gather) and to decode them (what a fetch adds before the
scatter), next to the gather itself. The raw codec does no work at all (it is the identity).
CPU numbers on a shared machine: the ratios matter, not the milliseconds.

    .venv/bin/python benchmarks/bench_tier_capacity.py [--segment-mib 16] [--batch 8] [--repeats 9]
"""

from __future__ import annotations

import argparse
import logging
import statistics
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np
from kv_quant_common import (
    ALL_FORMATS,
    GIB,
    LLAMA3_8B,
    ModelShape,
    blocks_in,
    command_line,
    format_table,
    tiny_shape,
)

from kvjax.tiers.block_codec import BlockCodec, make_codec
from kvjax.tiers.disk_tier import DiskTier
from kvjax.tiers.host_pool import HostPool
from kvjax.tiers.page_pool import PagePool
from pallas_kernels.kv_format import KVFormat

NAMESPACE = b"bench-namespace!"


def main() -> None:
    args = parse_args()
    logging.getLogger("absl").setLevel(logging.ERROR)  # orbax logs every save
    for shape in (tiny_shape(), LLAMA3_8B):
        print(shape.describe())
        rows, float_counts = [], None
        for label, pool, codec in configurations(shape):
            counts = (blocks_in(GIB, pool.bytes_per_block),
                      HostPool(codec.block_shape, codec.dtype, GIB // codec.block_nbytes, store_bytes=False).num_slots,
                      int(GIB // disk_bytes_per_block(codec, args.segment_mib << 20)))  # fmt: skip
            float_counts = float_counts or counts
            rows.append([label, codec.name, f"{codec.block_nbytes / 1024:.1f}"]
                        + [f"{n} ({n / f:.2f}x)" for n, f in zip(counts, float_counts)])
        print(format_table(["pool / offload", "codec", "KiB/block below",
                            "device blocks/GiB", "host blocks/GiB", "disk blocks/GiB"], rows))
        print()
    print("(x float: against the float pool in the same tier)\n")
    print(f"codec cost, {LLAMA3_8B.name}, {args.batch} blocks, median of {args.repeats} (ms)")
    rows = [codec_times(label, pool, codec, args) for label, pool, codec in configurations(LLAMA3_8B)
            if codec.name == "raw" or label.endswith("int8/token pool") or "offload" in label]
    print(format_table(["pool / offload", "codec", "gather", "encode", "decode"], rows))
    print(f"\n$ {command_line()}")


def configurations(shape: ModelShape):
    """(label, pool config, codec): the float pool, quantized pools, lossy offload."""
    float_pool = shape.pool(KVFormat())
    yield f"{shape.dtype} pool", float_pool, make_codec(float_pool)
    for fmt in ALL_FORMATS[1:]:
        pool = shape.pool(fmt)
        yield f"{fmt.name()} pool", pool, make_codec(pool)
    for fmt in ALL_FORMATS[1:]:
        yield (f"{shape.dtype} pool, offload {fmt.name()}", float_pool,
               make_codec(float_pool, fmt.quant, fmt.granularity))


def disk_bytes_per_block(codec: BlockCodec, segment_bytes: int) -> float:
    """Bytes on disk per block of one full segment written through a DiskTier."""
    num_blocks = max(1, segment_bytes // codec.block_nbytes)
    rng = np.random.default_rng(0)
    raw = rng.integers(0, 256, (num_blocks, codec.block_nbytes), np.uint8)
    blocks = raw.view(codec.dtype).reshape(num_blocks, *codec.block_shape)
    keys = [i.to_bytes(16, "little") for i in range(num_blocks)]
    with tempfile.TemporaryDirectory() as directory:
        disk = DiskTier(directory, codec.block_shape, codec.dtype, 1 << 40, segment_bytes=segment_bytes,
                        codec=codec.name)  # fmt: skip
        stored = disk.put(keys, blocks, NAMESPACE)
        if len(stored) != num_blocks:
            raise RuntimeError(f"the disk tier kept {len(stored)} of {num_blocks} blocks")
        return disk.bytes_used / num_blocks


def codec_times(label: str, pool_config, codec: BlockCodec, args) -> list[str]:
    """[label, codec, gather ms, encode ms, decode ms] for ``args.batch`` blocks."""
    pool = PagePool(pool_config.__class__(**{**_fields(pool_config), "num_blocks": args.batch + 1}))
    ids = jnp.arange(args.batch, dtype=jnp.int32)
    gathered = pool.gather(ids)
    stored = codec.encode(gathered)
    ops = {"gather": lambda: pool.gather(ids), "encode": lambda: codec.encode(gathered),
           "decode": lambda: codec.decode(stored)}
    times = {}
    for name, op in ops.items():
        jax.block_until_ready(op())  # compile
        samples = []
        for _ in range(args.repeats):
            start = time.perf_counter()
            jax.block_until_ready(op())
            samples.append(time.perf_counter() - start)
        times[name] = f"{1e3 * statistics.median(samples):.2f}"
    if codec.name == "raw":
        times["encode"] = times["decode"] = "0 (identity)"
    return [label, codec.name, times["gather"], times["encode"], times["decode"]]


def _fields(config) -> dict:
    return {name: getattr(config, name) for name in config.__dataclass_fields__}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--segment-mib", type=int, default=16, help="disk segment size to measure (MiB)")
    parser.add_argument("--batch", type=int, default=8, help="blocks per encode/decode timed")
    parser.add_argument("--repeats", type=int, default=9, help="timed calls per figure (median)")
    return parser.parse_args()


if __name__ == "__main__":
    main()
