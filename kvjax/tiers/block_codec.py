"""Block codecs: how one pool block is stored below the device (host tier, disk tier, swap).

The tiers keep every block as one array of a fixed shape and dtype, and copy it bit for bit.
A codec sits at the device <-> host boundary: ``encode`` runs on the device right after the
pool gather (before the copy down), ``decode`` on the device right after a fetch (before the
pool scatter). So the tiers stay format-agnostic and their byte accounting is the codec's
``block_nbytes``: a smaller stored block means more blocks in the same host and disk bytes.

Codecs (``make_codec`` picks one from the pool and the offload option):

* ``raw`` (:class:`IdentityCodec`): a float pool's block as it is,
  ``[num_layers, 2, num_kv_heads, page_size, head_dim]`` in the pool's dtype. No work at all:
  the path of an unquantized pool is unchanged.
* ``packed:<format>`` (:class:`PackedCodec`): a quantized pool's block
  (:class:`~pallas_kernels.kv_format.QuantizedPages`) as one uint8 row: the data's bytes, then
  the float32 scales' bytes. Bit-exact both ways (no re-quantization).
* ``lossy:<format>`` (:class:`LossyCodec`): a float pool's block quantized when it leaves the
  device (same row layout), dequantized into the pool's dtype when it comes back. Off by
  default; every copy it makes is lossy, which the prefix trie records (``Node.lossy``).

Row layout of the two quantized codecs, per block::

    row  # u8[data_nbytes + scale_nbytes]
    row[:data_nbytes]   data    [num_layers, 2, num_kv_heads, page_size, head_dim], 1 byte each
    row[data_nbytes:]   scales  [num_layers, 2, num_kv_heads, page_size or 1] float32, native order

Everything is packed as unsigned bytes before it is concatenated: XLA's CPU backend rewrites
float8_e5m2 NaN payloads in concatenates, integers never. The codec's ``name`` goes into each
disk segment's manifest, so a directory written with one codec is never read with another.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from kvjax.tiers.page_pool import PoolConfig
from pallas_kernels.kv_format import (
    KVFormat,
    QuantizedPages,
    dequantize,
    parse_quant,
    quantize,
)

__all__ = ["BlockCodec", "IdentityCodec", "LossyCodec", "PackedCodec", "exact_codec", "make_codec"]

RAW = "raw"  # the identity codec's name; also what a manifest without a codec field means


@dataclasses.dataclass(frozen=True)
class BlockCodec:
    """How a pool block is stored below the device; see the module docstring.

    ``block_shape`` / ``dtype``: one stored block (what the host and disk tiers hold);
    ``block_nbytes``: its bytes; ``lossy``: whether decode(encode(x)) may differ from x.
    """

    name: str
    block_shape: tuple[int, ...]
    dtype: np.dtype
    lossy: bool

    @property
    def block_nbytes(self) -> int:
        return math.prod(self.block_shape) * self.dtype.itemsize

    @property
    def identity(self) -> str:
        """What two caches' stored blocks must agree on for one to read the other's bytes:
        the codec's name, the stored dtype and shape (``raw/float32/2x2x1x16x8``). The name
        alone is not enough: a float pool's ``raw`` says neither dtype nor layout, and a
        bfloat16 pool with twice the heads of a float32 one has blocks of the same bytes."""
        return f"{self.name}/{self.dtype.name}/{'x'.join(map(str, self.block_shape))}"

    @property
    def stores_as_is(self) -> bool:
        """Whether a stored block is the pool's block itself (same shape, dtype and bits)."""
        return False

    def encode(self, blocks):
        """Pool blocks ``[n, *pool block]`` (an array or QuantizedPages, on device) -> stored
        blocks ``[n, *block_shape]`` of ``dtype`` (device array)."""
        raise NotImplementedError

    def decode(self, stored):
        """Stored blocks ``[n, *block_shape]`` -> pool blocks for ``PagePool.scatter``."""
        raise NotImplementedError

    def check_stored_by(self, tier, name: str) -> None:
        """ValueError unless ``tier`` (host or disk tier, or a double) stores this codec's blocks."""
        stored = (tuple(tier.block_shape), np.dtype(tier.dtype), getattr(tier, "codec", self.name))
        expected = (self.block_shape, self.dtype, self.name)
        if stored != expected:
            raise ValueError(f"{name} stores blocks {stored}; this cache's codec stores {expected}")

    def gather(self, gather_blocks: Callable) -> Callable:
        """``(kv_pages, block_ids) -> stored blocks``: ``gather_blocks`` then ``encode``, for
        the transfer engine's offload (the gather and the encode are issued at once)."""
        return lambda kv_pages, block_ids: self.encode(gather_blocks(kv_pages, block_ids))


@dataclasses.dataclass(frozen=True)
class IdentityCodec(BlockCodec):
    """A float pool's blocks stored as they are."""

    @property
    def stores_as_is(self) -> bool:
        return True

    def encode(self, blocks):
        return blocks

    def decode(self, stored):
        return stored

    def gather(self, gather_blocks: Callable) -> Callable:
        return gather_blocks


