"""Scheduler settings (a frozen, slotted dataclass with ``from_dict``, validated on construction)
and the counters a scheduler keeps."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

from kvjax.config.from_mapping import config_from_dict
from kvjax.serving.preemption import PREEMPTION_MODES

__all__ = ["SchedulerConfig", "SchedulerStats"]


@dataclasses.dataclass(frozen=True, slots=True)
class SchedulerConfig:
    """How the scheduler fills a step. Tokens, blocks and seconds as named.

    The pool's high/low watermarks are the allocator's (``KVCacheConfig(high_watermark=...,
    low_watermark=...)``), so the cache and the scheduler share one setting.
    """

    max_num_seqs: int = 256  # running sequences (prefilling + decoding)
    token_budget: int = 2048  # tokens per step: decodes (1 each) + prefill chunks; >= max_num_seqs
    max_prefill_chunk: int = 512  # tokens of one sequence's prefill per step
    aging_seconds: float = 0.5  # seconds of waiting worth one hit rank (0: first come first served)
    preemption: str = "auto"  # "auto" (the cache's cost model) | "swap" | "recompute"
    host_swap_blocks: int = 0  # host slots for swapped-out KV (0: swap disabled)
    max_waiting: int = 4096  # queued requests; a new one beyond this is rejected
    rank_refresh_per_step: int = 4  # waiting requests re-matched per step (round robin)
    prefetch_window: int = 16  # best waiting requests whose host/disk hits are prefetched
    evict_to_low_watermark: bool = False  # evict (drop) cached blocks itself above the high mark

    def __post_init__(self):
        for name in ("max_num_seqs", "token_budget", "max_prefill_chunk", "host_swap_blocks", "max_waiting",
                     "rank_refresh_per_step", "prefetch_window"):  # fmt: skip
            value = getattr(self, name)
            _require(isinstance(value, int) and not isinstance(value, bool), f"{name}={value!r} must be an int")
        _require(isinstance(self.aging_seconds, (int, float)) and not isinstance(self.aging_seconds, bool),
                 f"aging_seconds={self.aging_seconds!r} must be a number of seconds")  # fmt: skip
        _require(isinstance(self.evict_to_low_watermark, bool),
                 f"evict_to_low_watermark={self.evict_to_low_watermark!r} must be a bool")  # fmt: skip
        _require(self.max_num_seqs >= 1, f"max_num_seqs={self.max_num_seqs} must be >= 1")
        _require(self.token_budget >= self.max_num_seqs,
                 f"token_budget={self.token_budget} must be >= max_num_seqs={self.max_num_seqs} "
                 "(every running decode gets its token each step)")  # fmt: skip
        _require(self.max_prefill_chunk >= 1, f"max_prefill_chunk={self.max_prefill_chunk} must be >= 1")
        _require(math.isfinite(self.aging_seconds) and self.aging_seconds >= 0,
                 f"aging_seconds={self.aging_seconds} must be a finite number >= 0")  # fmt: skip
        _require(self.preemption in PREEMPTION_MODES,
                 f"preemption={self.preemption!r} is not one of {PREEMPTION_MODES}")  # fmt: skip
        _require(self.host_swap_blocks >= 0, f"host_swap_blocks={self.host_swap_blocks} must be >= 0")
        _require(self.max_waiting >= 1, f"max_waiting={self.max_waiting} must be >= 1")
        _require(self.rank_refresh_per_step >= 0, f"rank_refresh_per_step={self.rank_refresh_per_step} must be >= 0")
        _require(self.prefetch_window >= 0, f"prefetch_window={self.prefetch_window} must be >= 0")

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> SchedulerConfig:
        """Build from a mapping (e.g. a parsed config file); unknown keys raise ValueError."""
        return config_from_dict(cls, values, "scheduler config")


@dataclasses.dataclass(slots=True)
class SchedulerStats:
    """Counters since construction (requests, tokens, blocks)."""

    steps: int = 0
    admitted: int = 0  # admissions, resumed ones included
    finished: int = 0
    cancelled: int = 0
    rejected: int = 0
    preempted_swap: int = 0
    preempted_recompute: int = 0
    swap_out_blocks: int = 0
    swap_in_blocks: int = 0
    prefill_tokens: int = 0  # scheduled prefill tokens (recomputes included)
    decode_tokens: int = 0
    hit_tokens: int = 0  # tokens mapped from cached blocks at admission
    aborted_steps: int = 0  # steps whose block moves or model run failed (``Scheduler.abort_step``)


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)
