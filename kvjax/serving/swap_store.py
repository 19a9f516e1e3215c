"""Host copies of preempted sequences' KV: the scheduler's swap slots, held in a HostTier.

The scheduler decides which device blocks go to which host slot (``StepPlan.swap_out``) and
back (``StepPlan.swap_in``); this store moves the bytes: ``PagePool.gather`` + an async
``HostTier.put`` out, ``HostTier.get`` + ``PagePool.scatter`` in, through the pool's lossless
codec (``kvjax.tiers.block_codec.exact_codec``: a quantized pool's blocks travel packed with their
scales, never re-quantized, and no offload compression applies). Both are bit-exact, so a
swapped and resumed sequence continues with exactly the KV it had.

Slot ``s`` is stored under a fixed key, so the tier never holds more than ``num_slots``
blocks and its capacity is exactly ``num_slots`` blocks: nothing a live slot holds is ever
evicted. A slot is discarded once swapped in; a slot whose request was cancelled while
swapped keeps its stale copy until the slot is reused, when ``swap_out`` overwrites it.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvjax.tiers.block_codec import exact_codec
from kvjax.tiers.host_tier import HostTier
from kvjax.tiers.page_pool import PagePool

__all__ = ["SwapStore"]

_NAMESPACE = b"kvjax-swap"


class SwapStore:
    """``num_slots`` host blocks for swapped-out KV of ``pool``."""

    def __init__(self, pool: PagePool, num_slots: int):
        if num_slots < 1:
            raise ValueError(f"{num_slots=} must be >= 1 (no swap space: preempt by recompute)")
        self.pool = pool
        self.num_slots = num_slots
        self.codec = codec = exact_codec(pool.config)
        self.tier = HostTier(codec.block_shape, codec.dtype, num_slots * codec.block_nbytes)

    def swap_out(self, pairs: Sequence[tuple[int, int]]) -> None:
        """Copy each ``(device block, host slot)``; runs before anything writes those blocks."""
        if not pairs:
            return
        block_ids, slots = zip(*pairs)
        keys = self._keys(slots)
        self.tier.discard(keys)  # a reused slot: put() would keep the stale copy otherwise
        blocks = self.codec.encode(self.pool.gather(list(block_ids)))
        stored = self.tier.put(keys, blocks, namespace=_NAMESPACE)
        if len(stored) != len(keys):
            raise RuntimeError(f"swap store kept {len(stored)} of {len(keys)} blocks; its "
                               f"{self.num_slots} slots should always fit")

    def swap_in(self, pairs: Sequence[tuple[int, int]]) -> None:
        """Copy each ``(host slot, device block)`` back into the pool and free the slots."""
        if not pairs:
            return
        slots, block_ids = zip(*pairs)
        keys = self._keys(slots)
        blocks = self.tier.get(keys)
        if blocks is None:
            missing = [slot for slot, key in zip(slots, keys) if not self.tier.contains(key)]
            raise RuntimeError(f"swap slots {missing} hold no swapped-out KV")
        self.pool.scatter(list(block_ids), self.codec.decode(blocks))
        self.tier.discard(keys)

    def _keys(self, slots: Sequence[int]) -> list[bytes]:
        for slot in slots:
            if not 0 <= slot < self.num_slots:
                raise RuntimeError(f"swap slot {slot} is outside [0, {self.num_slots})")
        return [b"swap-slot-%08d" % slot for slot in slots]
