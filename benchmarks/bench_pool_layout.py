"""Pool layout: offloading n blocks and one layer's attention read, page-major vs layer-major.

Layouts, all holding the same K/V:

* page-major   ``[num_blocks, L, 2, H, P, D]`` (kvjax's pool): a block of every layer is one
  contiguous region;
* layer-list   L arrays ``[num_blocks, 2, H, P, D]`` (one cache array per layer);
* layer-stack  one ``[L, num_blocks, 2, H, P, D]`` array.

Offload = gather the n blocks of every layer on the device, then ``jax.device_put`` them
into ``pinned_host`` memory, until the host copy is ready. Attention = one layer of
:func:`pallas_kernels.paged_attention` (XLA path) over a decode batch: page-major reads
layer l of the shared pool, layer-major reads a pool of that layer alone. Write = one layer
of :func:`pallas_kernels.write_kv` for the same decode tokens. ``--impls`` also times the
page-major gather/scatter of each named implementation (meaningful on an accelerator).

    .venv/bin/python benchmarks/bench_pool_layout.py [--num-blocks 128] [--layers 16]
        [--heads 8] [--page-size 16] [--head-dim 128] [--dtype bfloat16] [--n 1,8,32]
        [--repeats 20] [--impls xla]

Prints median / min milliseconds per operation (calls interleaved across columns, so load
from other processes hits every column alike) and the page-major batched offload in GB/s.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pallas_kernels import gather_blocks, paged_attention, scatter_blocks, write_kv  # noqa: E402


def main() -> None:
    args = parse_args()
    L, H, P, D = args.layers, args.heads, args.page_size, args.head_dim
    dtype = jnp.dtype(args.dtype)
    block_bytes = L * 2 * H * P * D * dtype.itemsize
    print(f"backend={jax.default_backend()} pool: {args.num_blocks} blocks x {L} layers, "
          f"H={H} P={P} D={D} {dtype.name}; one block = {block_bytes / 2**20:.2f} MiB, "
          f"pool = {args.num_blocks * block_bytes / 2**20:.0f} MiB\n")
    page_major = jax.random.normal(jax.random.key(0), (args.num_blocks, L, 2, H, P, D), dtype)
    layer_list = [jnp.asarray(page_major[:, l]) for l in range(L)]
    layer_stack = jnp.stack(layer_list)
    host = _host_sharding()
    print("offload n blocks to pinned_host: ms per offload, median / min")
    print("  batched:   gather on device, then one device_put per gathered array")
    print("  per-block: one device array per block and layer-slice (kvjax's host tier keeps")
    print("             one array per block), all handed to one device_put")
    print(f"  page-major/8: batched, in gathers of at most 8 blocks ({8 * block_bytes / 2**20:.2f} MiB here)")
    columns = ("page-major", "page-major/8", "layer-list", "layer-stack", "page-major",
               "layer-list")
    print(f"{'':>4} | {'batched':^71} | {'per-block':^33} |")
    print(f"{'n':>4} | " + " | ".join(f"{c:>15}" for c in columns) + " | page-major GB/s")
    for n in args.n:
        ids = jnp.asarray(np.random.default_rng(n).permutation(args.num_blocks)[:n], jnp.int32)
        times = _time([
            lambda: _offload_page_major(page_major, ids, host),
            lambda: _offload_page_major(page_major, ids, host, chunk=8),
            lambda: _offload_layer_list(layer_list, ids, host),
            lambda: _offload_layer_stack(layer_stack, ids, host),
            lambda: _offload_per_block([page_major], ids, host),
            lambda: _offload_per_block(layer_list, ids, host),
        ], args.repeats)
        cells = " | ".join(f"{_fmt(t):>15}" for t in times)
        print(f"{n:>4} | {cells} | {n * block_bytes / np.min(times[0]) / 1e9:>15.2f}")
    _per_layer_table(page_major, layer_list, args)
    for impl in args.impls:
        _impl_row(page_major, impl, args)
    print(f"\ncommand: {' '.join(sys.argv)}")


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-blocks", type=int, default=128)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--n", type=lambda s: [int(x) for x in s.split(",")], default=[1, 8, 32])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--impls", type=lambda s: s.split(","), default=[])
    args = parser.parse_args()
    if args.num_blocks < 8 or args.num_blocks % 8:  # the decode table: 8 sequences of equal pages
        parser.error(f"--num-blocks {args.num_blocks}: expected a multiple of 8 (8 decode sequences share the pool)")
    return args


def _offload_page_major(pool, ids, host, chunk=None):
    chunk = chunk or ids.shape[0]
    parts = [gather_blocks(pool, ids[i:i + chunk]) for i in range(0, ids.shape[0], chunk)]
    return jax.block_until_ready(jax.device_put(parts, host))


def _offload_layer_list(layers, ids, host):
    # One gather and one transfer per layer: what a per-layer cache has to do.
    out = [jax.device_put(_take(layer, ids), host) for layer in layers]
    return jax.block_until_ready(out)


def _offload_layer_stack(stack, ids, host):
    return jax.device_put(_take_axis1(stack, ids), host).block_until_ready()


def _offload_per_block(arrays, ids, host):
    # Page-major: one slice per block. Layer-major: one slice per block and layer.
    pieces = [_row(array, ids[i]) for i in range(ids.shape[0]) for array in arrays]
    return jax.block_until_ready(jax.device_put(pieces, host))


@jax.jit
def _row(array, block):
    return jax.lax.dynamic_index_in_dim(array, block, keepdims=False)


@jax.jit
def _take(layer, ids):
    return layer[ids]


@jax.jit
def _take_axis1(stack, ids):
    return stack[:, ids]


def _per_layer_table(page_major, layer_list, args):
    """One layer's attention read and KV write for a decode batch, both layouts."""
    num_seqs, H, P, D = 8, args.heads, args.page_size, args.head_dim
    pages_per_seq = args.num_blocks // num_seqs
    tables = jnp.asarray(np.random.default_rng(0).permutation(args.num_blocks)
                         .reshape(num_seqs, pages_per_seq), jnp.int32)
    seq_lens = jnp.full((num_seqs,), pages_per_seq * P, jnp.int32)
    cu_q_lens = jnp.arange(num_seqs + 1, dtype=jnp.int32)
    q = jnp.ones((num_seqs, 4 * H, D), page_major.dtype)
    layer = args.layers // 2
    one_layer = layer_list[layer][:, None]  # [num_blocks, 1, 2, H, P, D]: a layer-major pool

    def attend(pool, l):
        return paged_attention(q, pool, tables, seq_lens, cu_q_lens, layer=l).block_until_ready()

    kv = jnp.ones((num_seqs, H, D), page_major.dtype)
    slots = tables[:, -1] * P + P - 1
    # write_kv donates the pool it writes: write into copies, so the caller's page_major
    # stays alive for the --impls rows.
    state = {"page": jnp.array(page_major), "layer": jnp.array(one_layer)}

    def write(key, l):
        state[key] = write_kv(state[key], kv, kv, slots, layer=l).block_until_ready()

    print(f"\none layer, decode batch of {num_seqs} seqs x {pages_per_seq * P} tokens "
          f"(GQA {4 * H}/{H} heads)")
    print(f"{'ms':>10} | {'page-major':>15} | {'layer-major':>15}")
    for name, page_fn, layer_fn in (
        ("attention", lambda: attend(page_major, layer), lambda: attend(one_layer, 0)),
        ("write_kv", lambda: write("page", layer), lambda: write("layer", 0)),
    ):
        page_times, layer_times = _time([page_fn, layer_fn], args.repeats)
        print(f"{name:>10} | {_fmt(page_times):>15} | {_fmt(layer_times):>15}")


