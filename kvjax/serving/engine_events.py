"""What the engine streams back: one event per generated token, one when a request ends, and
a summary when a run ends."""

from __future__ import annotations

import dataclasses

import numpy as np

from kvjax.text.canonicalize import Change

__all__ = ["Event", "FinishEvent", "RunSummary", "TokenEvent"]


@dataclasses.dataclass(frozen=True, slots=True)
class TokenEvent:
    """Request ``request_id`` generated ``token_id``, its ``index``-th token (0 = first).

    ``logits  # f32[vocab]`` of the position that produced it, when the engine was built with
    ``record_logits=True`` (for checks against an uncached forward), else None.
    """

    request_id: str
    token_id: int
    index: int
    logits: np.ndarray | None = None


@dataclasses.dataclass(frozen=True, slots=True)
class FinishEvent:
    """Request ``request_id`` ended. ``status`` is "finished", "cancelled" or "rejected";
    ``reason`` is "length", "stop", "cancelled" or the rejection's explanation.

    Token counts are prompt tokens: ``num_hit_tokens`` served from cached KV at the first
    admission, by tier in ``hit_tokens_by_tier``; ``miss_tokens_by_cause`` explains the rest
    (see ``kvjax.serving.miss_attribution``). ``num_computed_tokens`` counts every token the model
    computed for it in prefill chunks (recomputation after a preemption included).
    ``canonical_changes`` lists what prompt canonicalization changed (empty when off).
    Times are seconds on the engine's clock from the request's arrival: ``ttft_seconds`` to its
    first token, ``request_seconds`` to its last (a cancellation later adds nothing); None when
    the request never got that far.
    """

    request_id: str
    status: str
    reason: str
    prompt_token_ids: np.ndarray  # int32 [num_prompt_tokens]
    output_token_ids: np.ndarray  # int32 [num_generated]
    text: str | None  # the generated tokens decoded (None: the tokenizer cannot decode)
    num_hit_tokens: int = 0
    hit_tokens_by_tier: dict[str, int] = dataclasses.field(default_factory=dict)
    miss_tokens_by_cause: dict[str, int] = dataclasses.field(default_factory=dict)
    num_computed_tokens: int = 0
    num_preemptions: int = 0
    ttft_seconds: float | None = None
    request_seconds: float | None = None
    canonical_changes: tuple[Change, ...] = ()


@dataclasses.dataclass(frozen=True, slots=True)
class RunSummary:
    """The end of ``Engine.run()``: a ``Metrics.to_json()`` snapshot and its table."""

    metrics: dict
    table: str
    num_finished: int
    num_cancelled: int
    num_rejected: int
    wall_seconds: float


Event = TokenEvent | FinishEvent | RunSummary
