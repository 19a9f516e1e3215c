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

Staging buffers. The gather lands in a 64-byte aligned staging buffer, lent to the fetch
through a ``_Lease``: the base of every numpy view of the buffer, so the views, and whatever
holds one (``device_put`` keeps the host array it was given for as long as it reads it), keep
the lease alive. On the CPU backend ``device_put`` wraps such a buffer instead of copying it,
so the gather is the only copy of a fetch and the device array lies in the buffer (jax lets go
of the host array when the device array is deleted, lazily: at its next call or a garbage
collection); where ``device_put`` copies (an accelerator, a sharded placement) it holds the
buffer until the copy is done. Either way the buffer goes back to a free list (the latest one
per row count) only when its lease dies, after the last array that may read it is gone, and
serves the next fetch of that many rows: a steady stream of fetches reuses warm memory instead
of faulting in fresh pages per move (about 0.5 ms of a 16 MiB fetch's 1.5 ms on CPU), and
nothing fetched is ever overwritten. Nothing here compiles: blocks move as the pool's dtype
viewed on host, never through a jitted conversion.

Large gathers are split. A ``to_device`` of at least ``split_min_bytes`` (4 MiB by default)
gathers its rows in ``copy_threads`` parts at once, the calling thread taking the first and a
small shared pool of copy threads the rest (numpy lets go of the GIL while it copies): one
thread does not reach the memory bandwidth a host has (on the 2-core CPU machine here a
16 MiB gather took 0.65 ms alone and 0.36-0.42 ms in two halves), and the gather is the part
of a fetch the device does not overlap.

Calls on different slots may run concurrently (the transfer workers and the serving thread);
the index never hands one slot to two transfers that write it. A staging buffer is taken out
of the free list under a lock and serves one fetch at a time; a dying lease returns it
through a short queue that needs no lock (a lease may die on any thread, inside any call),
which keeps the latest four until the next fetch sorts them into the free list.

``store_bytes=False`` keeps no array at all (a trace replay moves no bytes): the same slots,
capacity and accounting, writes and reads of nothing.
"""

from __future__ import annotations

import collections
import concurrent.futures
import os
import threading

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["HostPool"]

_BITS_DTYPES = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}
_ALIGN = 64  # bytes: XLA's CPU client wraps host arrays aligned to this instead of copying
_STAGING_SIZES = 16  # row counts whose free staging buffer is kept (the transfer buckets)
_RETURNED = 4  # buffers let go since the last fetch kept for it at most (the latest; older ones freed)
_MAX_COPY_THREADS = 8

_copy_pool: concurrent.futures.ThreadPoolExecutor | None = None  # shared by every HostPool, made on first use
_copy_pool_lock = threading.Lock()


def _copy_executor() -> concurrent.futures.ThreadPoolExecutor:
    global _copy_pool
    with _copy_pool_lock:
        if _copy_pool is None:
            _copy_pool = concurrent.futures.ThreadPoolExecutor(_MAX_COPY_THREADS - 1, "kvjax-host-copy")
        return _copy_pool


class HostPool:
    """``num_slots`` host blocks of ``block_shape`` / ``dtype``; see the module docstring.

    ``sharding``: where fetched blocks land (default: the first device). ``copy_threads``:
    threads a gather of at least ``split_min_bytes`` is split over (default: 2 where the host
    has 2 cores or more, else 1; at most 8).

    >>> pool = HostPool((2, 3), jnp.bfloat16, num_slots=4)
    >>> pool.write(np.array([2, 0]), jnp.ones((2, 2, 3), jnp.bfloat16))
    >>> pool.to_device(np.array([0]), num_rows=2).shape
    (2, 2, 3)
    """

    def __init__(self, block_shape, dtype, num_slots: int, *, sharding: jax.sharding.Sharding | None = None,
                 store_bytes: bool = True, copy_threads: int | None = None,
                 split_min_bytes: int = 4 << 20):  # fmt: skip
        self.block_shape = tuple(int(d) for d in block_shape)
        if not self.block_shape or min(self.block_shape) <= 0:
            raise ValueError(f"block_shape={block_shape!r} must be a non-empty shape of positive sizes")
        self.dtype = jnp.dtype(dtype)
        if self.dtype.itemsize not in _BITS_DTYPES:
            raise ValueError(f"dtype={dtype!r} must have an itemsize in {sorted(_BITS_DTYPES)}")
        if isinstance(num_slots, bool) or not isinstance(num_slots, int) or num_slots < 0:
            raise ValueError(f"num_slots={num_slots!r} must be an int >= 0")
        self.num_slots = num_slots
        if copy_threads is None:
            copy_threads = min(2, os.cpu_count() or 1)
        if isinstance(copy_threads, bool) or not isinstance(copy_threads, int) \
                or not 1 <= copy_threads <= _MAX_COPY_THREADS:
            raise ValueError(f"copy_threads={copy_threads!r} must be an int in [1, {_MAX_COPY_THREADS}]")
        if isinstance(split_min_bytes, bool) or not isinstance(split_min_bytes, int) or split_min_bytes < 0:
            raise ValueError(f"split_min_bytes={split_min_bytes!r} must be an int >= 0")
        self.copy_threads, self.split_min_bytes = copy_threads, split_min_bytes
        self.block_nbytes = int(np.prod(self.block_shape)) * self.dtype.itemsize
        self.store_bytes = store_bytes
        self._bits = _BITS_DTYPES[self.dtype.itemsize]
        self._block_elems = int(np.prod(self.block_shape))
        # [num_slots, block_elems]: a slot is one row, so a block moves as one flat copy.
        self._slots = np.zeros((num_slots if store_bytes else 0, self._block_elems), self._bits)
        self._device = sharding or jax.sharding.SingleDeviceSharding(jax.devices()[0])
        self._staging_lock = threading.Lock()
        self._staging: collections.OrderedDict[int, np.ndarray] = collections.OrderedDict()  # rows -> free buffer
        self._returned: collections.deque[tuple[int, np.ndarray]] = collections.deque(maxlen=_RETURNED)  # (rows, buffer)

    @property
    def device_platform(self) -> str:
        """The platform ``to_device`` copies onto ("cpu", "gpu", "tpu"; the first device's when
        sharded)."""
        return next(iter(self._device.device_set)).platform

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
        staging = np.frombuffer(_Lease(self._take_staging(num_rows), num_rows, self._returned), self._bits)
        staging = staging.reshape(num_rows, self._block_elems)  # the lease lives as long as its views
        self._gather_rows(slots, staging)  # the one gather on host
        if num_rows > len(slots):
            staging[len(slots) :] = 0
        blocks = staging.view(self.dtype).reshape(num_rows, *self.block_shape)
        return jax.device_put(blocks, self._device)  # the one copy up (none if wrapped)

    def _gather_rows(self, slots: np.ndarray, out: np.ndarray) -> None:
        """``out[i] = slot slots[i]``, split over ``copy_threads`` threads when large."""
        # mode="clip" (the slots are checked already): with out= and the default
        # mode="raise", numpy gathers into a temporary first, a second copy.
        parts = min(self.copy_threads, len(slots))
        if parts < 2 or len(slots) * self.block_nbytes < self.split_min_bytes:
            np.take(self._slots, slots, axis=0, out=out[: len(slots)], mode="clip")
            return
        bounds = [len(slots) * i // parts for i in range(parts + 1)]
        others = [_copy_executor().submit(np.take, self._slots, slots[lo:hi], 0, out[lo:hi], "clip")
                  for lo, hi in zip(bounds[1:-1], bounds[2:])]  # fmt: skip
        try:
            np.take(self._slots, slots[: bounds[1]], axis=0, out=out[: bounds[1]], mode="clip")
        finally:
            for part in others:
                part.result()  # every part done (or raised) before the buffer is handed on

    def _take_staging(self, num_rows: int) -> np.ndarray:
        """A free staging buffer of ``num_rows`` blocks: uint8, aligned to ``_ALIGN``."""
        with self._staging_lock:
            while self._returned:  # buffers whose leases ended, latest last
                rows, memory = self._returned.popleft()
                self._staging[rows] = memory  # one free buffer per row count, the latest
                self._staging.move_to_end(rows)
                if len(self._staging) > _STAGING_SIZES:
                    self._staging.popitem(last=False)
            memory = self._staging.pop(num_rows, None)
        if memory is not None:
            return memory
        nbytes = num_rows * self.block_nbytes
        raw = np.empty(nbytes + _ALIGN, np.uint8)
        start = -raw.ctypes.data % _ALIGN
        return raw[start : start + nbytes]

    def _check_slots(self, slots) -> np.ndarray:
        slots = np.asarray(slots)
        if slots.ndim != 1 or (slots.size and slots.dtype.kind not in "iu"):
            raise ValueError(f"slots must be a 1-D array of ints, got {slots!r}")
        if slots.size and (slots.min() < 0 or slots.max() >= self.num_slots):
            bad = slots[(slots < 0) | (slots >= self.num_slots)][0]
            raise ValueError(f"slot {bad} is out of range; expected 0 <= slot < {self.num_slots}")
        return slots.astype(np.intp, copy=False)


class _Lease:
    """Lends a staging buffer to the arrays of one fetch: ``np.frombuffer(lease)`` and every
    view of it keep the lease as their base, so it lives exactly as long as some array (or a
    device array wrapping one) may read the buffer; dying, it returns the buffer to ``returned``."""

    __slots__ = ("_memory", "_rows", "_returned")

    def __init__(self, memory: np.ndarray, rows: int, returned: collections.deque):
        self._memory, self._rows, self._returned = memory, rows, returned

    def __buffer__(self, flags: int) -> memoryview:
        return memoryview(self._memory)

    def __del__(self) -> None:
        self._returned.append((self._rows, self._memory))  # atomic: no lock, any thread
