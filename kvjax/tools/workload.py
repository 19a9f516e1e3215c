"""The demo's built-in workload, and the driver that feeds a workload to an engine.

Three kinds of sessions, all generated from a seed (deterministic, nothing downloaded):

* ``system_prompt``: single questions behind one of a few long system prompts (the common
  case of a chat product: the system prompt is the shared prefix), all of one prompt's
  questions together or, with ``rotate_prompts``, one prompt after another in turn;
* ``multi_turn``: conversations whose every turn resends the whole history (previous prompt +
  the model's reply + a new user message), so each turn's prefix is the previous turn;
* ``few_shot``: queries behind one of a few few-shot templates (instructions + worked examples).

Sessions are spread over tenants (namespaces); one system prompt is used by every tenant,
so isolation shows up as ``other_namespace`` misses.

``drive`` feeds a workload to an engine: a session's first request arrives at its
``arrival_step`` (engine steps, so cached and uncached runs see the same arrival pattern),
and each later turn as soon as the previous one finishes (closed loop). ``isolate=True``
gives every request a namespace of its own: the same work with a cache that never hits.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Callable

import numpy as np

from kvjax.cache.block_keys import Namespace
from kvjax.serving.engine_events import Event, FinishEvent

__all__ = ["Session", "WorkloadSpec", "WorkloadResult", "build_workload", "drive"]

_WORDS = (
    "account answer batch budget cache careful clear concise context customer data detail "
    "device engine error example explain fact format friendly helpful history honest input "
    "key latency memory model network number order output page policy precise prefix prompt "
    "question reason reply request result review safe schedule short step summary system "
    "table tenant token tool topic user value verify window write"
).split()


@dataclasses.dataclass(frozen=True, slots=True)
class Session:
    """One user's requests: ``prefix`` then one user message per turn.

    Turn 1's prompt is ``prefix + user(turns[0])``; turn k's is turn k-1's prompt tokens, the
    model's reply tokens, then ``user(turns[k-1])``.
    """

    session_id: str
    kind: str  # "system_prompt" | "multi_turn" | "few_shot"
    namespace: str
    prefix: str
    turns: tuple[str, ...]
    arrival_step: int
    max_new_tokens: int


@dataclasses.dataclass(frozen=True, slots=True)
class WorkloadSpec:
    """Sizes of the built-in workload (characters = tokens with the byte tokenizer)."""

    system_prompts: int = 3
    questions_per_system_prompt: int = 8
    conversations: int = 6
    turns_per_conversation: int = 4
    few_shot_templates: int = 2
    queries_per_template: int = 6
    examples_per_template: int = 4
    system_prompt_chars: int = 480
    max_new_tokens: int = 16
    arrival_every: int = 2  # engine steps between two sessions' arrivals
    # Questions come to each system prompt in turn (p0 q0, p1 q0, ..., p0 q1, ...) instead of
    # all of one prompt's at once: with more prompts than the device pool holds, a prompt's
    # next question finds its prefix moved down to host or disk.
    rotate_prompts: bool = False
    tenants: tuple[str, ...] = ("tenant-a", "tenant-b")
    seed: int = 0

    def __post_init__(self):
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if isinstance(value, int) and value < (1 if field.name in _POSITIVE else 0):
                raise ValueError(f"{field.name}={value} must be >= {1 if field.name in _POSITIVE else 0}")
        if not self.tenants:
            raise ValueError("tenants must name at least one tenant")


_POSITIVE = {"system_prompt_chars", "max_new_tokens", "turns_per_conversation"}


@dataclasses.dataclass(slots=True)
class WorkloadResult:
    """What ``drive`` saw: generated tokens and finish events by request id, in finish order."""

    outputs: dict[str, np.ndarray] = dataclasses.field(default_factory=dict)
    finishes: dict[str, FinishEvent] = dataclasses.field(default_factory=dict)
    num_steps: int = 0


def build_workload(spec: WorkloadSpec | None = None) -> list[Session]:
    """The sessions of ``spec`` in arrival order, kinds interleaved."""
    spec = spec or WorkloadSpec()
    rng = random.Random(spec.seed)
    by_kind = [_system_prompt_sessions(spec, rng), _multi_turn_sessions(spec, rng), _few_shot_sessions(spec, rng)]
    interleaved = [s for group in _round_robin(by_kind) for s in group]
    return [dataclasses.replace(s, arrival_step=i * spec.arrival_every) for i, s in enumerate(interleaved)]


def drive(engine, sessions: list[Session], *, isolate: bool = False,
          on_event: Callable[[Event], None] | None = None) -> WorkloadResult:  # fmt: skip
    """Run ``sessions`` on ``engine`` to the end (see the module docstring)."""
    result = WorkloadResult()
    queue = sorted(sessions, key=lambda s: s.arrival_step)
    live: dict[str, tuple[Session, int]] = {}  # request id -> (session, turn)
    next_arrival = 0
    while next_arrival < len(queue) or engine.has_unfinished:
        while next_arrival < len(queue) and queue[next_arrival].arrival_step <= result.num_steps:
            session = queue[next_arrival]
            _submit(engine, live, session, 0, None, isolate)
            next_arrival += 1
        for event in engine.step():
            if on_event is not None:
                on_event(event)
            if isinstance(event, FinishEvent):
                result.outputs[event.request_id] = event.output_token_ids
                result.finishes[event.request_id] = event
                session, turn = live.pop(event.request_id)
                if event.status == "finished" and turn + 1 < len(session.turns):
                    history = np.concatenate([event.prompt_token_ids, event.output_token_ids])
                    _submit(engine, live, session, turn + 1, history, isolate)
        result.num_steps += 1
    return result


# --- helpers ---------------------------------------------------------------------------------


def _submit(engine, live, session: Session, turn: int, history, isolate: bool) -> None:
    request_id = f"{session.session_id}/t{turn}"
    namespace = Namespace(tenant=session.namespace, salt=request_id if isolate else "")
    user = f"\nUser: {session.turns[turn]}\nAssistant:"
    if history is None:
        engine.add_request(request_id, prompt=session.prefix + user, max_new_tokens=session.max_new_tokens,
                           namespace=namespace)  # fmt: skip
    else:
        prompt = np.concatenate([history, _continuation(engine.tokenizer, user)])
        engine.add_request(request_id, tokens=prompt, max_new_tokens=session.max_new_tokens, namespace=namespace)
    live[request_id] = (session, turn)


def _continuation(tokenizer, text: str) -> np.ndarray:
    """``text``'s ids to append to a conversation: without the BOS (or EOS) the tokenizer adds
    to a whole prompt, which mid-conversation would be a token the model never sees there."""
    ids = np.asarray(tokenizer.encode(text), np.int32)
    bos, eos = getattr(tokenizer, "bos_id", None), getattr(tokenizer, "eos_id", None)
    if len(ids) and bos is not None and ids[0] == bos and getattr(tokenizer, "add_bos", True):
        ids = ids[1:]
    if len(ids) and eos is not None and ids[-1] == eos and getattr(tokenizer, "add_eos", True):
        ids = ids[:-1]
    return ids


def _sentence(rng: random.Random, num_words: int) -> str:
    words = [rng.choice(_WORDS) for _ in range(num_words)]
    return " ".join(words).capitalize() + "."


def _paragraph(rng: random.Random, num_chars: int) -> str:
    text = ""
    while len(text) < num_chars:
        text += _sentence(rng, rng.randint(6, 12)) + " "
    return text[:num_chars].rstrip() + "\n"


def _system_prompt_sessions(spec: WorkloadSpec, rng: random.Random) -> list[Session]:
    sessions = []
    for p in range(spec.system_prompts):
        prefix = f"System: You are assistant #{p}. " + _paragraph(rng, spec.system_prompt_chars)
        for q in range(spec.questions_per_system_prompt):
            tenant = spec.tenants[(p + q) % len(spec.tenants)] if p == 0 else spec.tenants[p % len(spec.tenants)]
            question = f"Question {q}: " + _sentence(rng, rng.randint(5, 9))
            sessions.append(Session(f"sys{p}-q{q}", "system_prompt", tenant, prefix, (question,), 0,
                                    spec.max_new_tokens))  # fmt: skip
    if spec.rotate_prompts:
        per_prompt = spec.questions_per_system_prompt
        sessions = [sessions[p * per_prompt + q] for q in range(per_prompt) for p in range(spec.system_prompts)]
    return sessions


def _multi_turn_sessions(spec: WorkloadSpec, rng: random.Random) -> list[Session]:
    prefix = "System: You are a patient tutor. " + _paragraph(rng, spec.system_prompt_chars // 2)
    sessions = []
    for c in range(spec.conversations):
        turns = tuple(_sentence(rng, rng.randint(8, 14)) for _ in range(spec.turns_per_conversation))
        tenant = spec.tenants[c % len(spec.tenants)]
        sessions.append(Session(f"chat{c}", "multi_turn", tenant, prefix, turns, 0, spec.max_new_tokens))
    return sessions


def _few_shot_sessions(spec: WorkloadSpec, rng: random.Random) -> list[Session]:
    sessions = []
    for t in range(spec.few_shot_templates):
        examples = "".join(f"Input: {_sentence(rng, 7)}\nLabel: {rng.choice(_WORDS)}\n" for _ in range(spec.examples_per_template))
        prefix = f"Task {t}: label each input with one word.\n" + examples
        tenant = spec.tenants[t % len(spec.tenants)]
        for q in range(spec.queries_per_template):
            query = f"Input: {_sentence(rng, 7)}"
            sessions.append(Session(f"fewshot{t}-q{q}", "few_shot", tenant, prefix, (query,), 0,
                                    max(1, spec.max_new_tokens // 2)))  # fmt: skip
    return sessions


def _round_robin(groups: list[list[Session]]) -> list[list[Session]]:
    """Rows of one session per kind, so the kinds arrive interleaved."""
    rows = []
    for i in range(max((len(g) for g in groups), default=0)):
        rows.append([g[i] for g in groups if i < len(g)])
    return rows
