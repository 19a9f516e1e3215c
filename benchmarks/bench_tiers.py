"""Tier bandwidth and latency, each next to the same bytes moved by plain means in the same run.

    .venv/bin/python benchmarks/bench_tiers.py [--segment-mib 64] [--repeats 5] [--dir DIR]

(with kvjax installed, `pip install -e .`, or `PYTHONPATH=.`)

Host links: HostPool.write (device blocks -> one copy to host -> one scatter into slots) and
HostPool.to_device (one gather of slots on host -> one copy to the device) against numpy
memcpy of the same bytes, into a fresh buffer and into a warm one. Disk links: DiskTier.put (one orbax segment, checksums, manifest, fsync)
and DiskTier.get (every block, checksums verified) against a raw file write + fsync (and
without fsync, as the tier fsyncs only its manifest unless sync_data) and a raw read into a
fresh buffer, warm (page cache) and cold (page cache dropped with
posix_fadvise(DONTNEED) for both). Orbax's defaults (StandardCheckpointer, compressed) are
shown for reference. Latency: one-block fetch from the host tier, direct and through the
transfer engine. Each figure is the best and the median of --repeats runs; "vs plain" is the
plain path's best time over the tier's best time (other load on the machine only adds time).
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import statistics
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp

from kvjax.tiers import disk_segments
from kvjax.tiers.disk_tier import DiskTier
from kvjax.tiers.host_pool import HostPool
from kvjax.tiers.transfer import Priority, TransferEngine

NS = b"bench-namespace!"


def main() -> None:
    args = _parse_args()
    logging.getLogger("absl").setLevel(logging.ERROR)  # orbax logs every save
    block_shape = tuple(args.block_shape)
    dtype = jnp.dtype(args.dtype)
    block_nbytes = int(np.prod(block_shape)) * dtype.itemsize
    num_blocks = max(1, (args.segment_mib << 20) // block_nbytes)
    rng = np.random.default_rng(0)
    blocks = rng.integers(0, 256, (num_blocks, block_nbytes), np.uint8).view(dtype).reshape(
        num_blocks, *block_shape)
    mib = blocks.nbytes / 2**20
    print(f"command: {' '.join([os.path.basename(sys.executable), *sys.argv])}")
    print(f"jax {jax.__version__} on {jax.devices()[0].platform}, orbax "
          f"{ocp.__version__}; {num_blocks} blocks of {block_shape} {dtype.name} "
          f"({block_nbytes >> 10} KiB) = {mib:.0f} MiB per transfer; "
          f"{args.repeats} runs; load average {os.getloadavg()[0]:.1f} on "
          f"{os.cpu_count()} cores\n")
    rows = _host_rows(blocks, args.repeats)
    root = tempfile.mkdtemp(prefix="kvjax-bench-", dir=args.dir)
    try:
        for use_ocdbt, sync_data in ((True, False), (True, True), (False, False)):
            rows += _disk_rows(blocks, args.repeats,
                               os.path.join(root, f"ocdbt{use_ocdbt}-sync{sync_data}"),
                               use_ocdbt, sync_data, args.segment_mib << 20)
        rows += _orbax_default_rows(blocks, args.repeats, os.path.join(root, "defaults"))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    _print_table(rows, mib)
    _print_latency(blocks, args.latency_trials)


def _host_rows(blocks: np.ndarray, repeats: int) -> list[tuple]:
    slots = np.random.default_rng(2).permutation(len(blocks))  # scattered slots
    device_blocks = jax.device_put(blocks)
    warm = np.empty_like(blocks)
    pool = HostPool(blocks.shape[1:], blocks.dtype, len(blocks))
    put_s, get_s, fresh_s, warm_s = [], [], [], []
    for _ in range(repeats + 1):  # the first round compiles and is dropped
        put_s.append(_timed(lambda: pool.write(slots, device_blocks)))
        get_s.append(_timed(lambda: pool.to_device(slots).block_until_ready()))
        fresh_s.append(_timed(lambda: blocks.copy()))
        warm_s.append(_timed(lambda: np.copyto(warm, blocks)))
    return [
        ("device->host", "HostPool.write (into slots)", put_s[1:], fresh_s[1:], "memcpy, fresh"),
        ("device->host", "numpy memcpy, warm dst", warm_s[1:], fresh_s[1:], "memcpy, fresh"),
        ("host->device", "HostPool.to_device", get_s[1:], fresh_s[1:], "memcpy, fresh"),
        ("host (plain)", "numpy memcpy, fresh dst", fresh_s[1:], fresh_s[1:], "memcpy, fresh"),
    ]


def _disk_rows(blocks: np.ndarray, repeats: int, directory: str, use_ocdbt: bool,
               sync_data: bool, segment_bytes: int) -> list[tuple]:
    tier = DiskTier(directory, blocks.shape[1:], blocks.dtype, 1 << 40,
                    segment_bytes=segment_bytes, use_ocdbt=use_ocdbt, sync_data=sync_data)
    raw_path = os.path.join(directory, "raw.bin")
    checkpointer = disk_segments.make_checkpointer(use_ocdbt)
    times = {name: [] for name in ("put", "raw_w", "raw_w_nosync", "get_warm", "raw_warm",
                                   "get_cold", "raw_cold", "restore")}
    for rep in range(repeats):
        keys = [(rep << 32 | i).to_bytes(16, "little") for i in range(len(blocks))]
        times["raw_w"].append(_timed(lambda: _raw_write(raw_path, blocks)))
        times["raw_w_nosync"].append(_timed(lambda: _raw_write(raw_path, blocks, fsync=False)))
        times["put"].append(_timed(lambda: _expect(len(tier.put(keys, blocks, NS)), len(keys))))
        times["raw_warm"].append(_timed(lambda: _raw_read(raw_path, blocks)))
        times["get_warm"].append(_timed(lambda: _expect(
            int(tier.get(keys, NS).hits.sum()), len(keys))))
        _drop_page_cache(directory)
        times["raw_cold"].append(_timed(lambda: _raw_read(raw_path, blocks)))
        times["get_cold"].append(_timed(lambda: _expect(
            int(tier.get(keys, NS).hits.sum()), len(keys))))
        _drop_page_cache(directory)
        segment = max(p for p in os.listdir(directory) if p.startswith("seg-") and "." not in p)
        times["restore"].append(_timed(lambda: checkpointer.restore(
            os.path.join(directory, segment), args=ocp.args.PyTreeRestore(restore_args={
                "payload": ocp.RestoreArgs(restore_type=np.ndarray)}))))
    config = ("ocdbt" if use_ocdbt else "file per block") + (", sync_data" if sync_data else "")
    rows = [("host->disk", f"DiskTier.put, {config}", times["put"], times["raw_w"],
             "write+fsync")]
    if not sync_data:
        rows.append(("host->disk", f"DiskTier.put, {config}", times["put"],
                     times["raw_w_nosync"], "write, no fsync"))
    return rows + [
        ("disk->host", f"DiskTier.get warm, {config}", times["get_warm"], times["raw_warm"],
         "read warm"),
        ("disk->host", f"DiskTier.get cold, {config}", times["get_cold"], times["raw_cold"],
         "read cold"),
        ("disk->host", "  same segment, orbax restore", times["restore"], times["raw_cold"],
         "read cold"),
    ]


def _orbax_default_rows(blocks: np.ndarray, repeats: int, directory: str) -> list[tuple]:
    checkpointer = ocp.StandardCheckpointer()
    raw_path = os.path.join(directory, "raw.bin")
    os.makedirs(directory)
    save_s, restore_s, raw_w, raw_r = [], [], [], []
    for rep in range(repeats):
        path = os.path.join(directory, f"step{rep}")
        raw_w.append(_timed(lambda: _raw_write(raw_path, blocks)))
        save_s.append(_timed(lambda: (checkpointer.save(path, {"payload": blocks}),
                                      checkpointer.wait_until_finished())))
        _drop_page_cache(directory)
        raw_r.append(_timed(lambda: _raw_read(raw_path, blocks)))
        restore_s.append(_timed(lambda: checkpointer.restore(path)))
    checkpointer.close()
    return [
        ("host->disk", "orbax defaults: save", save_s, raw_w, "write+fsync"),
        ("disk->host", "orbax defaults: restore cold", restore_s, raw_r, "read cold"),
    ]


def _print_table(rows: list[tuple], mib: float) -> None:
    """Best (least disturbed by other load) and median of the runs; ratios use the best."""
    header = ("link", "path", "best ms", "median ms", "MiB/s", "plain", "best ms", "MiB/s",
              "vs plain")
    lines = [header]
    for link, path, seconds, plain_seconds, plain_name in rows:
        best, plain_best = 1e3 * min(seconds), 1e3 * min(plain_seconds)
        lines.append((link, path, f"{best:.1f}", f"{1e3 * statistics.median(seconds):.1f}",
                      f"{mib / best * 1e3:.0f}", plain_name, f"{plain_best:.1f}",
                      f"{mib / plain_best * 1e3:.0f}", f"{plain_best / best:.0%}"))
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    for line in lines:
        print("  ".join(cell.ljust(width) for cell, width in zip(line, widths)).rstrip())


def _print_latency(blocks: np.ndarray, trials: int) -> None:
    pool = HostPool(blocks.shape[1:], blocks.dtype, len(blocks))
    pool.write(np.arange(len(blocks)), blocks)
    picks = np.random.default_rng(1).integers(0, len(blocks), trials)
    pool.to_device(np.array([0])).block_until_ready()  # compile
    direct = [_timed(lambda: pool.to_device(np.array([i])).block_until_ready()) for i in picks]
    with TransferEngine(pool) as engine:
        via_engine = [_timed(lambda: engine.fetch([i], priority=Priority.DEMAND)
                             .result(timeout=30).blocks) for i in picks]
    print(f"\none-block host->device fetch ({blocks[0].nbytes >> 10} KiB), {trials} trials:")
    for name, seconds in (("HostPool.to_device", direct), ("TransferEngine.fetch", via_engine)):
        p50, p99 = np.percentile(np.array(seconds) * 1e3, [50, 99])
        print(f"  {name:<22} p50 {p50:.3f} ms  p99 {p99:.3f} ms")


def _raw_write(path: str, blocks: np.ndarray, fsync: bool = True) -> None:
    with open(path, "wb") as f:
        f.write(blocks.view(np.uint8).data)
        f.flush()
        if fsync:
            os.fsync(f.fileno())


def _raw_read(path: str, like: np.ndarray) -> np.ndarray:
    out = np.empty(like.nbytes, np.uint8)  # fresh, as DiskTier.get returns a fresh array
    with open(path, "rb") as f:
        f.readinto(out.data)
    return out


def _drop_page_cache(directory: str) -> None:
    for root, _, files in os.walk(directory):
        for name in files:
            fd = os.open(os.path.join(root, name), os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _expect(got: int, want: int) -> None:
    if got != want:
        raise RuntimeError(f"benchmark moved {got} blocks, expected {want}")


def _parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--segment-mib", type=int, default=64)
    parser.add_argument("--block-shape", type=int, nargs="+", default=[8, 2, 4, 16, 128],
                        help="num_layers 2 num_kv_heads page_size head_dim")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--latency-trials", type=int, default=300)
    parser.add_argument("--dir", default=None, help="where segments go (default: TMPDIR)")
    return parser.parse_args()


if __name__ == "__main__":
    main()
