"""Writing this step's new K/V into their pages of one layer of the pool, in place.

Token ``t``'s K and V go to slot ``slot_mapping[t] = block_id * page_size + offset`` of
``layer``; a negative slot is padding and writes nothing. Nothing else in the pool changes.
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
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels.backend import resolve_impl, resolve_interpret
from pallas_kernels.copy_common import on_bits
from pallas_kernels.validation import check_kv_write_args

__all__ = ["write_kv", "write_kv_xla"]


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
    mapping on the host); two tokens on one slot leave either one's values. With no tokens
    the pool comes back as it was, not donated. ``impl`` picks
    the implementation (see :mod:`pallas_kernels.backend`); ``tuning`` passes
    implementation-specific sizes through (``tokens_per_step`` for ``pallas_tpu``).
    """
    check_kv_write_args(kv_pages, k, v, slot_mapping, layer=layer)
    impl = resolve_impl(impl)
    interpret = resolve_interpret(impl, interpret)
    if k.shape[0] == 0:
        return kv_pages
    if impl == "xla":
        return write_kv_xla(kv_pages, k, v, slot_mapping, layer=int(layer), **tuning)
    from pallas_kernels import kv_write_pallas

    fn = kv_write_pallas.write_kv_gpu if impl == "pallas_gpu" else kv_write_pallas.write_kv_tpu
    return fn(kv_pages, k, v, slot_mapping, layer=int(layer), interpret=interpret, **tuning)


@functools.partial(jax.jit, static_argnames=("layer",), donate_argnums=(0,))
@on_bits(0, 1, 2)
def write_kv_xla(kv_pages, k, v, slot_mapping, *, layer: int):
    """One XLA scatter of ``[num_tokens, 2, num_kv_heads, head_dim]`` rows into the pool."""
    num_blocks, page_size = kv_pages.shape[0], kv_pages.shape[4]
    # A negative index would wrap around, so padding slots are sent past the pool and
    # mode="drop" skips them.
    block = jnp.where(slot_mapping >= 0, slot_mapping // page_size, num_blocks)
    offset = slot_mapping % page_size
    kv = jnp.stack([k, v], axis=1)  # [num_tokens, 2, num_kv_heads, head_dim]
    # The advanced indices (block, layer, offset) are split by slices, so numpy rules put
    # the token axis first: the update is exactly kv's [num_tokens, 2, num_kv_heads, head_dim].
    return kv_pages.at[block, layer, :, :, offset].set(kv, mode="drop")
