"""A family of generated request traces in the Mooncake format, to judge eviction policies.

Each shape is a workload a serving cluster sees, built from a seed (deterministic, in memory,
nothing downloaded) with its sizes as parameters; ``generate(shape, ...)`` builds one by name
and ``python -m kvjax.tools.trace_family SHAPE OUT.jsonl`` writes one to a file. A policy
chosen on one shape and judged on the others shows whether it generalizes.

* ``chat``: multi-turn chats behind Zipf-popular system prompts; every turn resends the whole
  history (previous prompt, the answer, a new message); some messages paste a long document.
* ``agent``: tool-use loops: a long agent prompt with tool schemas, a task, then many quick
  steps, each appending the model's action and a tool's output to a growing context.
* ``fewshot``: short queries behind few-shot templates whose popularity drifts: templates
  come into use and fall out of it over the trace.
* ``rag``: retrieval-augmented questions: a system prompt, then several documents from a
  Zipf-popular pool in retrieval order (so sharing stops at the first different document),
  then the question; some questions follow up on a recent retrieval.
* ``scan``: questions on a hot set of documents mixed with one-off long documents that are
  never seen again (scans that flush an LRU cache).
* ``chat_scan``: ``chat`` with one-off long-document jobs (summaries, batch extraction) mixed in.
* ``bursty``: popular prefixes in bursts (a shared article or repository is hot for a minute
  or two, then gone for good), over a background of one-off requests.
* ``longtail``: many users, each with a long personal context (profile, memory, a repository)
  asked about again at long, Zipf-distributed intervals.
* ``mixed``: a multi-tenant blend of ``chat``, ``agent``, ``rag`` and ``scan`` on one cache.

Hash ids follow the Mooncake rule exactly: a prompt is a sequence of text segments (each with
its own identity), cut into 512-token blocks; a block's id names its content AND everything
before it, so equal ids at a position mean an equal prefix up to the end of that block. A
segment need not align with blocks (a document behind a different system prompt shares
nothing), and a partial last block differs from the full block that later extends it.
Timestamps are whole milliseconds, so a written and re-read trace equals the generated one.
"""

from __future__ import annotations

import argparse
import itertools
import json
import numbers
from collections.abc import Callable, Iterable, Iterator, Sequence

import numpy as np

from kvjax.tools.cli import ArgumentParser, run_command
from kvjax.tools.trace import MOONCAKE_BLOCK_TOKENS, TraceRequest

__all__ = [
    "CONVERSATION_LIKE",
    "SHAPES",
    "PromptHasher",
    "agent_trace",
    "bursty_trace",
    "chat_scan_trace",
    "chat_trace",
    "fewshot_trace",
    "generate",
    "longtail_trace",
    "mixed_trace",
    "rag_trace",
    "scan_trace",
    "write_trace",
]

Segment = tuple[int, int]  # (text id, tokens): a run of one text's tokens in a prompt


class PromptHasher:
    """Mooncake hash ids of prompts built from text segments.

    ``text()`` names a new text (content never seen before); ``hash_ids(segments)`` cuts the
    prompt ``segments`` (``(text id, tokens)`` each, read from the start of that text) into
    ``block_tokens``-token blocks and returns one id per block, the last one possibly partial.
    Ids are dense ints from 0, one per distinct (prefix, block content).

    >>> hasher = PromptHasher(block_tokens=4)
    >>> system, question, other = hasher.text(), hasher.text(), hasher.text()
    >>> hasher.hash_ids([(system, 6), (question, 3)])
    (0, 1, 2)
    >>> hasher.hash_ids([(system, 6), (other, 3)])  # same first block only
    (0, 3, 4)
    """

    def __init__(self, block_tokens: int = MOONCAKE_BLOCK_TOKENS):
        if block_tokens < 1:
            raise ValueError(f"{block_tokens=} must be >= 1")
        self.block_tokens = block_tokens
        self._ids: dict[tuple[int, tuple[tuple[int, int, int], ...]], int] = {}
        self._texts = itertools.count()

    def text(self) -> int:
        return next(self._texts)

    def hash_ids(self, segments: Iterable[Segment]) -> tuple[int, ...]:
        ids: list[int] = []
        parent, pieces, filled = -1, [], 0  # pieces: (text, start, end) of the open block
        for text, length in segments:
            offset = 0
            while offset < length:
                take = min(length - offset, self.block_tokens - filled)
                pieces.append((text, offset, offset + take))
                offset, filled = offset + take, filled + take
                if filled == self.block_tokens:
                    parent = self._intern(parent, pieces)
                    ids.append(parent)
                    pieces, filled = [], 0
        if pieces:
            ids.append(self._intern(parent, pieces))
        return tuple(ids)

    def request(self, time_ms: float, segments: Sequence[Segment], output_length: int) -> TraceRequest:
        """A request arriving at ``time_ms`` (rounded to a whole ms) with prompt ``segments``."""
        input_length = sum(length for _, length in segments)
        return TraceRequest(float(round(time_ms)), input_length, int(output_length), self.hash_ids(segments))

    def _intern(self, parent: int, pieces: list[tuple[int, int, int]]) -> int:
        return self._ids.setdefault((parent, tuple(pieces)), len(self._ids))


