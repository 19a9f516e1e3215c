"""What one model step must do, as the scheduler decided it: the engine's whole to-do list.

The engine executes a plan in this order:

1. ``swap_out``: copy each (device block -> host slot). The blocks were released when their
   request was preempted and may be handed to another sequence in this same plan, so these
   copies must read the pool before anything below writes it.
2. ``swap_in``: copy each (host slot -> device block).
3. the model step over ``decodes`` and ``prefills``: sequence ``s`` computes tokens
   ``positions`` (its ``token_ids`` are the inputs), reading KV for positions ``< start`` and
   writing KV for ``positions`` through ``block_table`` (page ``p`` of the sequence lives in
   block ``block_table[p]``). When ``samples`` is set the engine samples one token from the
   logits of the last position.
4. ``Scheduler.on_step_done(plan, {request_id: token})`` with one token per sampling sequence
   (``pair_tokens`` checks that mapping against the plan).

``prefetch`` intents are hints for the transfer engine (copy those host/disk pages up before
the request is admitted); ``evict_target`` asks the tier layer to spill/evict that many cached
device blocks to bring the pool back to its low watermark. Neither blocks the step.
"""

from __future__ import annotations

import dataclasses
import itertools
import operator
from collections.abc import Mapping
from typing import Any

import numpy as np

from kvjax.cache.block_keys import Namespace

__all__ = ["PrefetchIntent", "ScheduledSeq", "StepPlan", "pair_tokens"]


class ScheduledSeq:
    """One sequence's share of a step: ``num_tokens`` tokens starting at position ``start``."""

    __slots__ = ("request_id", "start", "num_tokens", "token_buffer", "block_table", "samples")

    def __init__(self, request_id: str, start: int, num_tokens: int, token_buffer: np.ndarray,
                 block_table: np.ndarray, samples: bool):  # fmt: skip
        self.request_id = request_id
        self.start = start  # tokens: position of the first token computed this step
        self.num_tokens = num_tokens  # tokens computed this step (1 for a decode)
        self.token_buffer = token_buffer  # int32 [>= start + num_tokens]: the request's tokens (read-only)
        self.block_table = block_table  # intp [>= ceil((start + num_tokens) / page_size)]: block ids
        self.samples = samples  # the chunk ends at the sequence's last token: sample one

    @property
    def token_ids(self) -> np.ndarray:
        """int32 [num_tokens]: this step's input token ids (a view)."""
        return self.token_buffer[self.start : self.start + self.num_tokens]

    @property
    def seq_len(self) -> int:
        """Tokens with KV after this step (the attention length of the last position)."""
        return self.start + self.num_tokens

    @property
    def positions(self) -> range:
        return range(self.start, self.start + self.num_tokens)

    def __repr__(self) -> str:
        return (f"ScheduledSeq({self.request_id!r}, start={self.start}, num_tokens={self.num_tokens}, "
                f"blocks={self.block_table.tolist()}, samples={self.samples})")  # fmt: skip


@dataclasses.dataclass(slots=True, frozen=True)
class PrefetchIntent:
    """Pages ``first_page .. first_page + num_pages - 1`` of ``token_ids`` sit only on host/disk."""

    request_id: str
    namespace: Namespace
    token_ids: np.ndarray  # int32 [(first_page + num_pages) * page_size]: the prefix to look up
    first_page: int
    num_pages: int
    tiers: np.ndarray  # uint8 [num_pages]: Tier bits of each page (HOST and/or DISK)


@dataclasses.dataclass(slots=True)
class StepPlan:
    """One step's work; see the module docstring for the order the engine follows."""

    step: int
    decodes: list[ScheduledSeq] = dataclasses.field(default_factory=list)  # one token each
    prefills: list[ScheduledSeq] = dataclasses.field(default_factory=list)  # chunks, >= 1 token
    swap_out: list[tuple[int, int]] = dataclasses.field(default_factory=list)  # (device block, host slot)
    swap_in: list[tuple[int, int]] = dataclasses.field(default_factory=list)  # (host slot, device block)
    prefetch: list[PrefetchIntent] = dataclasses.field(default_factory=list)
    preempted: dict[str, str] = dataclasses.field(default_factory=dict)  # request id -> what and why
    rejected: dict[str, str] = dataclasses.field(default_factory=dict)  # request id -> reason
    evict_target: int = 0  # cached device blocks to spill/evict to reach the low watermark
    evicted: list[int] = dataclasses.field(default_factory=list)  # blocks the scheduler evicted itself

    @property
    def num_tokens(self) -> int:
        """Tokens computed this step (decodes + prefill chunks): at most the token budget."""
        return len(self.decodes) + sum(seq.num_tokens for seq in self.prefills)

    @property
    def sequences(self) -> list[ScheduledSeq]:
        """Decodes first, then prefill chunks."""
        return self.decodes + self.prefills


def pair_tokens(plan: StepPlan, running: Mapping[str, Any], new_tokens: Mapping[str, int], vocab_limit: int) -> list:
    """[(request, scheduled seq, sampled token or None)] for the plan's still-running requests.

    Raises ValueError unless ``new_tokens`` holds exactly one token in ``[0, vocab_limit)`` per
    sampling sequence whose request is in ``running`` (tokens of requests cancelled since the
    plan was made are accepted and ignored).
    """
    work, num_sampled = [], 0
    append, get_request, get_token = work.append, running.get, new_tokens.get
    for seq in itertools.chain(plan.decodes, plan.prefills):
        request = get_request(seq.request_id)
        if request is None:  # cancelled while the step ran
            continue
        if not seq.samples:
            append((request, seq, None))
        elif (token := get_token(seq.request_id)) is not None:
            append((request, seq, token))
            num_sampled += 1
        else:
            break  # a token is missing: report below
    else:
        if len(new_tokens) == num_sampled or new_tokens.keys() <= _sampling_ids(plan):
            _check_token_range(new_tokens, vocab_limit)
            return work
    sampling = _sampling_ids(plan)
    missing = {request_id for request_id in sampling if request_id in running} - new_tokens.keys()
    unexpected = new_tokens.keys() - sampling
    raise ValueError(f"new_tokens must hold one token per sampling request of step {plan.step}: "
                     f"missing {sorted(missing)}, unexpected {sorted(unexpected)}")  # fmt: skip


def _sampling_ids(plan: StepPlan) -> set[str]:
    return {seq.request_id for seq in plan.decodes + plan.prefills if seq.samples}


def _check_token_range(new_tokens: Mapping[str, int], limit: int) -> None:
    if not new_tokens:
        return
    try:  # one C-level pass: the sum of Python ints is an int; a numpy int or a float is not
        plain = type(sum(new_tokens.values())) is int
    except Exception:  # noqa: BLE001 - only a probe: a str (TypeError), a float or numpy int beside
        plain = False  # a huge int (OverflowError), ...; the exact check below names the token
    if not plain:  # numpy ints, and anything that is not an integer, take this path
        for request_id, token in new_tokens.items():
            try:
                operator.index(token)
            except TypeError:
                raise ValueError(f"token {token!r} for request {request_id!r} must be an integer") from None
    if 0 <= min(new_tokens.values()) and max(new_tokens.values()) < limit:
        return
    request_id, token = next((rid, t) for rid, t in new_tokens.items() if not 0 <= t < limit)
    raise ValueError(f"token {token} for request {request_id!r} is out of range; expected 0 <= id < {limit}")
