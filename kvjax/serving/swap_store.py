"""Host copies of preempted sequences' KV: the scheduler's swap slots, held in a HostPool.

The scheduler decides which device blocks go to which host slot (``StepPlan.swap_out``) and
back (``StepPlan.swap_in``); this store moves the bytes: ``PagePool.gather`` + one copy into
the slots out, one copy of the slots + ``PagePool.scatter`` in, through the pool's lossless
codec (``kvjax.tiers.block_codec.exact_codec``: a quantized pool's blocks travel packed with
their scales, never re-quantized, and no offload compression applies). Both are bit-exact, so
a swapped and resumed sequence continues with exactly the KV it had.

Swap slot ``s`` is host pool slot ``s``: the pool holds exactly ``num_slots`` blocks, so
nothing a live slot holds is ever evicted. A slot whose request was cancelled while swapped
keeps its stale copy until the slot is reused, when ``swap_out`` overwrites it.

Moves are padded to ``buckets`` (the cache's transfer buckets; runs of at most the largest)
so the device side compiles once per bucket, all of them in ``warmup``, never while serving.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from kvjax.tiers.block_codec import exact_codec
from kvjax.tiers.host_pool import HostPool
from kvjax.tiers.page_pool import PagePool
from kvjax.tiers.transfer import bucket_rows, move_batches

__all__ = ["SwapStore"]


class SwapStore:
    """``num_slots`` host blocks for swapped-out KV of ``pool``, moved in ``buckets``."""

    def __init__(self, pool: PagePool, num_slots: int, buckets: Sequence[int] = (1, 2, 4, 8, 16, 32, 64)):
        if num_slots < 1:
            raise ValueError(f"{num_slots=} must be >= 1 (no swap space: preempt by recompute)")
        self.pool = pool
        self.num_slots = num_slots
        self.buckets = tuple(buckets)
        self.codec = codec = exact_codec(pool.config)
        self.host = HostPool(codec.block_shape, codec.dtype, num_slots)

    def swap_out(self, pairs: Sequence[tuple[int, int]]) -> None:
        """Copy each ``(device block, host slot)``; runs before anything writes those blocks."""
        for start, size in move_batches(len(pairs), self.buckets):
            block_ids, slots = zip(*pairs[start : start + size])
            self._out(self._padded(block_ids), self._slots(slots))

    def swap_in(self, pairs: Sequence[tuple[int, int]]) -> None:
        """Copy each ``(host slot, device block)`` back into the pool."""
        for start, size in move_batches(len(pairs), self.buckets):
            slots, block_ids = zip(*pairs[start : start + size])
            self._in(self._slots(slots), self._padded(block_ids))

    def warmup(self) -> None:
        """Build both moves' device side for every bucket now (on no block)."""
        for rows in self.buckets:
            self._out(np.full(rows, -1, np.int32), np.zeros(0, np.intp))
            self._in(np.zeros(0, np.intp), np.full(rows, -1, np.int32))

    def _out(self, block_ids: np.ndarray, slots: np.ndarray) -> None:
        self.host.write(slots, self.codec.encode(self.pool.gather(block_ids)))

    def _in(self, slots: np.ndarray, block_ids: np.ndarray) -> None:
        self.pool.scatter(block_ids, self.codec.decode(self.host.to_device(slots, len(block_ids))))

    def _padded(self, block_ids: Sequence[int]) -> np.ndarray:
        """The ids, then -1 (no block) up to their bucket."""
        padded = np.full(bucket_rows(len(block_ids), self.buckets), -1, np.int32)
        padded[: len(block_ids)] = block_ids
        return padded

    def _slots(self, slots: Sequence[int]) -> np.ndarray:
        for slot in slots:
            if not 0 <= slot < self.num_slots:
                raise RuntimeError(f"swap slot {slot} is outside [0, {self.num_slots})")
        return np.asarray(slots, np.intp)
