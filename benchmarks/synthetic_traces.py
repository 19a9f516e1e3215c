"""Synthetic Mooncake-format traces with a known structure, to check eviction policies.

Two generators, deliberately unlike each other and unlike the shared Mooncake trace, so a
policy tuned to one trace shows it:

- ``chat_trace``: Zipf-popular system prompts shared by many conversations, and multi-turn
  conversations whose prompt grows every turn (each turn's prompt is the previous prompt, the
  previous answer and a new message). Turns of one conversation are seconds apart and
  interleave with other conversations.
- ``scan_trace``: a hot set of documents asked about again and again (Zipf popularity), mixed
  with one-off long documents that are never seen twice (scans that flush an LRU cache).

Ids follow the Mooncake rule: one id per 512-token block, equal ids only for an equal prefix,
and the partial last block of a prompt gets an id of its own (its content differs from the
full block that later extends it). Write one with ``python benchmarks/synthetic_traces.py
chat out.jsonl``.
"""

from __future__ import annotations

import json
import sys

import numpy as np

from kvjax.tools.trace import MOONCAKE_BLOCK_TOKENS, TraceRequest

__all__ = ["GENERATORS", "chat_trace", "scan_trace", "write_trace"]

BLOCK = MOONCAKE_BLOCK_TOKENS


def chat_trace(
    *,
    num_conversations: int = 1500,
    num_system_prompts: int = 60,
    zipf_s: float = 1.1,
    seed: int = 0,
) -> list[TraceRequest]:
    """Multi-turn chats on Zipf-popular system prompts; requests sorted by arrival (ms)."""
    rng = np.random.default_rng(seed)
    ids = _IdSource()
    prompts = [ids.take(int(rng.integers(2, 16))) for _ in range(num_system_prompts)]
    popularity = _zipf_weights(num_system_prompts, zipf_s)
    requests = []
    start_ms = 0.0
    for _ in range(num_conversations):
        start_ms += rng.exponential(400.0)  # ~2.5 new conversations a second
        history = list(prompts[rng.choice(num_system_prompts, p=popularity)])
        history_tokens = len(history) * BLOCK
        time_ms = start_ms
        for _turn in range(1 + rng.geometric(0.3)):  # 1 + ~3.3 turns
            message = int(rng.integers(50, 1500))
            input_length = history_tokens + message
            full = input_length // BLOCK
            hash_ids = history[:full] if full <= len(history) else history + ids.take(full - len(history))
            if input_length % BLOCK:
                hash_ids = hash_ids + ids.take(1)  # the partial block: content of its own
            output_length = int(rng.integers(50, 800))
            requests.append(TraceRequest(time_ms, input_length, output_length, tuple(hash_ids)))
            history = list(hash_ids[:full])
            history_tokens = full * BLOCK  # the partial tail is rewritten with the answer
            history_tokens += (input_length - full * BLOCK) + output_length
            time_ms += rng.exponential(20_000.0)  # reading and typing: ~20 s between turns
    return sorted(requests, key=lambda request: request.timestamp_ms)


def scan_trace(
    *,
    num_requests: int = 4000,
    num_hot_documents: int = 80,
    scan_fraction: float = 0.5,
    zipf_s: float = 0.9,
    seed: int = 0,
) -> list[TraceRequest]:
    """Questions on Zipf-popular hot documents mixed with one-off long documents."""
    rng = np.random.default_rng(seed)
    ids = _IdSource()
    hot = [ids.take(int(rng.integers(8, 60))) for _ in range(num_hot_documents)]
    popularity = _zipf_weights(num_hot_documents, zipf_s)
    requests = []
    time_ms = 0.0
    for _ in range(num_requests):
        time_ms += rng.exponential(250.0)
        if rng.random() < scan_fraction:
            document = ids.take(int(rng.integers(40, 300)))  # read once, never again
        else:
            document = hot[rng.choice(num_hot_documents, p=popularity)]
        question = int(rng.integers(20, 500))
        input_length = len(document) * BLOCK + question
        hash_ids = tuple(document) + tuple(ids.take(1))
        requests.append(TraceRequest(time_ms, input_length, int(rng.integers(10, 300)), hash_ids))
    return requests


GENERATORS = {"chat": chat_trace, "scan": scan_trace}


def write_trace(requests: list[TraceRequest], path: str) -> None:
    """Writes ``requests`` as Mooncake JSONL (timestamps rounded to whole milliseconds)."""
    with open(path, "w", encoding="utf-8") as trace_file:
        for request in requests:
            record = {"timestamp": round(request.timestamp_ms), "input_length": request.input_length,
                      "output_length": request.output_length, "hash_ids": list(request.hash_ids)}  # fmt: skip
            trace_file.write(json.dumps(record) + "\n")


class _IdSource:
    """Fresh block ids: every call returns ids never handed out before."""

    def __init__(self):
        self.next_id = 0

    def take(self, count: int) -> list[int]:
        first, self.next_id = self.next_id, self.next_id + count
        return list(range(first, self.next_id))


def _zipf_weights(count: int, exponent: float) -> np.ndarray:
    weights = 1.0 / np.arange(1, count + 1) ** exponent
    return weights / weights.sum()


if __name__ == "__main__":
    if len(sys.argv) != 3 or sys.argv[1] not in GENERATORS:
        sys.exit(f"usage: python {sys.argv[0]} {{{'|'.join(GENERATORS)}}} OUT.jsonl")
    write_trace(GENERATORS[sys.argv[1]](), sys.argv[2])
