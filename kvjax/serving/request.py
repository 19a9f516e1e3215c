"""A generation request's record and the state machine the scheduler drives it through.

States::

    WAITING --admit--> RUNNING --max_new_tokens / stop token / stop_when--> FINISHED
       ^                  |  \\--preempt (swap)------> SWAPPED --admit (swap in)--> RUNNING
       |                  |
       +--preempt (recompute): blocks released, generated tokens kept
    WAITING / SWAPPED / RUNNING --cancel--> CANCELLED
    WAITING / RUNNING --cannot ever fit--> REJECTED (``finish_reason`` says why)

A request's tokens are its prompt followed by the tokens generated so far (``token_ids``).
``num_computed_tokens`` counts the leading tokens whose KV is in the pool (or, while SWAPPED,
in host swap slots). A RUNNING request still prefilling has ``num_computed_tokens <
num_tokens - 1``; one in decode has exactly ``num_tokens - 1`` (the last sampled token is the
next step's input). A step that computes up to ``num_tokens`` samples one new token, so the
same rule serves a first prefill, a decode and the recompute of a preempted request: after a
recompute preemption the request is prefilled over prompt + generated tokens and resumes
exactly where it was.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Callable
from typing import Any

import numpy as np

from kvjax.cache.block_keys import Namespace, as_namespace
from kvjax.cache.device_index import SeqHandle
from kvjax.text.tokens import TOKEN_DTYPE, validate_tokens

__all__ = ["Request", "RequestStatus"]


class RequestStatus(enum.Enum):
    WAITING = "waiting"  # queued; holds no device blocks (a recompute-preempted one too)
    RUNNING = "running"  # holds a SeqHandle whose blocks cover its computed tokens
    SWAPPED = "swapped"  # preempted; its computed pages wait in host swap slots
    FINISHED = "finished"
    CANCELLED = "cancelled"
    REJECTED = "rejected"

    @property
    def is_done(self) -> bool:
        return self in _DONE


_DONE = frozenset({RequestStatus.FINISHED, RequestStatus.CANCELLED, RequestStatus.REJECTED})


@dataclasses.dataclass(slots=True, eq=False)
class Request:
    """One generation request. Construct with the first six fields; the scheduler owns the rest.

    ``prompt_token_ids`` become int32 (validated against ``vocab_size`` by the scheduler);
    ``arrival_time`` is in the scheduler clock's seconds (None: stamped by ``Scheduler.add``);
    ``token_buffer`` holds prompt + generated tokens (the first ``num_tokens`` are valid);
    ``stop_token_ids`` end generation early (EOS); ``sampling`` is opaque to the scheduler, and
    so is ``stop_when``: called with the request after each appended token, True ends it with
    reason "stop" (the engine's stop strings). ``min_tokens``: neither a stop token nor
    ``stop_when`` ends the request before it has generated that many tokens (``stop_when`` is
    not called before then); ``max_new_tokens`` always does.
    """

    request_id: str
    prompt_token_ids: np.ndarray  # int32 [num_prompt_tokens]
    max_new_tokens: int
    namespace: Namespace | str | None = None
    arrival_time: float | None = None
    stop_token_ids: frozenset[int] | tuple[int, ...] = ()  # stored as a frozenset
    sampling: Any = None
    accept_lossy: bool | None = None  # may hit lossy (compressed on offload) KV; None: the cache's default
    stop_when: Callable[[Request], bool] | None = None
    min_tokens: int = 0
    status: RequestStatus = RequestStatus.WAITING
    num_computed_tokens: int = 0  # leading tokens whose KV exists (device, or host if SWAPPED)
    handle: SeqHandle | None = None  # the cache hold while RUNNING
    swap_slots: list[int] = dataclasses.field(default_factory=list)  # host slot per page (SWAPPED)
    hit_rank: int = 0  # queue rank from the last cache match (see WaitQueue)
    num_hit_tokens: int = 0  # device-hit tokens at the latest admission
    num_preemptions: int = 0
    finish_reason: str | None = None
    token_buffer: np.ndarray = dataclasses.field(init=False, repr=False)  # int32 [prompt + max_new]
    _num_tokens: int = dataclasses.field(init=False, repr=False)  # valid tokens in token_buffer
    _max_tokens: int = dataclasses.field(init=False, repr=False)  # prompt + max_new_tokens
    _num_prompt: int = dataclasses.field(init=False, repr=False)  # prompt tokens (read every step: an int)
    _min_stop_tokens: int = dataclasses.field(init=False, repr=False)  # prompt + min_tokens
    _writer: memoryview = dataclasses.field(init=False, repr=False)  # token_buffer, for fast stores

    def __post_init__(self):
        if not isinstance(self.request_id, str) or not self.request_id:
            raise ValueError(f"request_id={self.request_id!r} must be a non-empty str")
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens={self.max_new_tokens!r} must be an int >= 1")
        prompt = validate_tokens(self.prompt_token_ids, None)
        if prompt.size == 0:
            raise ValueError(f"request {self.request_id!r} has an empty prompt; expected >= 1 token")
        self.namespace = as_namespace(self.namespace)
        if self.stop_when is not None and not callable(self.stop_when):
            raise ValueError(f"stop_when={self.stop_when!r} must be None or a callable (Request -> bool)")
        if not isinstance(self.min_tokens, int) or isinstance(self.min_tokens, bool) \
                or not 0 <= self.min_tokens <= self.max_new_tokens:
            raise ValueError(f"min_tokens={self.min_tokens!r} must be an int in [0, max_new_tokens="
                             f"{self.max_new_tokens}]")  # fmt: skip
        stop = self.stop_token_ids
        if not isinstance(stop, (str, bytes)):
            try:
                stop = tuple(stop)  # read once: a generator is fine
            except TypeError:  # a bare id (stop_token_ids=2) was "'int' object is not iterable"
                raise ValueError(f"stop_token_ids={stop!r} must be a collection of token ids (ints), "
                                 "e.g. [2]") from None
        if isinstance(stop, (str, bytes)) or not all(isinstance(t, (int, np.integer)) and not isinstance(t, bool)
                                                     for t in stop):  # fmt: skip
            raise ValueError(f"stop_token_ids={stop!r} must be a collection of token ids (ints)")
        self.stop_token_ids = frozenset(int(t) for t in stop)
        self.token_buffer = np.zeros(prompt.size + self.max_new_tokens, TOKEN_DTYPE)
        self.token_buffer[: prompt.size] = prompt
        self.prompt_token_ids = self.token_buffer[: prompt.size]  # read-only by convention
        self._num_tokens = self._num_prompt = prompt.size
        self._max_tokens = prompt.size + self.max_new_tokens
        self._min_stop_tokens = prompt.size + self.min_tokens
        self._writer = memoryview(self.token_buffer)  # a store through it is ~10x cheaper than numpy's

    @property
    def num_prompt_tokens(self) -> int:
        return self._num_prompt

    @property
    def num_tokens(self) -> int:
        """Prompt tokens plus generated tokens."""
        return self._num_tokens

    @property
    def token_ids(self) -> np.ndarray:
        """int32 [num_tokens]: prompt then generated tokens (a view; do not write)."""
        return self.token_buffer[: self._num_tokens]

    @property
    def output_token_ids(self) -> np.ndarray:
        """int32 [num_generated]: the generated tokens so far (a view)."""
        return self.token_buffer[self.num_prompt_tokens : self._num_tokens]

    @property
    def num_output_tokens(self) -> int:
        return self._num_tokens - self.num_prompt_tokens

    @property
    def is_prefill(self) -> bool:
        """More than the last token still lacks KV (a first prefill or a recompute)."""
        return self.num_computed_tokens + 1 < self._num_tokens

    def append_token(self, token_id: int) -> bool:
        """Record one sampled token; return True when the request has finished generating: a
        stop token or ``stop_when`` (reason "stop", even at the last allowed token), or
        ``max_new_tokens`` ("length")."""
        self._writer[self._num_tokens] = token_id
        self._num_tokens += 1
        may_stop = self._num_tokens >= self._min_stop_tokens
        if may_stop and (token_id in self.stop_token_ids or (self.stop_when is not None and self.stop_when(self))):
            self.finish_reason = "stop"
        elif self._num_tokens == self._max_tokens:
            self.finish_reason = "length"
        else:
            return False
        return True
