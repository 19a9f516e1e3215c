"""The host tier's bytes: one preallocated array of block slots in host memory.

Layout::

    slots  # u{8,16,32,64}[num_slots, *block_shape]: slot s holds one stored block's bits

``block_shape`` and ``dtype`` are the codec's (``kvjax.tiers.block_codec``): for a float pool
a block of every layer, K and V, exactly as the device pool lays it out, so a block moves as
one contiguous region both ways. Blocks are kept as unsigned integers of the same width, so
every dtype (float8 NaN payloads included) round-trips bit for bit.

Slots are handed out by the tier index (``kvjax.tiers.tier_index``), which owns each slot's
key, LRU order and holds; this pool only copies bytes:

* ``write(slots, blocks)``: blocks ``[n, *block_shape]`` (on device or host) into slots: one
  copy to host (none on the CPU backend, where device memory is host memory), one scatter
  into the slots;
* ``to_device(slots, num_rows)``: the slots gathered on host into a staging buffer, one
  ``device_put`` of it; ``num_rows >= len(slots)`` pads the batch with zero rows to a fixed
  bucket so the device side (decode, scatter into the pool) compiles once per bucket, not once
  per size;
* ``read(slots)``: a host copy, for a spill to disk.

Staging buffers. The gather lands in a 64-byte aligned buffer. On the CPU backend
``device_put`` wraps such a buffer instead of copying it, so the gather is the only copy of a
fetch; the buffer then belongs to the returned array and is never reused. Where
``device_put`` copies (an accelerator, a sharded placement) the buffer is reused for the next
fetch of the same number of rows once the copy has finished, so a steady stream of fetches
does not allocate (and fault in) fresh host memory per move. Nothing here compiles: blocks
move as the pool's dtype viewed on host, never through a jitted conversion.

Calls on different slots may run concurrently (the transfer workers and the serving thread);
the index never hands one slot to two transfers that write it. A staging buffer is taken out
of the free list under a lock and serves one call at a time.

``store_bytes=False`` keeps no array at all (a trace replay moves no bytes): the same slots,
capacity and accounting, writes and reads of nothing.
"""

from __future__ import annotations

import collections
import threading

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["HostPool"]

_BITS_DTYPES = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}
_ALIGN = 64  # bytes: XLA's CPU client wraps host arrays aligned to this instead of copying
_STAGING_SIZES = 16  # row counts whose free staging buffer is kept (the transfer buckets)


