"""What happens to a preempted request: swap its KV to host, or drop it and recompute later.

The scheduler picks the victim (the most recently admitted running request); this module
decides how to preempt it and keeps the host swap space it needs.

Costs come from the cache's one cost model (``kvjax.cache.cost_model``), in seconds, for a
victim with ``n`` computed tokens on ``p = ceil(n / page_size)`` pages of ``block_nbytes``::

    swap      = cost_model.swap_seconds(p, block_nbytes)   # out now, back in on resume
    recompute = cost_model.recompute_seconds(0, n)         # prefill again on resume

A recompute may hit pages the victim committed (they stay cached after release), so the
recompute figure is an upper bound; swap restores every page regardless of eviction.
"""

from __future__ import annotations

from kvjax.cache.cost_model import CostModel

__all__ = ["PREEMPTION_MODES", "SwapSpace", "choose_preemption"]

PREEMPTION_MODES = ("auto", "swap", "recompute")


def choose_preemption(mode: str, cost_model: CostModel, block_nbytes: int, num_computed_tokens: int,
                      page_size: int, free_swap_slots: int) -> tuple[str, str]:  # fmt: skip
    """Return ("swap" | "recompute", reason) for a victim with ``num_computed_tokens`` tokens of KV.

    ``mode="swap"`` and ``"auto"`` fall back to recompute when the host swap space lacks room;
    ``"auto"`` also when recomputing is estimated cheaper.
    """
    if mode not in PREEMPTION_MODES:
        raise ValueError(f"preemption {mode=!r} is not one of {PREEMPTION_MODES}")
    num_pages = -(-num_computed_tokens // page_size)
    swap_s = cost_model.swap_seconds(num_pages, block_nbytes)
    recompute_s = cost_model.recompute_seconds(0, num_computed_tokens)
    figures = (f"swap {num_pages} blocks ~{swap_s * 1e3:.3g} ms vs recompute "
               f"{num_computed_tokens} tokens ~{recompute_s * 1e3:.3g} ms")  # fmt: skip
    if mode == "recompute" or num_pages == 0:
        return "recompute", f"recompute ({figures}; mode={mode})"
    if num_pages > free_swap_slots:
        return "recompute", f"recompute: host swap space has {free_swap_slots} free blocks ({figures})"
    if mode == "auto" and recompute_s <= swap_s:
        return "recompute", f"recompute ({figures})"
    return "swap", f"swap ({figures})"


class SwapSpace:
    """Host slots (one block each) for swapped-out sequences; ids are 0 .. num_slots - 1.

    Released slots become free only at the next ``flush`` (the next step): a swap-in reading
    a slot and a swap-out writing it may sit in the same plan, and the engine runs swap-outs
    first, so a slot must not be reused before its swap-in has run.
    """

    def __init__(self, num_slots: int):
        if num_slots < 0:
            raise ValueError(f"{num_slots=} must be >= 0")
        self.num_slots = num_slots
        self._free = list(range(num_slots - 1, -1, -1))  # a stack: pop() hands out low ids first
        self._released: list[int] = []

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, num_slots: int) -> list[int] | None:
        """``num_slots`` slot ids, or None (nothing changed) when fewer are free."""
        if num_slots > len(self._free):
            return None
        taken = self._free[len(self._free) - num_slots :][::-1]
        del self._free[len(self._free) - num_slots :]
        return taken

    def release(self, slots: list[int]) -> None:
        """Give ``slots`` back; they are reusable after the next ``flush``."""
        self._released.extend(slots)

    def flush(self) -> None:
        self._free.extend(reversed(self._released))
        self._released.clear()

    def check_invariants(self, held: list[list[int]]) -> None:
        """Raise RuntimeError unless free, released and ``held`` slots partition the space."""
        every = self._free + self._released + [slot for slots in held for slot in slots]
        if sorted(every) != list(range(self.num_slots)):
            raise RuntimeError(f"swap slots leak or repeat: free={self._free}, released={self._released}, "
                               f"held={held} for {self.num_slots} slots")  # fmt: skip
