"""Host tier: KV blocks offloaded from the device page pool into host memory.

A block is one page of every layer, K and V: an array of `block_shape` (for the page-major pool,
`[num_layers, 2, num_kv_heads, page_size, head_dim]`). The tier keeps each block as its own JAX
array in a host memory kind (`pinned_host` where the backend has it), keyed by the block's
chained key. One array per block (rather than one array per put batch) keeps eviction and byte
accounting exact per block, and a fetch of any subset of keys needs no gather over host memory,
which not every backend can compute on.

Copies are asynchronous: `put` returns once `jax.device_put` has been issued; `get` returns a
device array whose copy may still be running (JAX orders later uses after it).

Invariants (`check_invariants`): `bytes_used == num_blocks * block_nbytes <= capacity_bytes`;
a locked block is never evicted; a discarded block that is still locked stays readable by the
holders of its lock and is dropped at its last unlock.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import threading
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["EVICTION_POLICIES", "HOST_MEMORY_KINDS", "HostTier", "HostTierStats"]

HOST_MEMORY_KINDS = ("pinned_host", "unpinned_host", "device")  # best first
EVICTION_POLICIES = ("lru", "fifo")

_log = logging.getLogger(__name__)
_fallbacks_logged: set[tuple[str, str]] = set()


@dataclasses.dataclass(slots=True)
class HostTierStats:
    """Counters since construction; bytes are host bytes of block payload."""

    memory_kind: str
    capacity_bytes: int
    bytes_used: int
    blocks: int
    put_blocks: int = 0  # blocks stored by put
    duplicate_blocks: int = 0  # put of a key already held: nothing copied
    rejected_blocks: int = 0  # put blocks that did not fit (the rest were locked)
    hit_blocks: int = 0
    miss_blocks: int = 0
    evicted_blocks: int = 0
    discarded_blocks: int = 0


@dataclasses.dataclass(slots=True)
class _Entry:
    bits: jax.Array  # u{8,16,32,64}[*block_shape]: the block's bits, in host memory
    namespace: bytes
    locks: int = 0
    discarded: bool = False  # discard() came while locked: drop at the last unlock


class HostTier:
    """Blocks in host memory with a byte capacity and LRU (or FIFO) eviction of unlocked blocks.

    Thread-safe: the transfer engine's workers and the serving thread call it concurrently.

    >>> tier = HostTier((2, 2, 1, 4, 8), jnp.bfloat16, capacity_bytes=1 << 20)
    >>> blocks = jnp.zeros((3, 2, 2, 1, 4, 8), jnp.bfloat16)
    >>> stored = tier.put([b"a" * 16, b"b" * 16, b"c" * 16], blocks, namespace=b"ns")
    >>> tier.get(stored).shape
    (3, 2, 2, 1, 4, 8)
    """

    def __init__(
        self,
        block_shape: Sequence[int],
        dtype,
        capacity_bytes: int,
        *,
        sharding: jax.sharding.Sharding | None = None,
        memory_kind: str | None = None,
        policy: str = "lru",
    ):
        """Args:
        block_shape: shape of one block (all layers of one page, K and V).
        dtype: block dtype; any JAX dtype, stored bit-exact.
        capacity_bytes: most host bytes of block payload held at once.
        sharding: where fetched blocks land on device (one block's sharding); default the
          first device. The host copy uses the same sharding in the host memory kind.
        memory_kind: one of HOST_MEMORY_KINDS; None picks the best the device has and logs
          once when that is not `pinned_host`.
        policy: "lru" (a hit refreshes a block) or "fifo" (insertion order only).
        """
        self.block_shape = tuple(int(d) for d in block_shape)
        if not self.block_shape or min(self.block_shape) <= 0:
            raise ValueError(f"{block_shape=} must be a non-empty shape of positive sizes")
        self.dtype = jnp.dtype(dtype)
        if self.dtype.itemsize not in _BITS_DTYPES:
            raise ValueError(f"{dtype=} must have an itemsize in {sorted(_BITS_DTYPES)}")
        self._bits_dtype = _BITS_DTYPES[self.dtype.itemsize]
        if capacity_bytes < 0:
            raise ValueError(f"{capacity_bytes=} must be >= 0")
        if policy not in EVICTION_POLICIES:
            raise ValueError(f"{policy=} is not one of {EVICTION_POLICIES}")
        self.capacity_bytes = int(capacity_bytes)
        self.policy = policy
        self.block_nbytes = int(np.prod(self.block_shape)) * self.dtype.itemsize
        if sharding is None:
            sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        self.memory_kind = _pick_memory_kind(sharding, memory_kind)
        self._device_sharding = sharding.with_memory_kind("device")
        self._host_sharding = sharding.with_memory_kind(self.memory_kind)
        self._entries: collections.OrderedDict[bytes, _Entry] = collections.OrderedDict()
        self._lock = threading.RLock()
        self._stats = HostTierStats(self.memory_kind, self.capacity_bytes, 0, 0)

    # ---- queries -------------------------------------------------------------------------

    @property
    def bytes_used(self) -> int:
        """Host bytes held (discarded blocks still locked by a transfer included)."""
        with self._lock:
            return len(self._entries) * self.block_nbytes

    def __len__(self) -> int:
        with self._lock:
            return sum(not e.discarded for e in self._entries.values())

    def contains(self, key: bytes) -> bool:
        """True when `get([key])` will hit (discarded keys count as absent)."""
        with self._lock:
            entry = self._entries.get(key)
            return entry is not None and not entry.discarded

    __contains__ = contains

    def namespace_of(self, key: bytes) -> bytes | None:
        """The namespace digest the block was put with, or None when absent."""
        with self._lock:
            entry = self._entries.get(key)
            return None if entry is None else entry.namespace

    def stats(self) -> HostTierStats:
        with self._lock:
            return dataclasses.replace(
                self._stats, bytes_used=len(self._entries) * self.block_nbytes,
                blocks=len(self._entries))

    # ---- data path -----------------------------------------------------------------------

    def put(self, keys: Sequence[bytes], blocks, *, namespace: bytes) -> list[bytes]:
        """Copies blocks into host memory (async); returns the keys newly stored, in order.

        blocks: `[n, *block_shape]` jax.Array (on device) or numpy array, n == len(keys).
        Keys already held are skipped. When the blocks do not all fit after evicting every
        unlocked block, the leading ones that fit are stored (a normal result, counted in
        `rejected_blocks`).
        """
        keys = _check_keys(keys)
        _check_blocks(blocks, len(keys), self.block_shape, self.dtype)
        with self._lock:
            rows = []
            for row, key in enumerate(keys):
                entry = self._entries.get(key)
                if entry is None:
                    rows.append(row)
                    continue
                entry.discarded = False  # same key, same content: keep the copy we have
                self._stats.duplicate_blocks += 1
            fit = self._make_room(len(rows))
            self._stats.rejected_blocks += len(rows) - fit
            rows = rows[:fit]
            host_bits = jax.device_put(
                _split_rows(blocks, rows, self._bits_dtype), self._host_sharding)
            for row, bits in zip(rows, host_bits):
                self._entries[keys[row]] = _Entry(bits, bytes(namespace))
            self._stats.put_blocks += len(rows)
            return [keys[row] for row in rows]

    def get(self, keys: Sequence[bytes]) -> jax.Array | None:
        """Device copy of the blocks, `[n, *block_shape]`, or None when any key is absent."""
        device_bits = self._fetch_bits(keys)
        if device_bits is None:
            return None
        if not device_bits:
            return jax.device_put(np.zeros((0, *self.block_shape), self.dtype),
                                  self._device_sharding)
        return _stack_from_bits(*device_bits, dtype=self.dtype)

    def get_blocks(self, keys: Sequence[bytes]) -> list[jax.Array] | None:
        """Like `get`, one device array per block (no stacking)."""
        device_bits = self._fetch_bits(keys)
        if device_bits is None:
            return None
        return [_from_bits(bits, new_dtype=self.dtype) for bits in device_bits]

    def get_host(self, keys: Sequence[bytes]) -> np.ndarray | None:
        """Numpy copy `[n, *block_shape]` (for spilling to disk), or None when any is absent."""
        host_bits = self._lookup(keys)
        if host_bits is None:
            return None
        out = np.empty((len(host_bits), *self.block_shape), self._bits_dtype)
        for row, bits in enumerate(host_bits):
            out[row] = np.asarray(bits)
        return out.view(self.dtype)

    def wait_until_ready(self, keys: Sequence[bytes]) -> None:
        """Blocks until the host copies of the held keys among `keys` are complete."""
        keys = _check_keys(keys)
        with self._lock:
            pending = [self._entries[key].bits for key in keys if key in self._entries]
        jax.block_until_ready(pending)

    # ---- lifetime ------------------------------------------------------------------------

    def discard(self, keys: Sequence[bytes]) -> int:
        """Drops blocks; returns how many were held. Locked ones go at their last unlock."""
        keys = _check_keys(keys)
        with self._lock:
            dropped = 0
            for key in keys:
                entry = self._entries.get(key)
                if entry is None or entry.discarded:
                    continue
                dropped += 1
                if entry.locks:
                    entry.discarded = True
                else:
                    del self._entries[key]
            self._stats.discarded_blocks += dropped
            return dropped

    def lock(self, keys: Sequence[bytes]) -> bool:
        """Pins every key against eviction; False (and nothing locked) when any is absent."""
        keys = _check_keys(keys)
        with self._lock:
            if not all(self.contains(key) for key in keys):
                return False
            for key in keys:
                self._entries[key].locks += 1
            return True

    def unlock(self, keys: Sequence[bytes]) -> None:
        """Releases one `lock` of each key."""
        keys = _check_keys(keys)
        with self._lock:
            for key in keys:
                entry = self._entries.get(key)
                if entry is None or entry.locks <= 0:
                    raise ValueError(f"key={key.hex()} is not locked in the host tier")
            for key in keys:
                entry = self._entries[key]
                entry.locks -= 1
                if entry.locks == 0 and entry.discarded:
                    del self._entries[key]

    def check_invariants(self) -> None:
        """Raises RuntimeError when the tier's bookkeeping is inconsistent."""
        with self._lock:
            used = len(self._entries) * self.block_nbytes
            if used > self.capacity_bytes:
                raise RuntimeError(f"{used=} bytes exceed {self.capacity_bytes=}")
            for key, entry in self._entries.items():
                if entry.locks < 0 or (entry.discarded and entry.locks == 0):
                    raise RuntimeError(f"key={key.hex()} {entry.locks=} {entry.discarded=}")
                if entry.bits.shape != self.block_shape or entry.bits.dtype != self._bits_dtype:
                    raise RuntimeError(f"key={key.hex()} holds {entry.bits.shape}")

    # ---- helpers -------------------------------------------------------------------------

    def _fetch_bits(self, keys: Sequence[bytes]) -> list[jax.Array] | None:
        host_bits = self._lookup(keys)
        if host_bits is None:
            return None
        return list(jax.device_put(host_bits, self._device_sharding))

    def _lookup(self, keys: Sequence[bytes]) -> list[jax.Array] | None:
        keys = _check_keys(keys)
        with self._lock:
            entries = [self._entries.get(key) for key in keys]
            if any(entry is None for entry in entries):
                self._stats.miss_blocks += len(keys)
                return None
            self._stats.hit_blocks += len(keys)
            if self.policy == "lru":
                for key in keys:
                    self._entries.move_to_end(key)
            # The arrays stay valid after an eviction drops the tier's references to them.
            return [entry.bits for entry in entries]

    def _make_room(self, num_blocks: int) -> int:
        """Evicts unlocked blocks, oldest first, until `num_blocks` fit; returns how many fit."""
        capacity_blocks = self.capacity_bytes // self.block_nbytes
        shortfall = len(self._entries) + num_blocks - capacity_blocks
        if shortfall > 0:
            victims = [k for k, e in self._entries.items() if e.locks == 0][:shortfall]
            for key in victims:
                del self._entries[key]
            self._stats.evicted_blocks += len(victims)
        return max(0, min(num_blocks, capacity_blocks - len(self._entries)))


def _pick_memory_kind(sharding: jax.sharding.Sharding, requested: str | None) -> str:
    device = next(iter(sharding.device_set))
    available = {memory.kind for memory in device.addressable_memories()}
    if requested is not None:
        if requested not in available:
            raise ValueError(
                f"memory_kind={requested!r} is not available on {device.platform}; "
                f"available: {sorted(available)}")
        return requested
    kind = next((k for k in HOST_MEMORY_KINDS if k in available), None)
    if kind is None:
        kind = device.default_memory().kind
    if kind != "pinned_host" and (device.platform, kind) not in _fallbacks_logged:
        _fallbacks_logged.add((device.platform, kind))
        _log.warning("host tier: %s has no pinned_host memory; using %r (available: %s)",
                     device.platform, kind, sorted(available))
    return kind


def _check_keys(keys: Sequence[bytes]) -> list[bytes]:
    keys = list(keys)
    for key in keys:
        if not isinstance(key, bytes) or not key:
            raise ValueError(f"block key {key!r} must be non-empty bytes")
    if len(set(keys)) != len(keys):
        raise ValueError(f"keys contain duplicates: {len(keys)=} but {len(set(keys))} unique")
    return keys


def _check_blocks(blocks, num_keys: int, block_shape: tuple[int, ...], dtype) -> None:
    expected = (num_keys, *block_shape)
    if tuple(blocks.shape) != expected or blocks.dtype != dtype:
        raise ValueError(
            f"blocks shape {tuple(blocks.shape)} dtype {blocks.dtype} must be {expected} {dtype}")


def _split_rows(blocks, rows: list[int], bits_dtype) -> list:
    """The bits of each selected row, one array per row, owned by the tier.

    Numpy rows are copied: on CPU, `device_put` of a numpy array may alias its memory, and
    the tier must neither see the caller's later writes nor keep the caller's whole batch
    alive through one block.
    """
    if isinstance(blocks, np.ndarray):
        bits = blocks.view(bits_dtype)
        return [np.array(bits[row], copy=True) for row in rows]
    return [_take_row_bits(blocks, np.int32(row)) for row in rows]


# Blocks move as unsigned integers of the same width: XLA's CPU slicing and stacking of
# float8_e5m2 rewrite NaN bit patterns, and the tier promises bit-exact round trips.
_BITS_DTYPES = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint64}


def _to_bits(blocks: jax.Array) -> jax.Array:
    return jax.lax.bitcast_convert_type(blocks, _BITS_DTYPES[blocks.dtype.itemsize])


# A dynamic index compiles once per batch shape; static slices would compile once per row.
_take_row_bits = jax.jit(
    lambda blocks, row: jax.lax.dynamic_index_in_dim(_to_bits(blocks), row, 0, False))
_stack_from_bits = jax.jit(
    lambda *bits, dtype: jax.lax.bitcast_convert_type(jnp.stack(bits), dtype),
    static_argnames="dtype")
_from_bits = jax.jit(jax.lax.bitcast_convert_type, static_argnames="new_dtype")