# --- the shapes --------------------------------------------------------------------------------


def chat_trace(*, num_requests: int = 4000, num_system_prompts: int = 50, zipf_s: float = 1.0,
               mean_turns: float = 5.0, think_s: float = 30.0, paste_fraction: float = 0.15,
               conversations_per_s: float = 0.8, seed: int = 0) -> list[TraceRequest]:  # fmt: skip
    """Multi-turn chats; each turn's prompt = the previous prompt + its answer + a new message,
    which pastes a long document with probability ``paste_fraction``."""
    rng, hasher = np.random.default_rng(seed), PromptHasher()
    systems = [(hasher.text(), _lognormal(rng, 1200, 0.8, 50, 8000)) for _ in range(num_system_prompts)]
    popularity = _zipf(num_system_prompts, zipf_s)
    requests, start_ms = [], 0.0
    while not _covered(requests, num_requests, start_ms):
        start_ms += rng.exponential(1000.0 / conversations_per_s)
        history = [systems[int(rng.choice(num_system_prompts, p=popularity))]]
        time_ms = start_ms
        for _ in range(int(rng.geometric(1.0 / mean_turns))):
            pasted = rng.random() < paste_fraction
            message = _lognormal(rng, 6000, 0.8, 500, 48000) if pasted else _lognormal(rng, 150, 1.0, 2, 4000)
            history = history + [(hasher.text(), message)]
            answer = _lognormal(rng, 300, 0.8, 5, 3000)
            requests.append(hasher.request(time_ms, history, answer))
            history = history + [(hasher.text(), answer)]
            time_ms += 1000.0 * _lognormal(rng, think_s, 1.0, 2.0, 1800.0, integer=False)
    return _first(requests, num_requests)


def agent_trace(*, num_requests: int = 4000, num_agents: int = 12, zipf_s: float = 1.0,
                mean_steps: float = 15.0, step_s: float = 4.0, tasks_per_s: float = 0.25,
                seed: int = 0) -> list[TraceRequest]:  # fmt: skip
    """Tool loops: agent prompt + task, then steps each adding an action and a tool output."""
    rng, hasher = np.random.default_rng(seed), PromptHasher()
    agents = [hasher.text() for _ in range(num_agents)]
    agent_tokens = [_lognormal(rng, 3000, 0.6, 500, 16000) for _ in agents]
    popularity = _zipf(num_agents, zipf_s)
    requests, start_ms = [], 0.0
    while not _covered(requests, num_requests, start_ms):
        start_ms += rng.exponential(1000.0 / tasks_per_s)
        agent = int(rng.choice(num_agents, p=popularity))
        context = [(agents[agent], agent_tokens[agent]), (hasher.text(), _lognormal(rng, 400, 1.0, 20, 8000))]
        time_ms = start_ms
        for _ in range(int(rng.geometric(1.0 / mean_steps))):
            action = _lognormal(rng, 120, 0.7, 10, 2000)
            requests.append(hasher.request(time_ms, context, action))
            context = context + [(hasher.text(), action), (hasher.text(), _lognormal(rng, 600, 1.2, 10, 16000))]
            time_ms += 1000.0 * _lognormal(rng, step_s, 0.8, 0.2, 120.0, integer=False)
    return _first(requests, num_requests)


