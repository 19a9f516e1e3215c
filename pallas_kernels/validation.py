"""Input checks shared by every implementation.

Two kinds, as in the rest of kvjax:

* static checks (ranks, shapes, dtypes, head ratios) run at trace time inside the public
  wrappers and raise ``ValueError`` naming the offending value;
* value checks (block ids in range, lengths within the table) need concrete metadata, so they
  live in :func:`check_paged_attention_metadata` / :func:`check_slot_mapping`, which the
  engine calls on the host before a step and which tests exercise directly.
"""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np

from pallas_kernels.kv_format import FORMATS, QuantizedPages

__all__ = [
    "POOL_DTYPES",
    "check_pool",
    "check_paged_attention_args",
    "check_kv_write_args",
    "check_block_copy_args",
    "check_paged_attention_metadata",
    "check_slot_mapping",
    "check_block_ids",
]

# Float formats attention runs on. Quantized pools (int8 / fp8) come with their own scales
# (see :mod:`pallas_kernels.kv_format`).
POOL_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
QUANT_DTYPES = tuple(spec.dtype for spec in FORMATS.values())


def check_pool(kv_pages, layer: int | None = None) -> None:
    """The pool is ``[num_blocks, num_layers, 2, num_kv_heads, page_size, head_dim]``: a float
    array, or a :class:`~pallas_kernels.kv_format.QuantizedPages` with matching scales."""
    _check_array("kv_pages", kv_pages)
    if kv_pages.ndim != 6 or kv_pages.shape[2] != 2:
        raise ValueError(
            f"kv_pages.shape={tuple(kv_pages.shape)} must be "
            "[num_blocks, num_layers, 2, num_kv_heads, page_size, head_dim]")
    if isinstance(kv_pages, QuantizedPages):
        _check_quantized(kv_pages, "kv_pages")
    if layer is not None:
        if isinstance(layer, bool) or not isinstance(layer, (int, np.integer)):  # True was layer 1
            raise ValueError(f"layer={layer!r} must be a Python int (a static layer index)")
        if not 0 <= layer < kv_pages.shape[1]:
            raise ValueError(f"{layer=} is out of range for num_layers={kv_pages.shape[1]}")


def _quantized_hint(kv_pages) -> str:
    """For a bare int8/fp8 array passed as the pool: how to pass a quantized pool instead."""
    if jnp.dtype(kv_pages.dtype) in QUANT_DTYPES:
        return " (a quantized pool is passed as QuantizedPages(data, scales))"
    return ""


def _check_quantized(pages: QuantizedPages, name: str) -> None:
    if jnp.dtype(pages.data.dtype) not in QUANT_DTYPES:
        raise ValueError(f"{name}.data.dtype={pages.data.dtype} must be one of "
                         f"{[str(d) for d in QUANT_DTYPES]}")
    shape = tuple(pages.data.shape)
    allowed = (shape[:-1], shape[:-2] + (1,))
    if tuple(pages.scales.shape) not in allowed:
        raise ValueError(
            f"{name}.scales.shape={tuple(pages.scales.shape)} must be {allowed[0]} (per token "
            f"and KV head) or {allowed[1]} (per page and KV head)")
    if pages.scales.dtype != jnp.float32:
        raise ValueError(f"{name}.scales.dtype={pages.scales.dtype} must be float32")


def _check_array(name: str, x) -> None:
    """``x`` has a shape and a dtype: a list reached ``.shape`` and failed with an AttributeError
    that named neither the argument nor what it should be."""
    if not (hasattr(x, "shape") and hasattr(x, "dtype") and hasattr(x, "ndim")):
        raise ValueError(f"{name} must be an array (jax or numpy), got {type(x).__name__}")


def _check_int32(name: str, x, ndim: int) -> None:
    _check_array(name, x)
    if x.dtype != jnp.int32:
        raise ValueError(f"{name}.dtype={x.dtype} must be int32")
    if x.ndim != ndim:
        raise ValueError(f"{name}.shape={tuple(x.shape)} must have rank {ndim}")


