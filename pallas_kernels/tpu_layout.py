"""TPU layout rules of the Mosaic paged-attention kernel: what its VMEM tiling accepts
(:func:`check_tpu_layout`), and the block sizes and VMEM budget it derives from them.

A VMEM tile is ``[sublanes, 128 lanes]``: 8 rows of 32-bit values, 16 of 16-bit and 32 of
8-bit (narrower types pack several rows per sublane). A page of one KV head must be whole
tiles, so ``page_size`` is a multiple of the pages' sublane tile (8 / 16 / 32 for
f32 / bf16 / int8 and fp8) and ``head_dim`` a multiple of 128.
"""

from __future__ import annotations

import math

import jax.numpy as jnp

from pallas_kernels.kv_format import FORMATS

__all__ = ["LANES", "TARGET_ROWS", "TARGET_COLS", "check_tpu_layout", "sublane_tile",
           "default_block_q", "vmem_limit"]

LANES = 128
# Target query rows (block_q * group) per matmul: big enough to feed the MXU in prefill, small
# enough that decode blocks, which compute every row against each sequence, waste little.
TARGET_ROWS = 64
# Target KV columns per step (pages_per_block * page_size).
TARGET_COLS = 128
# Mosaic's default scoped VMEM limit on the smallest current chips.
DEFAULT_VMEM_LIMIT = 16 * 1024 * 1024


def check_tpu_layout(dtype, *, page_size: int, head_dim: int, group: int,
                     block_q: int | None = None, pages_per_block: int | None = None,
                     pages_dtype=None, scales_dim: int | None = None) -> None:
    """Raises ``ValueError`` for shapes or dtypes the TPU kernel's VMEM tiling cannot take.

    ``dtype`` is q's; ``pages_dtype`` the pool's (default: q's), and for a quantized pool
    ``scales_dim`` is the last dim of its scales (``page_size`` or 1).
    """
    dtype = jnp.dtype(dtype)
    if dtype not in (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16)):
        raise ValueError(
            f"dtype={dtype} is not supported by the TPU kernel: expected float32 or bfloat16 "
            "(Mosaic lacks float16 on most TPU generations); use impl='xla' for float16")
    pages_dtype = dtype if pages_dtype is None else jnp.dtype(pages_dtype)
    if scales_dim is not None:
        _check_quantized_layout(pages_dtype, page_size=page_size, scales_dim=scales_dim)
    elif pages_dtype != dtype:
        raise ValueError(f"pages dtype={pages_dtype} must equal q dtype={dtype} (a quantized "
                         "pool is passed as QuantizedPages(data, scales))")
    tile = sublane_tile(pages_dtype)
    if page_size % tile:
        raise ValueError(
            f"{page_size=} must be a multiple of {tile} for {pages_dtype} pages on TPU (one "
            f"page of a head is whole [{tile}, 128] VMEM tiles of sublanes x lanes)")
    if head_dim % LANES:
        raise ValueError(f"{head_dim=} must be a multiple of {LANES} (TPU lanes) on TPU")
    q_tile = sublane_tile(dtype)
    if block_q is not None and (block_q < 1 or (block_q * group) % q_tile):
        raise ValueError(
            f"{block_q=} must be positive with block_q * group ({group=}) a multiple of "
            f"{q_tile} for {dtype}")
    if pages_per_block is not None and pages_per_block < 1:
        raise ValueError(f"{pages_per_block=} must be a positive number of pages")


def _check_quantized_layout(pages_dtype, *, page_size: int, scales_dim: int) -> None:
    if pages_dtype not in [spec.dtype for spec in FORMATS.values()]:
        raise ValueError(
            f"quantized pages of dtype={pages_dtype} are not supported by the TPU kernel: "
            f"expected one of {[str(spec.dtype) for spec in FORMATS.values()]}")
    if scales_dim not in (page_size, 1):
        raise ValueError(
            f"scales last dim={scales_dim} must be {page_size=} (per token) or 1 (per page)")


def sublane_tile(dtype) -> int:
    """Rows of one VMEM tile: 8 for 32-bit types, 16 for 16-bit (two rows packed per sublane)."""
    return 8 * (4 // jnp.dtype(dtype).itemsize)


def default_block_q(num_tokens: int, group: int, tile: int) -> int:
    align = tile // math.gcd(tile, group)  # smallest token count filling whole tiles
    block_q = -(-max(align, TARGET_ROWS // group) // align) * align
    return min(block_q, -(-num_tokens // align) * align)


def vmem_limit(dtype, bufs, num_kv_heads, rows, head_dim) -> int | None:
    """A scoped VMEM limit when the default would be too small, else None (keep the default)."""
    itemsize = jnp.dtype(dtype).itemsize
    cols = bufs[0].shape[1] * bufs[0].shape[4]
    need = (sum(_padded_bytes(buf.shape, buf.dtype) for buf in bufs)  # page (and scale) slots
            + 4 * num_kv_heads * rows * head_dim * itemsize  # q and out blocks, double-buffered
            + num_kv_heads * rows * (2 * LANES + head_dim) * 4  # m, l, acc
            + 4 * rows * cols * 4  # logits-sized temporaries
            + 2 * cols * head_dim * 4 * (len(bufs) - 1))  # dequantized K and V tiles
    return None if need * 5 // 4 <= DEFAULT_VMEM_LIMIT else need * 3 // 2


def _padded_bytes(shape, dtype) -> int:
    """VMEM bytes of an array whose last two dims are padded to whole (tile, 128) tiles."""
    tile = sublane_tile(dtype)
    rows, lanes = -(-shape[-2] // tile) * tile, -(-shape[-1] // LANES) * LANES
    return math.prod(shape[:-2]) * rows * lanes * jnp.dtype(dtype).itemsize
