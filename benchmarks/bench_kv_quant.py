"""Quantized KV pages at the kernel level: bytes saved, attention error, write cost (XLA path).

For the float pool and every format x scale granularity (``pallas_kernels.kv_format.QUANT_FORMATS``):

* bytes: stored bytes per K/V element and per block (scales included, from
  ``PoolConfig.bytes_per_block``) and blocks per GiB, for the tiny preset's shape and a
  Llama-3-8B-like one (32 layers, 8 KV heads, head_dim 128, page 16, bfloat16);
* attention error: ``||out - exact|| / ||exact||`` of :func:`pallas_kernels.paged_attention`
  (``impl="xla"``) on the quantized pool against the float32 reference on the float pool, for a
  decode batch and a chunked-prefill batch, over three kinds of K/V: standard normal; a few
  channels (the same in every token) scaled by ``--channel-outlier``, as real keys have; and
  5% of tokens scaled by ``--token-outlier`` (a per-page scale is set by the page's largest
  token, so the others lose precision; a large factor on K instead makes the softmax a
  near-argmax whose error says little about the format). "written" fills the decode batch's
  pool token by token with
  :func:`pallas_kernels.write_kv`, as decoding does, where the others quantize the whole pool at
  once: with per-page scales each new maximum requantizes the page's earlier tokens;
* write cost: median time of one layer's ``write_kv`` for a decode step (``--decode-seqs``
  sequences, one token each, mid-page) and a prefill chunk (``--prefill-tokens`` tokens of one
  sequence), Llama-like layer (8 KV heads of 128, page 16), K/V in bfloat16. A per-page write
  reads and rewrites each touched page; a per-token write writes only its rows. XLA on CPU
  converts to and from float8 in software, so there the fp8 rows time that emulation, not
  what an accelerator would do.

    .venv/bin/python benchmarks/bench_kv_quant.py [--quick] [--repeats 15]
        [--channel-outlier 20] [--token-outlier 5] [--decode-seqs 256] [--prefill-tokens 512]

Timings are medians over ``--repeats`` calls, formats interleaved so that load from other
processes hits every row alike (CPU numbers: the ratios matter, not the milliseconds).
"""

from __future__ import annotations

import argparse
import dataclasses
import time

import jax
import jax.numpy as jnp
import numpy as np
from kv_quant_common import (
    ALL_FORMATS,
    GIB,
    LLAMA3_8B,
    blocks_in,
    command_line,
    format_table,
    tiny_shape,
)

from pallas_kernels import paged_attention, paged_attention_reference, write_kv
from pallas_kernels.example_inputs import make_case, quantize_case
from pallas_kernels.kv_format import QUANT_FORMATS, KVFormat, empty_pool, relative_error

# Attention cases: (q_lens, kv_lens) per sequence. Decode: one new token over contexts around
# and across page boundaries. Prefill: chunks on top of cached KV, a whole prompt, a decode.
DECODE = ([1] * 16, [1, 15, 16, 17, 31, 48, 64, 100, 129, 150, 200, 230, 256, 270, 290, 300])
PREFILL = ([64, 48, 100, 1, 16, 32, 200, 7], [64, 200, 300, 256, 50, 96, 250, 120])
QUICK_DECODE = ([1] * 4, [1, 17, 40, 64])
QUICK_PREFILL = ([16, 20, 1], [16, 50, 40])
TOKEN_OUTLIER_SHARE = 0.05
OUTLIER_CHANNELS = 4


def main() -> None:
    args = parse_args()
    print(f"backend={jax.default_backend()}; attention and writes on the XLA path\n")
    print_bytes_table()
    print_error_tables(args)
    print_write_table(args)
    print(f"\ncommand: {command_line()}")


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="small cases and few repeats")
    parser.add_argument("--repeats", type=int, default=15, help="timed calls per format")
    parser.add_argument("--channel-outlier", type=float, default=20.0,
                        help="factor of the outlier channels (default: %(default)s)")
    parser.add_argument("--token-outlier", type=float, default=5.0,
                        help="factor of the outlier tokens (default: %(default)s)")
    parser.add_argument("--decode-seqs", type=int, default=256)
    parser.add_argument("--prefill-tokens", type=int, default=512)
    args = parser.parse_args()
    if args.quick:
        args.repeats = min(args.repeats, 5)
        args.decode_seqs, args.prefill_tokens = min(args.decode_seqs, 32), min(args.prefill_tokens, 64)
    return args