def check_paged_attention_args(
    q, kv_pages, block_tables, seq_lens, cu_q_lens, num_seqs, *, layer, sliding_window,
    soft_cap, sm_scale,
) -> None:
    """Static checks for :func:`pallas_kernels.paged_attention`."""
    check_pool(kv_pages, layer)
    num_kv_heads, head_dim = kv_pages.shape[3], kv_pages.shape[5]
    _check_array("q", q)
    if q.ndim != 3:
        raise ValueError(f"q.shape={tuple(q.shape)} must be [num_tokens, num_q_heads, head_dim]")
    num_q_heads = q.shape[1]
    if q.shape[2] != head_dim:
        raise ValueError(f"q head_dim={q.shape[2]} must equal the pool's {head_dim=}")
    if num_q_heads % num_kv_heads:
        raise ValueError(f"{num_q_heads=} must be a multiple of {num_kv_heads=}")
    if jnp.dtype(q.dtype) not in POOL_DTYPES:
        raise ValueError(f"q.dtype={q.dtype} must be one of {[str(d) for d in POOL_DTYPES]}")
    if (not isinstance(kv_pages, QuantizedPages)
            and jnp.dtype(kv_pages.dtype) != jnp.dtype(q.dtype)):
        raise ValueError(f"kv_pages.dtype={kv_pages.dtype} must equal q.dtype={q.dtype}"
                         f"{_quantized_hint(kv_pages)}")
    _check_int32("block_tables", block_tables, 2)
    _check_int32("seq_lens", seq_lens, 1)
    _check_int32("cu_q_lens", cu_q_lens, 1)
    max_num_seqs = block_tables.shape[0]
    if max_num_seqs == 0:
        raise ValueError(f"block_tables.shape={tuple(block_tables.shape)} has no row: the batch needs at least one "
                         "sequence slot (padding rows have seq_len 0)")  # fmt: skip
    if seq_lens.shape[0] != max_num_seqs:
        raise ValueError(
            f"seq_lens.shape={tuple(seq_lens.shape)} must be ({max_num_seqs},), one per "
            "block_tables row")
    if cu_q_lens.shape[0] != max_num_seqs + 1:
        raise ValueError(
            f"cu_q_lens.shape={tuple(cu_q_lens.shape)} must be ({max_num_seqs + 1},) "
            "(max_num_seqs + 1)")
    if num_seqs is not None and not hasattr(num_seqs, "dtype"):
        raise ValueError(f"num_seqs={num_seqs!r} must be an int32[1] array, e.g. jnp.array([n], jnp.int32)")
    if num_seqs is not None and (num_seqs.dtype != jnp.int32 or num_seqs.shape != (1,)):
        raise ValueError(
            f"num_seqs must be int32[1], got dtype={num_seqs.dtype} shape={tuple(num_seqs.shape)}")
    window = sliding_window
    if window is not None and (isinstance(window, bool) or not isinstance(window, (int, np.integer))
                               or not 1 <= window < 2**31):  # fmt: skip
        raise ValueError(f"sliding_window={sliding_window!r} must be an int in [1, 2**31) or None")
    for name, value in (("soft_cap", soft_cap), ("sm_scale", sm_scale)):
        if value is not None and not 0 < _as_float(value) < math.inf:  # inf gave NaN everywhere (inf * tanh(x / inf))
            raise ValueError(f"{name}={value!r} must be a finite positive float or None")


def check_kv_write_args(kv_pages, k, v, slot_mapping, *, layer) -> None:
    """Static checks for :func:`pallas_kernels.write_kv`."""
    check_pool(kv_pages, layer)
    expected = (kv_pages.shape[3], kv_pages.shape[5])
    for name, x in (("k", k), ("v", v)):
        _check_array(name, x)
        if x.ndim != 3 or tuple(x.shape[1:]) != expected:
            raise ValueError(
                f"{name}.shape={tuple(x.shape)} must be [num_tokens, num_kv_heads={expected[0]}, "
                f"head_dim={expected[1]}]")
        if isinstance(kv_pages, QuantizedPages):
            if jnp.dtype(x.dtype) not in POOL_DTYPES:
                raise ValueError(f"{name}.dtype={x.dtype} must be one of "
                                 f"{[str(d) for d in POOL_DTYPES]} (it is quantized on write)")
        elif jnp.dtype(x.dtype) != jnp.dtype(kv_pages.dtype):
            raise ValueError(f"{name}.dtype={x.dtype} must equal kv_pages.dtype={kv_pages.dtype}"
                             f"{_quantized_hint(kv_pages)}")
    if k.shape != v.shape:
        raise ValueError(f"k.shape={tuple(k.shape)} must equal v.shape={tuple(v.shape)}")
    _check_int32("slot_mapping", slot_mapping, 1)
    if slot_mapping.shape[0] != k.shape[0]:
        raise ValueError(
            f"slot_mapping.shape={tuple(slot_mapping.shape)} must be ({k.shape[0]},), one slot "
            "per token")


