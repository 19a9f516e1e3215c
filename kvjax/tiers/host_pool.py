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
  copy to host, one scatter into the slots;
* ``to_device(slots, num_rows)``: one gather of the slots on host, one copy to the device;
  ``num_rows >= len(slots)`` pads the batch with zero rows to a fixed bucket so the device
  side (decode, scatter into the pool) compiles once per bucket, not once per size;
* ``read(slots)``: a host copy, for a spill to disk.

Calls on different slots may run concurrently (the transfer workers and the serving thread);
the index never hands one slot to two transfers that write it.

``store_bytes=False`` keeps no array at all (a trace replay moves no bytes): the same slots,
capacity and accounting, writes and reads of nothing.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["HostPool"]

_BITS_DTYPES = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


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
        self._slots = np.zeros((num_slots if store_bytes else 0, *self.block_shape), self._bits)
        self._device = sharding or jax.sharding.SingleDeviceSharding(jax.devices()[0])

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
        self._slots[slots] = host[: len(slots)].view(self._bits)

    def read(self, slots: np.ndarray) -> np.ndarray:
        """Host copy ``[len(slots), *block_shape]`` of ``dtype`` (zeros without bytes)."""
        slots = self._check_slots(slots)
        if not self.store_bytes:
            return np.zeros((len(slots), *self.block_shape), self.dtype)
        return self._slots[slots].view(self.dtype)

    def to_device(self, slots: np.ndarray, num_rows: int | None = None) -> jax.Array | None:
        """Device copy ``[num_rows, *block_shape]`` of the slots, zero rows past ``len(slots)``
        (``num_rows`` None: exactly ``len(slots)``); None without bytes."""
        slots = self._check_slots(slots)
        num_rows = len(slots) if num_rows is None else num_rows
        if num_rows < len(slots):
            raise ValueError(f"{num_rows=} must be >= {len(slots)} slots")
        if not self.store_bytes:
            return None
        rows = np.zeros((num_rows, *self.block_shape), self._bits)
        rows[: len(slots)] = self._slots[slots]  # the one gather on host
        device_rows = jax.device_put(rows, self._device)  # the one copy up
        if jnp.dtype(self._bits) == self.dtype:
            return device_rows
        # Moved as bits and viewed back on the device: the copy never converts a value.
        return _view(device_rows, self.dtype)

    def _check_slots(self, slots) -> np.ndarray:
        slots = np.asarray(slots)
        if slots.ndim != 1 or (slots.size and slots.dtype.kind not in "iu"):
            raise ValueError(f"slots must be a 1-D array of ints, got {slots!r}")
        if slots.size and (slots.min() < 0 or slots.max() >= self.num_slots):
            bad = slots[(slots < 0) | (slots >= self.num_slots)][0]
            raise ValueError(f"slot {bad} is out of range; expected 0 <= slot < {self.num_slots}")
        return slots.astype(np.intp, copy=False)


@functools.partial(jax.jit, static_argnames="dtype")
def _view(bits: jax.Array, dtype) -> jax.Array:
    return jax.lax.bitcast_convert_type(bits, dtype)
