"""The scheduler's consistency checks (``Scheduler.check_invariants`` calls them; tests drive them)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

from kvjax.serving.request import Request, RequestStatus
from kvjax.serving.step_plan import ScheduledSeq, StepPlan

if TYPE_CHECKING:
    from kvjax.serving.scheduler import Scheduler

__all__ = ["check_scheduler"]


def check_scheduler(scheduler: Scheduler, requests: Mapping[str, Request], prefilling: Mapping[str, Request]) -> None:
    """Raise RuntimeError unless the request sets, each request's state and the plan in flight agree.

    ``requests`` are the live requests, ``prefilling`` the running ones still prefilling.
    """
    running, waiting = scheduler.running, scheduler.waiting
    waiting_ids = {request.request_id for request in waiting}
    if running.keys() & waiting_ids:
        raise RuntimeError(f"requests both running and waiting: {sorted(running.keys() & waiting_ids)}")
    if requests.keys() != running.keys() | waiting_ids:
        raise RuntimeError(f"live requests {sorted(requests)} are not running + waiting "
                           f"{sorted(running)} + {sorted(waiting_ids)}")  # fmt: skip
    if len(running) > scheduler.config.max_num_seqs:
        raise RuntimeError(f"{len(running)} running requests > max_num_seqs={scheduler.config.max_num_seqs}")
    expected_prefilling = [rid for rid, request in running.items() if request.is_prefill]
    if list(prefilling) != expected_prefilling:
        raise RuntimeError(f"prefilling set {list(prefilling)} != running requests still prefilling "
                           f"{expected_prefilling}")  # fmt: skip
    plan = scheduler.in_flight
    scheduled = {} if plan is None else {seq.request_id: seq for seq in plan.decodes + plan.prefills}
    for request_id, request in running.items():
        _check_running(scheduler, request, scheduled.get(request_id))
    for request in waiting:
        _check_waiting(scheduler, request)
    if plan is not None:
        _check_plan(scheduler, plan)


def _check_running(scheduler: Scheduler, request: Request, seq: ScheduledSeq | None) -> None:
    rid, handle = request.request_id, request.handle
    if request.status is not RequestStatus.RUNNING or handle is None or not handle.alive:
        raise RuntimeError(f"running request {rid!r} is {request.status.value} with handle {handle!r}")
    if request.swap_slots:
        raise RuntimeError(f"running request {rid!r} still holds swap slots {request.swap_slots}")
    if not 0 <= request.num_computed_tokens < request.num_tokens:
        raise RuntimeError(f"running request {rid!r} has {request.num_computed_tokens} computed tokens "
                           f"of {request.num_tokens}")  # fmt: skip
    needed = request.num_computed_tokens if seq is None else seq.start + seq.num_tokens
    if handle.num_tokens < needed or len(handle.block_ids) * scheduler.page_size < needed:
        raise RuntimeError(f"running request {rid!r} needs room for {needed} tokens; its handle has "
                           f"{handle.num_tokens} in {len(handle.block_ids)} blocks")  # fmt: skip
    if seq is None:
        if scheduler.in_flight is not None and not request.is_prefill:
            raise RuntimeError(f"running decode {rid!r} was skipped by step {scheduler.in_flight.step}")
        return
    if seq.start != request.num_computed_tokens or list(seq.block_table) != handle.block_table:
        raise RuntimeError(f"plan entry {seq!r} disagrees with request {rid!r} "
                           f"({request.num_computed_tokens} computed, blocks {handle.block_table})")  # fmt: skip
    if seq.samples != (seq.start + seq.num_tokens == request.num_tokens):
        raise RuntimeError(f"plan entry {seq!r} samples={seq.samples} for a request of {request.num_tokens} tokens")
    if list(seq.token_ids) != request.token_ids[seq.start : seq.start + seq.num_tokens].tolist():
        raise RuntimeError(f"plan entry {seq!r} carries the wrong input tokens")


def _check_waiting(scheduler: Scheduler, request: Request) -> None:
    rid = request.request_id
    if request.handle is not None:
        raise RuntimeError(f"waiting request {rid!r} still holds handle {request.handle!r}")
    pages = -(-request.num_computed_tokens // scheduler.page_size)
    if request.status is RequestStatus.SWAPPED:
        if pages == 0 or len(request.swap_slots) != pages or request.num_computed_tokens >= request.num_tokens:
            raise RuntimeError(f"swapped request {rid!r} has {len(request.swap_slots)} slots for "
                               f"{request.num_computed_tokens} computed tokens")  # fmt: skip
    elif request.status is not RequestStatus.WAITING or request.num_computed_tokens or request.swap_slots:
        raise RuntimeError(f"queued request {rid!r} is {request.status.value} with "
                           f"{request.num_computed_tokens} computed tokens and slots {request.swap_slots}")  # fmt: skip


def _check_plan(scheduler: Scheduler, plan: StepPlan) -> None:
    if plan.num_tokens > scheduler.config.token_budget:
        raise RuntimeError(f"step {plan.step} schedules {plan.num_tokens} tokens > "
                           f"token_budget={scheduler.config.token_budget}")  # fmt: skip
    ids = [seq.request_id for seq in plan.decodes + plan.prefills]
    if len(set(ids)) != len(ids):
        raise RuntimeError(f"step {plan.step} schedules a request twice: {ids}")
    if any(seq.num_tokens != 1 for seq in plan.decodes) or any(seq.num_tokens < 1 for seq in plan.prefills):
        raise RuntimeError(f"step {plan.step} has a decode of != 1 token or an empty prefill chunk")
    if any(seq.num_tokens > scheduler.config.max_prefill_chunk for seq in plan.prefills):
        raise RuntimeError(f"step {plan.step} has a prefill chunk over max_prefill_chunk")