def check_block_copy_args(kv_pages, block_ids, blocks=None) -> None:
    """Static checks for :func:`pallas_kernels.gather_blocks` / ``scatter_blocks``."""
    check_pool(kv_pages)
    _check_int32("block_ids", block_ids, 1)
    if blocks is None:
        return
    expected = (block_ids.shape[0],) + tuple(kv_pages.shape[1:])
    _check_array("blocks", blocks)
    if isinstance(kv_pages, QuantizedPages) != isinstance(blocks, QuantizedPages):
        raise ValueError(
            f"blocks is a {type(blocks).__name__} but kv_pages is a {type(kv_pages).__name__}: "
            "a quantized pool takes QuantizedPages blocks (data and scales) and a float pool "
            "plain arrays")
    if isinstance(blocks, QuantizedPages):
        _check_quantized(blocks, "blocks")
        scale_expected = (block_ids.shape[0],) + tuple(kv_pages.scales.shape[1:])
        if tuple(blocks.scales.shape) != scale_expected:
            raise ValueError(
                f"blocks.scales.shape={tuple(blocks.scales.shape)} must be {scale_expected}")
    if tuple(blocks.shape) != expected:
        raise ValueError(f"blocks.shape={tuple(blocks.shape)} must be {expected}")
    if jnp.dtype(blocks.dtype) != jnp.dtype(kv_pages.dtype):
        raise ValueError(f"blocks.dtype={blocks.dtype} must equal kv_pages.dtype={kv_pages.dtype}")


def _as_float(value) -> float:
    """``value`` as a float, NaN for what is not a number (a string, a bool), so that one range
    check refuses it by name rather than a ``<`` between a str and an int."""
    if isinstance(value, (str, bytes, bool)):
        return math.nan
    try:
        return float(value)
    except (TypeError, ValueError):
        return math.nan


def check_paged_attention_metadata(
    block_tables, seq_lens, cu_q_lens, num_seqs, *, num_blocks: int, page_size: int,
    num_tokens: int,
) -> None:
    """Value checks on concrete (host) metadata; raises ``ValueError`` on the first problem."""
    tables = np.asarray(block_tables)
    lens = np.asarray(seq_lens)
    cu = np.asarray(cu_q_lens)
    n = int(np.asarray(num_seqs).reshape(-1)[0]) if num_seqs is not None else len(lens)
    if not 0 <= n <= len(lens):
        raise ValueError(f"num_seqs={n} must be within [0, {len(lens)}]")
    if cu[0] != 0:
        raise ValueError(f"cu_q_lens[0]={cu[0]} must be 0")
    q_lens = np.diff(cu[: n + 1])
    if (q_lens < 0).any():
        s = int(np.argmax(q_lens < 0))
        raise ValueError(f"cu_q_lens must be non-decreasing; cu_q_lens[{s + 1}]={cu[s + 1]} < "
                         f"cu_q_lens[{s}]={cu[s]}")
    if cu[n] > num_tokens:
        raise ValueError(f"cu_q_lens[num_seqs]={cu[n]} exceeds num_tokens={num_tokens}")
    capacity = tables.shape[1] * page_size
    for s in range(n):
        if not q_lens[s] <= lens[s] <= capacity:
            raise ValueError(
                f"seq_lens[{s}]={lens[s]} must be >= its query length {q_lens[s]} and <= the "
                f"table's capacity {capacity} tokens")
        used = tables[s, : -(-int(lens[s]) // page_size)]
        bad = (used < 0) | (used >= num_blocks)
        if bad.any():
            j = int(np.argmax(bad))
            raise ValueError(
                f"block_tables[{s}, {j}]={used[j]} is outside the pool [0, {num_blocks})")


def check_slot_mapping(slot_mapping, *, num_blocks: int, page_size: int) -> None:
    """Slots must lie in the pool and be distinct (negative slots are padding)."""
    too_big, repeated = _outside_or_repeated(slot_mapping, num_blocks * page_size)
    if too_big is not None:
        raise ValueError(
            f"slot {too_big} is outside the pool of {num_blocks * page_size} slots")
    if repeated is not None:
        raise ValueError(f"slot {repeated} is written more than once")


def check_block_ids(block_ids, *, num_blocks: int, distinct: bool = True) -> None:
    """Block ids must lie in the pool (negative ids are padding) and, for a scatter, be
    distinct; a gather may read a block twice (``distinct=False``)."""
    too_big, repeated = _outside_or_repeated(block_ids, num_blocks)
    if too_big is not None:
        raise ValueError(f"block id {too_big} is outside the pool [0, {num_blocks})")
    if distinct and repeated is not None:
        raise ValueError(f"block id {repeated} appears more than once")


def _outside_or_repeated(indices, bound: int) -> tuple[int | None, int | None]:
    """The first non-negative index ``>= bound`` and the smallest repeated one (or None)."""
    values = np.asarray(indices)
    live = values[values >= 0]
    too_big = live >= bound
    uniq, counts = np.unique(live, return_counts=True)
    return (int(live[np.argmax(too_big)]) if too_big.any() else None,
            int(uniq[np.argmax(counts > 1)]) if (counts > 1).any() else None)