def fewshot_trace(*, num_requests: int = 4000, num_templates: int = 120, active_templates: int = 24,
                  zipf_s: float = 1.0, requests_per_s: float = 4.0, seed: int = 0) -> list[TraceRequest]:  # fmt: skip
    """Queries behind few-shot templates; the ``active_templates`` in use slide through all
    ``num_templates`` over the trace (popularity Zipf within the active window)."""
    rng, hasher = np.random.default_rng(seed), PromptHasher()
    templates = [(hasher.text(), _lognormal(rng, 2500, 0.7, 300, 12000)) for _ in range(num_templates)]
    popularity = _zipf(active_templates, zipf_s)
    requests = []
    for index, time_ms in enumerate(_arrivals(rng, num_requests, requests_per_s)):
        window = index * (num_templates - active_templates) // max(num_requests, 1)
        ranks = np.random.default_rng([seed, window]).permutation(active_templates)  # stable per window
        template = templates[window + int(ranks[rng.choice(active_templates, p=popularity)])]
        query = (hasher.text(), _lognormal(rng, 150, 0.8, 5, 2000))
        requests.append(hasher.request(time_ms, [template, query], _lognormal(rng, 80, 0.8, 1, 1000)))
    return requests


def rag_trace(*, num_requests: int = 4000, num_documents: int = 3000, zipf_s: float = 0.9,
              min_docs: int = 2, max_docs: int = 6, follow_up_fraction: float = 0.3,
              requests_per_s: float = 4.0, seed: int = 0) -> list[TraceRequest]:  # fmt: skip
    """System prompt + documents in retrieval order + question; a follow-up reuses a recent
    retrieval (same documents, same order) with a new question."""
    rng, hasher = np.random.default_rng(seed), PromptHasher()
    system = (hasher.text(), 1200)
    documents = [(hasher.text(), _lognormal(rng, 900, 0.7, 100, 8000)) for _ in range(num_documents)]
    popularity = _zipf(num_documents, zipf_s)
    recent: list[list[Segment]] = []
    requests = []
    for time_ms in _arrivals(rng, num_requests, requests_per_s):
        if recent and rng.random() < follow_up_fraction:
            retrieved = recent[-1 - min(int(rng.geometric(0.2)) - 1, len(recent) - 1)]
        else:
            count = int(rng.integers(min_docs, max_docs + 1))
            retrieved = [documents[i] for i in rng.choice(num_documents, count, replace=False, p=popularity)]
            recent = (recent + [retrieved])[-64:]
        question = (hasher.text(), _lognormal(rng, 60, 0.6, 5, 600))
        requests.append(hasher.request(time_ms, [system, *retrieved, question], _lognormal(rng, 200, 0.7, 5, 2000)))
    return requests


def scan_trace(*, num_requests: int = 4000, num_hot_documents: int = 80, scan_fraction: float = 0.5,
               zipf_s: float = 0.9, requests_per_s: float = 4.0, seed: int = 0) -> list[TraceRequest]:  # fmt: skip
    """Questions on Zipf-popular hot documents mixed with one-off long documents."""
    rng, hasher = np.random.default_rng(seed), PromptHasher()
    hot = [(hasher.text(), _lognormal(rng, 12000, 0.7, 2000, 64000)) for _ in range(num_hot_documents)]
    popularity = _zipf(num_hot_documents, zipf_s)
    requests = []
    for time_ms in _arrivals(rng, num_requests, requests_per_s):
        if rng.random() < scan_fraction:
            document = (hasher.text(), _lognormal(rng, 20000, 0.6, 4000, 150000))  # read once
        else:
            document = hot[int(rng.choice(num_hot_documents, p=popularity))]
        question = (hasher.text(), int(rng.integers(20, 500)))
        requests.append(hasher.request(time_ms, [document, question], int(rng.integers(10, 300))))
    return requests


def chat_scan_trace(*, num_requests: int = 4000, scan_fraction: float = 0.15,
                    seed: int = 0) -> list[TraceRequest]:  # fmt: skip
    """``chat`` with a ``scan_fraction`` of one-off long documents (``scan`` with only scans)
    arriving over the same span."""
    num_scans = round(num_requests * scan_fraction)
    chats = chat_trace(num_requests=num_requests - num_scans, seed=seed)
    span_s = max(chats[-1].timestamp_ms / 1000.0 if chats else 0.0, 1.0)
    scans = scan_trace(num_requests=num_scans, scan_fraction=1.0, requests_per_s=num_scans / span_s,
                       seed=seed + 1)  # fmt: skip
    return _merge([chats, scans], num_requests)


