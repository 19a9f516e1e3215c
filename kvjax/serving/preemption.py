"""What happens to a preempted request: swap its KV to host, or drop it and recompute later.

The scheduler picks the victim (the most recently admitted running request); this module
decides how to preempt it and keeps the host swap space it needs.

Cost model (seconds, per victim with ``n`` computed tokens on ``p = ceil(n / page_size)`` pages)::

    swap      = 2 * p * bytes_per_block / host_bytes_per_second   # out now, back in on resume
    recompute = n * recompute_seconds_per_token                   # prefill again on resume

A recompute may hit pages the victim committed (they stay cached after release), so the
recompute figure is an upper bound; swap restores every page regardless of eviction.
"""

from __future__ import annotations

import dataclasses

__all__ = ["PREEMPTION_MODES", "PreemptionCosts", "SwapSpace", "choose_preemption"]

PREEMPTION_MODES = ("auto", "swap", "recompute")
DEFAULT_RECOMPUTE_SECONDS_PER_TOKEN = 5e-5
DEFAULT_HOST_BYTES_PER_SECOND = 2e10
DEFAULT_BYTES_PER_BLOCK = 2 * 1024 * 1024


@dataclasses.dataclass(frozen=True, slots=True)
class PreemptionCosts:
    """Inputs of the swap-vs-recompute choice.

    Defaults: a 7B-class model (2 * 7e9 FLOP per token at ~300 TFLOP/s sustained prefill,
    so ~5e-5 s per token), 16-token pages of 128 KiB of KV per token (2 MiB per block) and a
    20 GB/s host link.
    """

    recompute_seconds_per_token: float = DEFAULT_RECOMPUTE_SECONDS_PER_TOKEN
    host_bytes_per_second: float = DEFAULT_HOST_BYTES_PER_SECOND
    bytes_per_block: int = DEFAULT_BYTES_PER_BLOCK

    def swap_seconds(self, num_pages: int) -> float:
        return 2 * num_pages * self.bytes_per_block / self.host_bytes_per_second

    def recompute_seconds(self, num_tokens: int) -> float:
        return num_tokens * self.recompute_seconds_per_token


def choose_preemption(mode: str, costs: PreemptionCosts, num_computed_tokens: int, page_size: int,
                      free_swap_slots: int) -> tuple[str, str]:  # fmt: skip
    """Return ("swap" | "recompute", reason) for a victim with ``num_computed_tokens`` tokens of KV.

    ``mode="swap"`` and ``"auto"`` fall back to recompute when the host swap space lacks room;
    ``"auto"`` also when recomputing is estimated cheaper.
    """
    if mode not in PREEMPTION_MODES:
        raise ValueError(f"preemption {mode=!r} is not one of {PREEMPTION_MODES}")
    num_pages = -(-num_computed_tokens // page_size)
    swap_s = costs.swap_seconds(num_pages)
    recompute_s = costs.recompute_seconds(num_computed_tokens)
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