# --- bytes -------------------------------------------------------------------------------------


def print_bytes_table() -> None:
    shapes = [tiny_shape(), LLAMA3_8B]
    print("bytes per K/V element and per block (scales included); blocks per GiB")
    for shape in shapes:
        print(f"  {shape.describe()}")
    headers = ["format"]
    for shape in shapes:
        headers += [f"{shape.name} B/elem", "KiB/block", "blocks/GiB", "x float"]
    rows = []
    for fmt in ALL_FORMATS:
        row = [fmt.name()]
        for shape in shapes:
            per_block = shape.bytes_per_block(fmt)
            elements = shape.num_layers * 2 * shape.num_kv_heads * shape.page_size * shape.head_dim
            per_gib = blocks_in(GIB, per_block)
            row += [f"{per_block / elements:.4f}", f"{per_block / 1024:.1f}", f"{per_gib}",
                    f"{per_gib / blocks_in(GIB, shape.bytes_per_block(KVFormat())):.2f}"]
        rows.append(row)
    print(format_table(headers, rows) + "\n")


# --- attention error ---------------------------------------------------------------------------


def print_error_tables(args) -> None:
    decode, prefill = (QUICK_DECODE, QUICK_PREFILL) if args.quick else (DECODE, PREFILL)
    head_dim = 64 if args.quick else 128
    print(f"attention relative error vs the float32 reference on the float pool "
          f"(page 16, head_dim {head_dim}, 8 query / 2 KV heads)")
    print(f"  decode: kv lens {decode[1]}; prefill: q lens {prefill[0]} over kv lens {prefill[1]}")
    for kind in ("normal", "channel", "token"):
        title = {"normal": "standard normal",
                 "channel": f"{OUTLIER_CHANNELS} channels x{args.channel_outlier:g} in every token",
                 "token": f"{TOKEN_OUTLIER_SHARE:.0%} of tokens x{args.token_outlier:g}"}[kind]
        factor = args.channel_outlier if kind == "channel" else args.token_outlier
        cases = {name: _with_outliers(make_case(seed, q_lens=q, kv_lens=kv, page_size=16,
                                                head_dim=head_dim, num_q_heads=8, num_kv_heads=2,
                                                num_layers=1, layer=0), kind, factor, seed)
                 for seed, (name, (q, kv)) in enumerate((("decode", decode),
                                                         ("prefill", prefill)))}
        rows = []
        for fmt in QUANT_FORMATS:
            errors = [attention_error(cases[name], fmt) for name in ("decode", "prefill")]
            errors.append(attention_error(cases["decode"], fmt, written=True))
            rows.append([fmt.name()] + [f"{e:.2%}" for e in errors])
        print(f"\n  K/V: {title}")
        print(format_table(["format", "decode", "prefill", "decode, written per token"], rows))
    print()


def attention_error(case, fmt: KVFormat, *, written: bool = False) -> float:
    """Relative error of the XLA attention on ``case`` quantized to ``fmt`` (whole pool at
    once, or ``written`` token by token in sequence order) against the float reference."""
    if written:
        quantized = dataclasses.replace(case, kv_pages=_written_pool(case, fmt))
    else:
        quantized = quantize_case(case, fmt)
    out = paged_attention(*quantized.args(), layer=case.layer, impl="xla")
    exact = paged_attention_reference(*case.args(), layer=case.layer)
    live = int(np.asarray(case.cu_q_lens)[int(case.num_seqs[0])])
    return relative_error(out[:live], exact[:live])


def _with_outliers(case, kind: str, factor: float, seed: int):
    """``case`` with outlier channels or outlier tokens in K and V (``kind="normal"``: as is)."""
    pages = np.array(case.kv_pages, np.float32)  # [blocks, layers, 2, kv_heads, page, head_dim]
    rng = np.random.default_rng(1000 + seed)
    if kind == "channel":
        channels = rng.permutation(pages.shape[-1])[:OUTLIER_CHANNELS]
        pages[..., channels] *= factor
    elif kind == "token":
        rows = rng.random(pages.shape[:-1]) < TOKEN_OUTLIER_SHARE
        pages[rows] *= factor
    return dataclasses.replace(case, kv_pages=jnp.asarray(pages))