def bursty_trace(*, num_requests: int = 4000, bursts_per_min: float = 6.0, burst_s: float = 120.0,
                 burst_requests_per_s: float = 0.25, background_per_s: float = 1.5,
                 seed: int = 0) -> list[TraceRequest]:  # fmt: skip
    """Shared prefixes hot for a burst, then never used again, over one-off background requests."""
    rng, hasher = np.random.default_rng(seed), PromptHasher()
    requests, start_ms, background_ms = [], 0.0, 0.0
    while not _covered(requests, num_requests, start_ms):
        start_ms += rng.exponential(60_000.0 / bursts_per_min)
        topic = (hasher.text(), _lognormal(rng, 12000, 0.8, 1000, 64000))
        end_ms = start_ms + 1000.0 * _lognormal(rng, burst_s, 0.7, 5.0, 600.0, integer=False)
        time_ms = start_ms
        while time_ms < end_ms:
            question = (hasher.text(), _lognormal(rng, 100, 0.8, 5, 2000))
            requests.append(hasher.request(time_ms, [topic, question], _lognormal(rng, 200, 0.7, 5, 2000)))
            time_ms += rng.exponential(1000.0 / burst_requests_per_s)
        while background_ms < start_ms:
            background_ms += rng.exponential(1000.0 / background_per_s)
            one_off = (hasher.text(), _lognormal(rng, 3000, 1.0, 50, 32000))
            requests.append(hasher.request(background_ms, [one_off], _lognormal(rng, 200, 0.7, 5, 2000)))
    return _first(requests, num_requests)


def longtail_trace(*, num_requests: int = 4000, num_users: int = 2500, zipf_s: float = 0.8,
                   requests_per_s: float = 3.0, seed: int = 0) -> list[TraceRequest]:  # fmt: skip
    """System prompt + a user's long personal context + question; users Zipf-popular."""
    rng, hasher = np.random.default_rng(seed), PromptHasher()
    system = (hasher.text(), 700)
    contexts = [(hasher.text(), _lognormal(rng, 5000, 0.8, 500, 40000)) for _ in range(num_users)]
    order = rng.permutation(num_users)  # popularity unrelated to context length or user id
    popularity = _zipf(num_users, zipf_s)
    requests = []
    for time_ms in _arrivals(rng, num_requests, requests_per_s):
        context = contexts[int(order[rng.choice(num_users, p=popularity)])]
        question = (hasher.text(), _lognormal(rng, 80, 0.8, 5, 1000))
        requests.append(hasher.request(time_ms, [system, context, question], _lognormal(rng, 250, 0.7, 5, 2000)))
    return requests


def mixed_trace(*, num_requests: int = 4000, seed: int = 0) -> list[TraceRequest]:
    """Tenants of ``chat``, ``agent``, ``rag`` and ``scan`` sharing one cache (ids kept apart)."""
    shares = {"chat": 0.4, "agent": 0.3, "rag": 0.2, "scan": 0.1}
    counts = [int(num_requests * share) for share in shares.values()]  # rounded down, then the
    by_remainder = sorted(range(len(counts)), key=lambda i: -(num_requests * list(shares.values())[i] % 1))
    for i in by_remainder[: num_requests - sum(counts)]:  # largest remainders get one more: they sum up
        counts[i] += 1
    return _merge([SHAPES[shape](num_requests=count, seed=seed * 16 + index)
                   for index, (shape, count) in enumerate(zip(shares, counts))], num_requests)  # fmt: skip


SHAPES: dict[str, Callable[..., list[TraceRequest]]] = {
    "chat": chat_trace,
    "agent": agent_trace,
    "fewshot": fewshot_trace,
    "rag": rag_trace,
    "scan": scan_trace,
    "chat_scan": chat_scan_trace,
    "bursty": bursty_trace,
    "longtail": longtail_trace,
    "mixed": mixed_trace,
}

CONVERSATION_LIKE = frozenset({"chat", "agent", "chat_scan", "mixed"})
"""Shapes whose prompts grow by resending a history: the ones a default must serve best."""


