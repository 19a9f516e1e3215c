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
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from kvjax.tiers.block_codec import exact_codec
from kvjax.tiers.host_pool import HostPool
from kvjax.tiers.page_pool import PagePool

__all__ = ["SwapStore"]


class SwapStore:
    """``num_slots`` host blocks for swapped-out KV of ``pool``."""

    def __init__(self, pool: PagePool, num_slots: int):
        if num_slots < 1:
            raise ValueError(f"{num_slots=} must be >= 1 (no swap space: preempt by recompute)")
        self.pool = pool
        self.num_slots = num_slots
        self.codec = codec = exact_codec(pool.config)
        self.host = HostPool(codec.block_shape, codec.dtype, num_slots)

    def swap_out(self, pairs: Sequence[tuple[int, int]]) -> None:
        """Copy each ``(device block, host slot)``; runs before anything writes those blocks."""
        if not pairs:
            return
        block_ids, slots = zip(*pairs)
        self.host.write(self._slots(slots), self.codec.encode(self.pool.gather(list(block_ids))))

    def swap_in(self, pairs: Sequence[tuple[int, int]]) -> None:
        """Copy each ``(host slot, device block)`` back into the pool."""
        if not pairs:
            return
        slots, block_ids = zip(*pairs)
        self.pool.scatter(list(block_ids), self.codec.decode(self.host.to_device(self._slots(slots))))

    def _slots(self, slots: Sequence[int]) -> np.ndarray:
        for slot in slots:
            if not 0 <= slot < self.num_slots:
                raise RuntimeError(f"swap slot {slot} is outside [0, {self.num_slots})")
        return np.asarray(slots, np.intp)