def _written_pool(case, fmt: KVFormat):
    """A ``fmt`` pool holding ``case``'s live K/V, written one position of every sequence per
    ``write_kv`` call (decode order); unwritten slots are zero."""
    pages = np.asarray(case.kv_pages, np.float32)
    tables, lens = np.asarray(case.block_tables), np.asarray(case.seq_lens)
    page_size, layer = pages.shape[4], case.layer
    pool = empty_pool(pages.shape, fmt)
    for pos in range(int(lens.max())):
        live = pos < lens
        blocks = tables[:, pos // page_size]
        slots = np.where(live, blocks * page_size + pos % page_size, -1).astype(np.int32)
        kv = np.nan_to_num(pages[blocks, layer, :, :, pos % page_size])  # [seqs, 2, kv_heads, d]
        pool = write_kv(pool, jnp.asarray(kv[:, 0]), jnp.asarray(kv[:, 1]), jnp.asarray(slots),
                        layer=layer, impl="xla")
    return pool


# --- write cost --------------------------------------------------------------------------------


def print_write_table(args) -> None:
    shape = LLAMA3_8B
    num_blocks = max(2 * args.decode_seqs, -(-args.prefill_tokens // shape.page_size) + 1)
    pool_shape = (num_blocks, 2, 2, shape.num_kv_heads, shape.page_size, shape.head_dim)
    print(f"write_kv cost, one layer of a {num_blocks}-block pool ({shape.num_kv_heads} KV heads, "
          f"head_dim {shape.head_dim}, page {shape.page_size}), K/V bfloat16; "
          f"median of {args.repeats} calls")
    steps = {"decode": _decode_step(args.decode_seqs, num_blocks, shape),
             "prefill": _prefill_step(args.prefill_tokens, shape)}
    pools = {fmt: empty_pool(pool_shape, fmt, jnp.bfloat16) for fmt in ALL_FORMATS}
    times = {(fmt, kind): [] for fmt in ALL_FORMATS for kind in steps}
    for repeat in range(args.repeats + 2):  # the first two calls compile and warm up
        for kind, (k, v, slots) in steps.items():
            for fmt in ALL_FORMATS:
                start = time.perf_counter()
                pools[fmt] = jax.block_until_ready(write_kv(pools[fmt], k, v, slots, layer=1,
                                                           impl="xla"))
                if repeat >= 2:
                    times[fmt, kind].append(time.perf_counter() - start)
    rows = []
    base = {kind: np.median(times[KVFormat(), kind]) for kind in steps}
    for fmt in ALL_FORMATS:
        row = [fmt.name() if fmt.quantized else "none (bfloat16)"]
        for kind in steps:
            median = np.median(times[fmt, kind])
            row += [f"{median * 1e3:.2f}", f"{median / base[kind]:.2f}"]
        rows.append(row)
    headers = ["format", f"decode {args.decode_seqs} seqs ms", "x float",
               f"prefill {args.prefill_tokens} tokens ms", "x float"]
    print(format_table(headers, rows))


def _decode_step(num_seqs: int, num_blocks: int, shape):
    """One token for each of ``num_seqs`` sequences, each in its own page, at offsets 1..P-1."""
    rng = np.random.default_rng(0)
    blocks = rng.permutation(num_blocks)[:num_seqs]
    slots = blocks * shape.page_size + rng.integers(1, shape.page_size, num_seqs)
    return (*_kv(rng, num_seqs, shape), jnp.asarray(slots, jnp.int32))


def _prefill_step(num_tokens: int, shape):
    """``num_tokens`` consecutive tokens of one sequence, from offset 0 of block 0."""
    rng = np.random.default_rng(1)
    return (*_kv(rng, num_tokens, shape), jnp.arange(num_tokens, dtype=jnp.int32))


def _kv(rng, num_tokens: int, shape):
    draw = lambda: jnp.asarray(rng.standard_normal((num_tokens, shape.num_kv_heads, shape.head_dim)),
                               jnp.bfloat16)
    return draw(), draw()


if __name__ == "__main__":
    main()