def generate(shape: str, *, num_requests: int = 4000, seed: int = 0, **kwargs) -> list[TraceRequest]:
    """The trace of ``shape`` (a key of ``SHAPES``), sorted by arrival time."""
    if shape not in SHAPES:
        raise ValueError(f"unknown trace shape {shape!r}; valid shapes: {sorted(SHAPES)}")
    for name, value in (("num_requests", num_requests), ("seed", seed)):  # numpy's own error named neither
        if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 0:
            raise ValueError(f"{name}={value!r} must be >= 0 (an int)")
    return SHAPES[shape](num_requests=num_requests, seed=seed, **kwargs)


def write_trace(requests: Iterable[TraceRequest], path: str) -> None:
    """Writes ``requests`` as Mooncake JSONL (one object a line, timestamps in whole ms)."""
    with open(path, "w", encoding="utf-8") as trace_file:
        for request in requests:
            record = {"timestamp": round(request.timestamp_ms), "input_length": request.input_length,
                      "output_length": request.output_length, "hash_ids": list(request.hash_ids)}  # fmt: skip
            trace_file.write(json.dumps(record) + "\n")


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m kvjax.tools.trace_family SHAPE OUT``; errors are one line (``kvjax.tools.cli``)."""
    parser = ArgumentParser(prog="python -m kvjax.tools.trace_family",
                            description="Write a generated Mooncake-format trace.")  # fmt: skip
    parser.add_argument("shape", choices=sorted(SHAPES))
    parser.add_argument("out", help="output path (JSONL)")
    parser.add_argument("--num-requests", type=int, default=4000)
    parser.add_argument("--seed", type=int, default=0)
    parser.set_defaults(func=_write_command)
    return run_command(parser.parse_args(argv), parser.prog)


def _write_command(args: argparse.Namespace) -> None:
    requests = generate(args.shape, num_requests=args.num_requests, seed=args.seed)
    write_trace(requests, args.out)
    print(f"wrote {len(requests)} {args.shape} requests, {sum(len(r.hash_ids) for r in requests)} blocks, to {args.out}")


# --- helpers -----------------------------------------------------------------------------------

def _merge(traces: list[list[TraceRequest]], count: int) -> list[TraceRequest]:
    """Traces merged by arrival, each trace's ids shifted past the previous ones' (no sharing)."""
    merged, offset = [], 0
    for requests in traces:
        merged += [TraceRequest(r.timestamp_ms, r.input_length, r.output_length,
                                tuple(offset + h for h in r.hash_ids)) for r in requests]  # fmt: skip
        offset = 1 + max((h for r in merged for h in r.hash_ids), default=offset - 1)
    return _first(merged, count)


def _covered(requests: list[TraceRequest], count: int, next_start_ms: float) -> bool:
    """Whether sessions starting at ``next_start_ms`` or later can no longer be among the first
    ``count`` arrivals (so a truncated trace keeps every session's later turns, and its end looks
    like its middle)."""
    if count == 0:  # nothing to cover: no session is needed
        return True
    if len(requests) < count:
        return False
    return next_start_ms > sorted(request.timestamp_ms for request in requests)[count - 1]


def _first(requests: list[TraceRequest], count: int) -> list[TraceRequest]:
    """The first ``count`` requests by arrival (stable: a conversation's turns keep their order)."""
    return sorted(requests, key=lambda request: request.timestamp_ms)[:count]


def _arrivals(rng: np.random.Generator, count: int, per_s: float) -> Iterator[float]:
    """``count`` Poisson arrival times (ms), ``per_s`` a second on average."""
    time_ms = 0.0
    for _ in range(count):
        time_ms += rng.exponential(1000.0 / per_s)
        yield time_ms


def _zipf(count: int, exponent: float) -> np.ndarray:
    weights = 1.0 / np.arange(1, count + 1) ** exponent
    return weights / weights.sum()


def _lognormal(rng: np.random.Generator, median: float, sigma: float, low: float, high: float, *,
               integer: bool = True):  # fmt: skip
    """A lognormal draw with ``median`` and log-spread ``sigma``, clipped to [low, high]."""
    value = min(max(median * float(np.exp(sigma * rng.standard_normal())), low), high)
    return round(value) if integer else value


if __name__ == "__main__":
    raise SystemExit(main())
