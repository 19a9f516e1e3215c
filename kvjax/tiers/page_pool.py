"""The device page pool (one preallocated KV array, updated in place) and the int32 batch
metadata that addresses it, in bucketed shapes.

Layout::

    kv_pages  # [num_blocks, num_layers, 2, num_kv_heads, page_size, head_dim]; [:, :, 0] = K

Why page-major. Attention wants one layer's pages; offload and fetch want one block of every
layer. Page-major serves both: ``kv_pages[b]`` (block ``b`` of all layers, K and V) is one
contiguous region, so moving n blocks is n copies (one DMA each in the TPU kernel) where a
layer-major pool needs ``n * num_layers``; and ``kv_pages[b, layer, 0 | 1, head]`` is still a
contiguous ``[page_size, head_dim]`` tile for attention. Measured on CPU
(``benchmarks/bench_pool_layout.py --repeats 30``: 16 layers, 8 KV heads, page 16, head_dim
128, bf16, 1 MiB blocks; 2 cores shared with other jobs, so min of 30 interleaved runs):

* per-block offload, one host array per block as the host tier keeps them: 1 / 8 / 32 blocks
  took 0.85 / 7.8 / 50 ms page-major against 7.4 / 60 / 409 ms layer-major (one array per
  block and layer), 8-9x, from issuing ``num_layers`` times fewer copies;
* one layer's paged attention over a decode batch (8 x 256 tokens) and one layer's
  ``write_kv`` cost the same either way (43 vs 48 ms, 0.06 vs 0.06 ms; medians 57 vs 58 ms):
  XLA fuses the layer slice into the page gather, nothing copies the layer first;
* batched offload (one gather, one ``device_put``): page-major won at 1 and 8 blocks (1.2 vs
  3.6 ms, 4.0 vs 8.5 ms) and lost at 32 (138 ms, 55 ms in gathers of 8, vs 30 ms for 16
  per-layer gathers): XLA's CPU backend fills one fresh 32 MiB output more slowly than several
  small ones, whatever the layout (a layer-major ``[L, num_blocks, ...]`` stack: 113 ms).

Not yet measured on an accelerator (none here); there blocks move by DMA or copy kernels,
whose count the layout divides by ``num_layers``, and vLLM reported a 4-5x offload speed-up
on GPU from making each block one contiguous region.

:class:`PagePool` creates the pool once (zero-filled, optionally sharded) and owns the
current array: every update donates the old buffer to the kernel and keeps the result, so
the serving loop never holds a stale reference (a stale one raises "Array has been
deleted" rather than reading old data). :func:`build_batch` turns the host's ragged block
tables and lengths into fixed-shape int32 arrays so a jitted step compiles once per bucket.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

import pallas_kernels
from kvjax.config.from_mapping import config_from_dict
from pallas_kernels.kv_format import KVFormat, QuantizedPages, empty_pool, parse_quant
from pallas_kernels.validation import check_block_ids, check_slot_mapping

__all__ = ["PoolConfig", "PagePool", "Buckets", "BatchMetadata", "build_batch", "bucket"]


@dataclasses.dataclass(frozen=True, slots=True)
class PoolConfig:
    """Shape of the page pool. ``dtype`` is a name jnp understands (e.g. ``"bfloat16"``): the
    model's K/V dtype, and the pool's unless ``kv_quant`` stores pages quantized.

    ``kv_quant``: ``None`` (the default: pages in ``dtype``), ``"int8"``, ``"fp8_e4m3"`` or
    ``"fp8_e5m2"``; ``kv_scale``: ``"token"`` or ``"page"`` scales (see
    :mod:`pallas_kernels.kv_format` for the trade-off).
    """

    num_blocks: int
    num_layers: int
    num_kv_heads: int
    page_size: int  # tokens per block
    head_dim: int
    dtype: str = "bfloat16"
    kv_quant: str | None = None
    kv_scale: str = "token"

    def __post_init__(self):
        for name in ("num_blocks", "num_layers", "num_kv_heads", "page_size", "head_dim"):
            value = getattr(self, name)
            if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name}={value!r} must be a positive int")
        try:
            name = jnp.dtype(self.dtype).name
        except TypeError as e:
            raise ValueError(f"dtype={self.dtype!r} is not a dtype jax.numpy knows") from e
        object.__setattr__(self, "dtype", name)  # canonical, so equal configs compare equal
        object.__setattr__(self, "kv_quant", parse_quant(self.kv_quant, "kv_quant", self.kv_scale))

    @classmethod
    def from_dict(cls, values: Mapping) -> "PoolConfig":
        """Builds a config from a mapping (e.g. a TOML section); unknown keys are an error."""
        return config_from_dict(cls, values, "pool config")

    @property
    def block_shape(self) -> tuple[int, ...]:
        """``(num_layers, 2, num_kv_heads, page_size, head_dim)``: one block, every layer."""
        return (self.num_layers, 2, self.num_kv_heads, self.page_size, self.head_dim)

    @property
    def shape(self) -> tuple[int, ...]:
        return (self.num_blocks,) + self.block_shape

    @property
    def kv_format(self) -> KVFormat:
        return KVFormat(self.kv_quant, self.kv_scale)

    @property
    def storage_dtype(self) -> str:
        """The dtype pages are stored in (``dtype``, or the quantized format's)."""
        fmt = self.kv_format
        return fmt.storage_dtype.name if fmt.quantized else self.dtype

    @property
    def bytes_per_block(self) -> int:
        """Bytes of one block: K and V of ``page_size`` tokens in every layer, scales included."""
        fmt = self.kv_format
        data = math.prod(self.block_shape) * jnp.dtype(self.storage_dtype).itemsize
        if not fmt.quantized:
            return data
        return data + 4 * math.prod(fmt.scales_shape(self.block_shape))

    @property
    def pool_bytes(self) -> int:
        return self.num_blocks * self.bytes_per_block


class PagePool:
    """Owns the pool array; updates it in place through :mod:`pallas_kernels`.

    ``impl`` / ``interpret`` pick the kernels (see :mod:`pallas_kernels.backend`). Inputs
    given as host arrays or lists are value-checked (slots and block ids inside the pool,
    distinct) before anything runs; device arrays are trusted, since checking them would
    wait for the device. ``allocate=False``: no array at all (``kv_pages`` is None; a trace
    replay counts blocks and moves no bytes).
    """

    def __init__(self, config: PoolConfig, *, sharding: jax.sharding.Sharding | None = None,
                 impl: str | None = None, interpret: bool | None = None, allocate: bool = True):
        self.config = config
        if impl is not None:  # named now, not at the first write of a serving loop
            pallas_kernels.resolve_impl(impl)
        self._kernel_options = dict(impl=impl, interpret=interpret)
        zeros = lambda: empty_pool(config.shape, config.kv_format, config.dtype)
        # Committed to a device even without a sharding, as every later pool (a step's or a
        # scatter's output) is: jit keys on commitment, so an uncommitted first pool would make
        # each executable compile twice, the second time while serving.
        sharding = sharding or jax.sharding.SingleDeviceSharding(jax.devices()[0])
        self._kv_pages = jax.jit(zeros, out_shardings=sharding)() if allocate else None

    @property
    def kv_pages(self) -> "jax.Array | QuantizedPages":
        """The current pool: an array, or :class:`QuantizedPages` (data and scales) for a
        quantized format. Pass it to a step that donates it, then set the result."""
        return self._kv_pages

    @kv_pages.setter
    def kv_pages(self, new_pages) -> None:
        problem = self._mismatch(new_pages)
        if problem:
            raise ValueError(f"new kv_pages {problem}")
        self._kv_pages = new_pages

    def _mismatch(self, pages) -> str | None:
        fmt = self.config.kv_format
        if fmt.quantized != isinstance(pages, QuantizedPages):
            return (f"is a {type(pages).__name__} but the pool's format is {fmt.name()}")
        if (tuple(pages.shape), jnp.dtype(pages.dtype).name) != (
                self.config.shape, self.config.storage_dtype):
            return (f"{tuple(pages.shape)} {pages.dtype} must match the pool's "
                    f"{self.config.shape} {self.config.storage_dtype}")
        if fmt.quantized and tuple(pages.scales.shape) != fmt.scales_shape(self.config.shape):
            return (f"scales {tuple(pages.scales.shape)} must be "
                    f"{fmt.scales_shape(self.config.shape)}")
        if fmt.quantized and jnp.dtype(pages.scales.dtype) != jnp.float32:
            return f"scales dtype {pages.scales.dtype} must be float32"
        return None

    def check_invariants(self) -> None:
        """The pool holds live arrays of the configured shape, dtype and format."""
        if self._kv_pages is None:
            return
        if any(leaf.is_deleted() for leaf in jax.tree.leaves(self._kv_pages)):
            raise RuntimeError(
                "the pool's array was donated to a step whose result was never handed back; "
                "set pool.kv_pages = <the step's returned pool>")
        problem = self._mismatch(self._kv_pages)
        if problem:
            raise RuntimeError(f"pool array {problem} ({self.config})")

    def write(self, k, v, slot_mapping, *, layer: int) -> None:
        """Stores this step's K/V (``[num_tokens, num_kv_heads, head_dim]``) at their slots."""
        if _on_host(slot_mapping):
            slot_mapping = np.asarray(slot_mapping, np.int32)
            check_slot_mapping(slot_mapping, num_blocks=self.config.num_blocks,
                               page_size=self.config.page_size)
        self._kv_pages = pallas_kernels.write_kv(
            self._kv_pages, k, v, jnp.asarray(slot_mapping), layer=layer, **self._kernel_options)

    def gather(self, block_ids) -> "jax.Array | QuantizedPages":
        """Copies of the blocks, ``[n, *block_shape]`` (with their scales for a quantized
        pool); negative ids give zero rows."""
        ids = self._checked_ids(block_ids, distinct=False)
        return pallas_kernels.gather_blocks(self._kv_pages, ids, **self._kernel_options)

    def scatter(self, block_ids, blocks) -> None:
        """Stores ``blocks[i]`` into block ``block_ids[i]``; negative ids are skipped."""
        ids = self._checked_ids(block_ids, distinct=True)
        blocks = blocks if isinstance(blocks, QuantizedPages) else jnp.asarray(blocks)
        self._kv_pages = pallas_kernels.scatter_blocks(
            self._kv_pages, ids, blocks, **self._kernel_options)

    def build_batch(self, block_tables, seq_lens, q_lens, *,
                    buckets: "Buckets | None" = None) -> "BatchMetadata":
        """:func:`build_batch` with this pool's ``page_size`` and ``num_blocks``."""
        return build_batch(block_tables, seq_lens, q_lens, page_size=self.config.page_size,
                           num_blocks=self.config.num_blocks, buckets=buckets)

    def _checked_ids(self, block_ids, *, distinct: bool) -> jax.Array:
        if _on_host(block_ids):
            block_ids = np.asarray(block_ids, np.int32).reshape(-1)
            check_block_ids(block_ids, num_blocks=self.config.num_blocks, distinct=distinct)
        return jnp.asarray(block_ids)


@dataclasses.dataclass(frozen=True, slots=True)
class Buckets:
    """Minimum padded sizes; above them each size rounds up to the next power of two.

    Powers of two bound the number of distinct shapes (and so compiles) by a logarithm of
    the largest batch, at the cost of at most 2x padding, which the kernels skip cheaply.
    """

    min_num_seqs: int = 8
    min_pages_per_seq: int = 4
    min_num_tokens: int = 16

    def __post_init__(self):
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{field.name}={value!r} must be a positive int")


class BatchMetadata(NamedTuple):
    """One ragged step's int32 metadata, in bucketed shapes (a pytree: pass it to a jit).

    Padding is harmless: table entries past a sequence's pages are block 0 (kernels never read
    past ``seq_lens``), padding sequences have length 0, padding tokens have slot -1 (write
    skips them) and position 0, and ``cu_q_lens`` stays flat past ``num_seqs``.
    """

    block_tables: np.ndarray  # i32[max_num_seqs, pages_per_seq]
    seq_lens: np.ndarray  # i32[max_num_seqs], KV length including this step's tokens
    cu_q_lens: np.ndarray  # i32[max_num_seqs + 1]
    num_seqs: np.ndarray  # i32[1]
    slot_mapping: np.ndarray  # i32[num_tokens], -1 for padding
    positions: np.ndarray  # i32[num_tokens], position of each token in its sequence


def bucket(n: int, minimum: int) -> int:
    """``n`` rounded up to a power of two, and to at least ``minimum``."""
    return max(minimum, 1 << max(0, n - 1).bit_length())


def build_batch(
    block_tables: Sequence[Sequence[int]],
    seq_lens: Sequence[int],
    q_lens: Sequence[int],
    *,
    page_size: int,
    num_blocks: int | None = None,
    buckets: Buckets | None = None,
) -> BatchMetadata:
    """Pads the host's ragged batch into :class:`BatchMetadata`.

    Sequence ``s`` has KV length ``seq_lens[s]`` (tokens, including this step's) and
    ``q_lens[s]`` new tokens, at positions ``seq_lens[s] - q_lens[s] ... seq_lens[s] - 1``;
    its pages are ``block_tables[s]`` (block ids; entries past ``ceil(seq_len / page_size)``
    are ignored). Tokens are laid out sequence after sequence.
    """
    buckets = buckets or Buckets()
    lens, q = _check_batch(block_tables, seq_lens, q_lens, page_size=page_size,
                           num_blocks=num_blocks)
    num_seqs = len(lens)
    pages_needed = -(-lens // page_size)
    max_seqs = bucket(num_seqs, buckets.min_num_seqs)
    pages_per_seq = bucket(int(pages_needed.max(initial=0)), buckets.min_pages_per_seq)
    num_tokens = bucket(int(q.sum()), buckets.min_num_tokens)

    tables = np.zeros((max_seqs, pages_per_seq), np.int32)
    for s, (table, used) in enumerate(zip(block_tables, pages_needed)):
        tables[s, :used] = np.asarray(table[:used], np.int32)
    padded_lens = np.zeros(max_seqs, np.int32)
    padded_lens[:num_seqs] = lens
    cu = np.zeros(max_seqs + 1, np.int32)
    cu[1:num_seqs + 1] = np.cumsum(q)
    cu[num_seqs + 1:] = cu[num_seqs]

    live = int(cu[num_seqs])
    seq_of = np.repeat(np.arange(num_seqs), q)  # [live tokens]
    pos = lens[seq_of] - q[seq_of] + (np.arange(live) - cu[seq_of])
    slots = np.full(num_tokens, -1, np.int32)
    slots[:live] = tables[seq_of, pos // page_size] * page_size + pos % page_size
    positions = np.zeros(num_tokens, np.int32)
    positions[:live] = pos
    return BatchMetadata(tables, padded_lens, cu, np.array([num_seqs], np.int32), slots,
                         positions)


def _check_batch(block_tables, seq_lens, q_lens, *, page_size, num_blocks):
    """Value checks; returns ``(seq_lens, q_lens)`` as int64 arrays."""
    if not len(block_tables) == len(seq_lens) == len(q_lens):
        raise ValueError(
            f"len(block_tables)={len(block_tables)}, len(seq_lens)={len(seq_lens)} and "
            f"len(q_lens)={len(q_lens)} must be equal (one entry per sequence)")
    lens, q = np.asarray(seq_lens, np.int64), np.asarray(q_lens, np.int64)
    for s, (table, kv_len, q_len) in enumerate(zip(block_tables, lens, q)):
        if not 0 <= q_len <= kv_len:
            raise ValueError(f"q_lens[{s}]={q_len} must be within [0, seq_lens[{s}]={kv_len}]")
        used = np.asarray(table[: -(-int(kv_len) // page_size)], np.int64)
        if len(used) * page_size < kv_len:
            raise ValueError(
                f"block_tables[{s}] has {len(table)} blocks, too few for seq_lens[{s}]={kv_len} "
                f"tokens at page_size={page_size}")
        bad = (used < 0) | (used >= (num_blocks if num_blocks is not None else np.inf))
        if bad.any():
            j = int(np.argmax(bad))
            raise ValueError(f"block_tables[{s}][{j}]={used[j]} is not a block of the pool "
                             f"[0, {num_blocks if num_blocks is not None else 'inf'})")
    return lens, q


def _on_host(x) -> bool:
    return isinstance(x, (list, tuple, np.ndarray))