@dataclasses.dataclass(frozen=True)
class PackedCodec(BlockCodec):
    """A quantized pool's blocks, data and scales, as one uint8 row each; bit-exact."""

    pool_block_shape: tuple[int, ...] = ()
    kv_format: KVFormat = KVFormat()

    def encode(self, blocks: QuantizedPages) -> jax.Array:
        return _pack(blocks.data, blocks.scales)

    def decode(self, stored) -> QuantizedPages:
        return _unpack(jnp.asarray(stored), block_shape=self.pool_block_shape, fmt=self.kv_format)


@dataclasses.dataclass(frozen=True)
class LossyCodec(PackedCodec):
    """A float pool's blocks quantized on the way down, dequantized on the way up."""

    pool_dtype: str = "float32"

    def encode(self, blocks) -> jax.Array:
        return _quantize_pack(jnp.asarray(blocks), fmt=self.kv_format)

    def decode(self, stored) -> jax.Array:
        return _unpack_dequantize(jnp.asarray(stored), block_shape=self.pool_block_shape,
                                  fmt=self.kv_format, dtype=self.pool_dtype)  # fmt: skip


def make_codec(pool: PoolConfig, offload_quant: str | None = None, offload_scale: str = "token") -> BlockCodec:
    """The codec of ``pool``'s blocks below the device.

    ``offload_quant`` (``None``, ``"int8"``, ``"fp8_e4m3"``, ``"fp8_e5m2"``) turns on lossy
    compression on offload for a float pool, with ``offload_scale`` ("token" or "page")
    scales. ValueError naming the value for an unknown format or granularity, or for
    ``offload_quant`` on a pool that is quantized already (its blocks travel as they are).
    """
    offload_quant = parse_quant(offload_quant, "offload_quant", offload_scale, "offload_scale")
    fmt = pool.kv_format
    if offload_quant is not None and fmt.quantized:
        raise ValueError(f"offload_quant={offload_quant!r} needs a float pool; this pool is quantized "
                         f"already (kv_quant={pool.kv_quant!r}) and its blocks are stored as they are")  # fmt: skip
    # A stored row is flat bytes: the name carries the block layout, or a pool of another shape
    # with the same row size (2 layers x 2 heads vs 1 x 4) would read it as its own KV.
    layout = "x".join(str(d) for d in pool.block_shape)
    if fmt.quantized:
        return PackedCodec(f"packed:{fmt.name()}:{layout}", (_row_nbytes(pool.block_shape, fmt),),
                           np.dtype(np.uint8), False, pool.block_shape, fmt)  # fmt: skip
    if offload_quant is not None:
        offload = KVFormat(offload_quant, offload_scale)
        return LossyCodec(f"lossy:{offload.name()}:{layout}", (_row_nbytes(pool.block_shape, offload),),
                          np.dtype(np.uint8), True, pool.block_shape, offload, pool.dtype)  # fmt: skip
    return IdentityCodec(RAW, pool.block_shape, np.dtype(jnp.dtype(pool.dtype)), False)


def exact_codec(pool: PoolConfig) -> BlockCodec:
    """The lossless codec of ``pool`` (what the swap store uses: a resumed sequence
    continues with exactly the KV it had)."""
    return make_codec(pool)


# --- helpers -------------------------------------------------------------------------------


def _row_nbytes(block_shape: tuple[int, ...], fmt: KVFormat) -> int:
    return math.prod(block_shape) * fmt.storage_dtype.itemsize + 4 * math.prod(fmt.scales_shape(block_shape))


def _as_bytes(x: jax.Array) -> jax.Array:
    """``x`` ``[n, ...]`` as ``u8[n, nbytes per row]`` (a bitcast, then a free reshape)."""
    return jax.lax.bitcast_convert_type(x, jnp.uint8).reshape(x.shape[0], -1)


@jax.jit
def _pack(data: jax.Array, scales: jax.Array) -> jax.Array:
    return jnp.concatenate([_as_bytes(data), _as_bytes(scales)], axis=1)


@functools.partial(jax.jit, static_argnames=("block_shape", "fmt"))
def _unpack(rows: jax.Array, *, block_shape: tuple[int, ...], fmt: KVFormat) -> QuantizedPages:
    num = rows.shape[0]
    split = math.prod(block_shape) * fmt.storage_dtype.itemsize
    data = jax.lax.bitcast_convert_type(rows[:, :split].reshape(num, *block_shape), fmt.storage_dtype)
    scale_bytes = rows[:, split:].reshape(num, *fmt.scales_shape(block_shape), 4)
    return QuantizedPages(data, jax.lax.bitcast_convert_type(scale_bytes, jnp.float32))


@functools.partial(jax.jit, static_argnames=("fmt",))
def _quantize_pack(blocks: jax.Array, *, fmt: KVFormat) -> jax.Array:
    data, scales = quantize(blocks, fmt)
    return _pack(data, scales)


@functools.partial(jax.jit, static_argnames=("block_shape", "fmt", "dtype"))
def _unpack_dequantize(rows: jax.Array, *, block_shape: tuple[int, ...], fmt: KVFormat, dtype: str) -> jax.Array:
    pages = _unpack(rows, block_shape=block_shape, fmt=fmt)
    return dequantize(pages.data, pages.scales).astype(dtype)