class HostPool:
    """``num_slots`` host blocks of ``block_shape`` / ``dtype``; see the module docstring.

    ``sharding``: where fetched blocks land (default: the first device).

    >>> pool = HostPool((2, 3), jnp.bfloat16, num_slots=4)
    >>> pool.write(np.array([2, 0]), jnp.ones((2, 2, 3), jnp.bfloat16))
    >>> pool.to_device(np.array([0]), num_rows=2).shape
    (2, 2, 3)
    """

    def __init__(self, block_shape, dtype, num_slots: int, *, sharding: jax.sharding.Sharding | None = None,
                 store_bytes: bool = True):  # fmt: skip
        self.block_shape = tuple(int(d) for d in block_shape)
        if not self.block_shape or min(self.block_shape) <= 0:
            raise ValueError(f"block_shape={block_shape!r} must be a non-empty shape of positive sizes")
        self.dtype = jnp.dtype(dtype)
        if self.dtype.itemsize not in _BITS_DTYPES:
            raise ValueError(f"dtype={dtype!r} must have an itemsize in {sorted(_BITS_DTYPES)}")
        if isinstance(num_slots, bool) or not isinstance(num_slots, int) or num_slots < 0:
            raise ValueError(f"num_slots={num_slots!r} must be an int >= 0")
        self.num_slots = num_slots
        self.block_nbytes = int(np.prod(self.block_shape)) * self.dtype.itemsize
        self.store_bytes = store_bytes
        self._bits = _BITS_DTYPES[self.dtype.itemsize]
        self._block_elems = int(np.prod(self.block_shape))
        # [num_slots, block_elems]: a slot is one row, so a block moves as one flat copy.
        self._slots = np.zeros((num_slots if store_bytes else 0, self._block_elems), self._bits)
        self._device = sharding or jax.sharding.SingleDeviceSharding(jax.devices()[0])
        self._staging_lock = threading.Lock()
        self._staging: collections.OrderedDict[int, np.ndarray] = collections.OrderedDict()  # rows -> free buffer

    @property
    def capacity_bytes(self) -> int:
        return self.num_slots * self.block_nbytes

    def write(self, slots: np.ndarray, blocks) -> None:
        """Store ``blocks[i]`` (``[n, *block_shape]`` of ``dtype``, device or host; extra rows
        past ``len(slots)`` are padding and ignored) in slot ``slots[i]``. Returns once the
        bytes are in host memory."""
        slots = self._check_slots(slots)
        if not self.store_bytes or not len(slots):
            return
        if tuple(blocks.shape[1:]) != self.block_shape or blocks.dtype != self.dtype or blocks.shape[0] < len(slots):
            raise ValueError(f"blocks {tuple(blocks.shape)} {blocks.dtype} must be [>= {len(slots)}, "
                             f"*{self.block_shape}] {self.dtype}")  # fmt: skip
        host = np.asarray(blocks)  # the one copy down (none on the CPU backend: a view)
        self._slots[slots] = host[: len(slots)].reshape(len(slots), self._block_elems).view(self._bits)

    def write_rows(self, slots: np.ndarray, source: np.ndarray, rows: np.ndarray) -> None:
        """Store ``source[rows[i]]`` (a host array ``[m, *block_shape]`` of ``dtype``) in slot
        ``slots[i]``: one copy per block, straight from ``source`` into its slot."""
        slots = self._check_slots(slots)
        if not self.store_bytes or not len(slots):
            return
        if tuple(source.shape[1:]) != self.block_shape or source.dtype != self.dtype or len(rows) != len(slots):
            raise ValueError(f"source {tuple(source.shape)} {source.dtype} must be [m, *{self.block_shape}] "
                             f"{self.dtype} with one row per slot; got {len(rows)} rows for {len(slots)} slots")
        if len(rows) and (min(rows) < 0 or max(rows) >= len(source)):
            raise ValueError(f"rows {np.asarray(rows).tolist()} must index the {len(source)} rows of source")
        bits = source.reshape(len(source), self._block_elems).view(self._bits)
        for slot, row in zip(slots.tolist(), rows.tolist()):
            self._slots[slot] = bits[row]

    def read(self, slots: np.ndarray) -> np.ndarray:
        """Host copy ``[len(slots), *block_shape]`` of ``dtype`` (zeros without bytes)."""
        slots = self._check_slots(slots)
        if not self.store_bytes:
            return np.zeros((len(slots), *self.block_shape), self.dtype)
        return self._slots[slots].view(self.dtype).reshape(len(slots), *self.block_shape)

    def to_device(self, slots: np.ndarray, num_rows: int | None = None) -> jax.Array | None:
        """Device copy ``[num_rows, *block_shape]`` of the slots, zero rows past ``len(slots)``
        (``num_rows`` None: exactly ``len(slots)``); None without bytes."""
        slots = self._check_slots(slots)
        num_rows = len(slots) if num_rows is None else num_rows
        if num_rows < len(slots):
            raise ValueError(f"{num_rows=} must be >= {len(slots)} slots")
        if not self.store_bytes:
            return None
        staging = self._take_staging(num_rows)
        # The one gather on host. mode="clip" (the slots are checked already): with out= and
        # the default mode="raise", numpy gathers into a temporary first, a second copy.
        np.take(self._slots, slots, axis=0, out=staging[: len(slots)], mode="clip")
        staging[len(slots) :] = 0
        blocks = staging.view(self.dtype).reshape(num_rows, *self.block_shape)
        device_rows = jax.device_put(blocks, self._device)  # the one copy up (none if wrapped)
        if not _shares_memory(device_rows, staging):
            device_rows.block_until_ready()  # the copy has read the staging rows
            self._give_back_staging(num_rows, staging)
        return device_rows

    def _take_staging(self, num_rows: int) -> np.ndarray:
        """A free staging buffer ``[num_rows, block_elems]`` of bits, aligned to ``_ALIGN``."""
        with self._staging_lock:
            staging = self._staging.pop(num_rows, None)
        if staging is not None:
            return staging
        nbytes = num_rows * self._block_elems * self._slots.itemsize
        raw = np.empty(nbytes + _ALIGN, np.uint8)
        start = -raw.ctypes.data % _ALIGN
        return raw[start : start + nbytes].view(self._bits).reshape(num_rows, self._block_elems)

    def _give_back_staging(self, num_rows: int, staging: np.ndarray) -> None:
        with self._staging_lock:
            self._staging[num_rows] = staging  # one free buffer per row count, the latest
            self._staging.move_to_end(num_rows)
            if len(self._staging) > _STAGING_SIZES:
                self._staging.popitem(last=False)

    def _check_slots(self, slots) -> np.ndarray:
        slots = np.asarray(slots)
        if slots.ndim != 1 or (slots.size and slots.dtype.kind not in "iu"):
            raise ValueError(f"slots must be a 1-D array of ints, got {slots!r}")
        if slots.size and (slots.min() < 0 or slots.max() >= self.num_slots):
            bad = slots[(slots < 0) | (slots >= self.num_slots)][0]
            raise ValueError(f"slot {bad} is out of range; expected 0 <= slot < {self.num_slots}")
        return slots.astype(np.intp, copy=False)


def _shares_memory(array: jax.Array, host: np.ndarray) -> bool:
    """Whether any shard of ``array`` lies in ``host``'s memory (``device_put`` wrapped it).
    True when the backend cannot say, so such a buffer is never reused."""
    start = host.ctypes.data
    try:
        if len(array.sharding.device_set) == 1:
            pointers = [array.unsafe_buffer_pointer()]
        else:
            pointers = [shard.data.unsafe_buffer_pointer() for shard in array.addressable_shards]
    except Exception:  # noqa: BLE001 - a backend without buffer pointers: assume wrapped
        return True
    return any(start <= pointer < start + host.nbytes for pointer in pointers)