def _impl_row(page_major, impl, args):
    ids = jnp.arange(max(args.n), dtype=jnp.int32)
    blocks = gather_blocks(page_major, ids, impl=impl)
    state = {"pool": jnp.array(page_major)}

    def scatter():
        state["pool"] = scatter_blocks(state["pool"], ids, blocks, impl=impl).block_until_ready()

    gather, scatter = _time(
        [lambda: gather_blocks(page_major, ids, impl=impl).block_until_ready(), scatter],
        args.repeats)
    print(f"\nimpl={impl}, n={len(ids)}: gather {_fmt(gather)} ms, scatter {_fmt(scatter)} ms")


def _host_sharding():
    device = jax.devices()[0]
    return jax.sharding.SingleDeviceSharding(device, memory_kind="pinned_host")


def _time(fns, repeats: int) -> list[list[float]]:
    """Seconds per call of each fn. Calls are interleaved, so load from other processes on a
    shared machine hits every column alike."""
    for fn in fns:  # compile and warm up
        fn()
        fn()
    times = [[] for _ in fns]
    for _ in range(repeats):
        for fn, column in zip(fns, times):
            start = time.perf_counter()
            fn()
            column.append(time.perf_counter() - start)
    return times


def _fmt(times) -> str:
    """``median / min`` in milliseconds: the minimum is the least disturbed run."""
    return f"{np.median(times) * 1e3:.2f} / {np.min(times) * 1e3:.2f}"

if __name__ == "__main__":
    main()
