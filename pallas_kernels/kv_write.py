"""Writing this step's new K/V into their pages of one layer of the pool, in place.

Token ``t``'s K and V go to slot ``slot_mapping[t] = block_id * page_size + offset`` of
``layer``; a negative slot is padding and writes nothing. Nothing else in the pool changes
(except, in a pool with per-page scales, the other slots of a touched page, requantized when
its scale grows: see :mod:`pallas_kernels.kv_format`).
The pool buffer is donated and updated in place (every implementation aliases it to the
output), so a serving loop never allocates a second pool: use the returned array and drop
the one passed in, whose buffer now belongs to the result.

>>> import jax.numpy as jnp
>>> from pallas_kernels import write_kv
>>> kv_pages = jnp.zeros((4, 2, 2, 1, 8, 16), jnp.float32)  # 4 blocks of 8 tokens, 2 layers
>>> k = v = jnp.ones((3, 1, 16), jnp.float32)
>>> slots = jnp.array([8, 9, -1], jnp.int32)  # block 1, offsets 0 and 1; third token is padding
>>> kv_pages = write_kv(kv_pages, k, v, slots, layer=1)
>>> float(kv_pages[1, 1, :, :, :2].sum()), float(kv_pages.sum())
(64.0, 64.0)

A quantized pool (:class:`~pallas_kernels.kv_format.QuantizedPages`) takes float K/V and
quantizes them on the way in, scales included. With per-token scales the new rows are
quantized in jnp (fused by XLA into their producer), the chosen implementation's write
kernel moves the quantized rows and an XLA scatter their scales; per-page scales need a
read-modify-write of each touched page (see :mod:`pallas_kernels.kv_format`), done by XLA on
every backend (:mod:`pallas_kernels.kv_write_pallas`).
"""

from __future__ import annotations

from pallas_kernels.dispatch import select
from pallas_kernels.kv_format import is_quantized
from pallas_kernels.validation import check_kv_write_args

__all__ = ["write_kv"]


def write_kv(
    kv_pages,  # [num_blocks, num_layers, 2, num_kv_heads, page_size, head_dim]
    k,  # [num_tokens, num_kv_heads, head_dim]
    v,  # [num_tokens, num_kv_heads, head_dim]
    slot_mapping,  # i32[num_tokens]; block_id * page_size + offset, negative = padding
    *,
    layer: int,
    impl: str | None = None,
    interpret: bool | None = None,
    **tuning,
):
    """Returns the pool with each token's K/V stored at its slot of ``layer``; donates the pool.

    Slots must be distinct and inside the pool (``check_slot_mapping`` checks a concrete
    mapping on the host); two tokens on one slot leave either one's values, and in a pool with
    per-token scales (rows and scales are two scatters) possibly one's rows under the other's
    scale on a GPU, where each scatter picks its own winner. With no tokens
    the pool comes back as it was, not donated. ``impl`` picks
    the implementation (see :mod:`pallas_kernels.dispatch`); ``tuning`` passes
    implementation-specific sizes through (``tokens_per_step`` for ``pallas_tpu``).
    """
    check_kv_write_args(kv_pages, k, v, slot_mapping, layer=layer)
    write = select("write_kv_quantized" if is_quantized(kv_pages) else "write_kv", impl, interpret, tuning)
    if k.shape[0] == 0:
        return kv_pages
    return write(kv_pages, k, v, slot_mapping, layer=int(layer), **tuning)
