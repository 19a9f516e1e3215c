"""Loading request traces in the Mooncake format.

One JSON object a line::

    {"timestamp": 0, "input_length": 6758, "output_length": 500, "hash_ids": [0, 1, 2, ...]}

- ``timestamp``: arrival time in milliseconds (int or float, >= 0).
- ``input_length`` / ``output_length``: prompt and completion lengths in tokens (int, >= 0).
- ``hash_ids``: one non-negative int per ``block_tokens``-token block of the prompt (512 in the
  Mooncake release). Equal ids at the same place mean the same prefix up to and including that
  block, so a request can reuse the blocks of its longest leading run that an earlier request
  produced. The last block may be partial: it holds
  ``input_length - block_tokens * (len(hash_ids) - 1)`` tokens.

Invariant of a loaded request: ``len(hash_ids) == ceil(input_length / block_tokens)``, so every
block holds between 1 and ``block_tokens`` tokens. Blank lines are skipped; fields other than the
four above are ignored. Bad input raises ``ValueError`` naming the file, the line number (from 1)
and the field.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from collections.abc import Iterable

MOONCAKE_BLOCK_TOKENS = 512  # tokens per hash id in the Mooncake trace release


@dataclasses.dataclass(frozen=True, slots=True)
class TraceRequest:
    """One request of a trace.

    ``timestamp_ms`` is the arrival time in milliseconds; lengths are in tokens; ``hash_ids``
    holds one id per block of the prompt (see the module docstring for the invariant).
    """

    timestamp_ms: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]

    def block_tokens(self, block_tokens: int = MOONCAKE_BLOCK_TOKENS) -> list[int]:
        """Tokens held by each block of the prompt: ``block_tokens`` except a partial last one.

        ValueError naming the counts if the request does not have ``ceil(input_length /
        block_tokens)`` ids (made by hand, or loaded at another block size): its blocks would
        hold a negative or too large count, and a replay's token hits would not add up."""
        num_blocks = len(self.hash_ids)
        if block_tokens < 1 or self.input_length < 0 or num_blocks != _blocks_for(self.input_length, block_tokens):
            raise ValueError(f"request at {self.timestamp_ms} ms has {num_blocks} hash ids but input_length="
                             f"{self.input_length} at {block_tokens=} needs ceil(input_length/block_tokens) ids "
                             "(loaded at another block size?)")  # fmt: skip
        if num_blocks == 0:
            return []
        last = self.input_length - block_tokens * (num_blocks - 1)
        return [block_tokens] * (num_blocks - 1) + [last]


def load_trace(
    path: str | os.PathLike, *, block_tokens: int = MOONCAKE_BLOCK_TOKENS
) -> list[TraceRequest]:
    """Reads a Mooncake-format trace file and returns its requests in timestamp order.

    The sort is stable, so requests with equal timestamps keep their file order (multi-turn
    conversations rely on it). Raises ``ValueError`` for a malformed line or one that is not
    UTF-8 text (a binary file), naming the file and the line; an empty file gives ``[]``.
    """
    if block_tokens < 1:
        raise ValueError(f"{block_tokens=} must be >= 1")
    source = os.fspath(path)
    with open(path, "rb") as trace_file:  # decoded line by line: an error names its line
        lines = (_decode(raw, f"{source}:{number}") for number, raw in enumerate(trace_file, start=1))
        requests = parse_trace_lines(lines, source=source, block_tokens=block_tokens)
    return sorted(requests, key=lambda request: request.timestamp_ms)


def parse_trace_lines(
    lines: Iterable[str], *, source: str = "<trace>", block_tokens: int = MOONCAKE_BLOCK_TOKENS
) -> list[TraceRequest]:
    """Parses trace lines in file order (no sorting); ``source`` names the file in errors."""
    requests = []
    for line_number, line in enumerate(lines, start=1):
        if line.strip():
            requests.append(parse_trace_line(line, f"{source}:{line_number}", block_tokens))
    return requests


def parse_trace_line(line: str, where: str, block_tokens: int) -> TraceRequest:
    """Parses and validates one line; ``where`` ("file:line") prefixes every error message."""
    try:
        record = json.loads(line)
    except json.JSONDecodeError as error:
        raise ValueError(f"{where}: not valid JSON ({error.msg})") from None
    except RecursionError:
        raise ValueError(f"{where}: not valid JSON (nested too deeply)") from None
    except ValueError as error:  # e.g. an integer past Python's digit limit for int()
        raise ValueError(f"{where}: not valid JSON ({error})") from None
    if not isinstance(record, dict):
        raise ValueError(f"{where}: expected a JSON object, got {type(record).__name__}")
    timestamp = _field(record, "timestamp", (int, float), where)
    input_length = _field(record, "input_length", (int,), where)
    output_length = _field(record, "output_length", (int,), where)
    hash_ids = _field(record, "hash_ids", (list,), where)
    for index, hash_id in enumerate(hash_ids):
        if not _is_number(hash_id, (int,)) or hash_id < 0:
            raise ValueError(
                f"{where}: field 'hash_ids'[{index}]={hash_id!r} must be a non-negative int"
            )
    expected_blocks = _blocks_for(input_length, block_tokens)
    if len(hash_ids) != expected_blocks:
        raise ValueError(
            f"{where}: field 'hash_ids' has {len(hash_ids)} ids but input_length={input_length} "
            f"needs ceil({input_length}/{block_tokens})={expected_blocks}"
        )
    return TraceRequest(float(timestamp), input_length, output_length, tuple(hash_ids))


def _blocks_for(input_length: int, block_tokens: int) -> int:
    """``ceil(input_length / block_tokens)`` in integers: a float quotient rounds lengths past
    2**53, which let a last block hold more than ``block_tokens`` tokens."""
    return -(-input_length // block_tokens)


def _decode(raw: bytes, where: str) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as error:
        raise ValueError(f"{where}: not UTF-8 text (byte {raw[error.start]:#04x} at column "
                         f"{error.start + 1}); expected JSON lines") from None


def _field(record: dict, name: str, types: tuple[type, ...], where: str):
    """Returns ``record[name]`` after checking it is present, of ``types`` and (if numeric) >= 0."""
    if name not in record:
        raise ValueError(f"{where}: missing field {name!r}")
    value = record[name]
    expected = " or ".join(t.__name__ for t in types)
    if types == (list,):
        if not isinstance(value, list):
            raise ValueError(f"{where}: field {name!r}={value!r} must be a list")
        return value
    if not _is_number(value, types) or not _finite(value) or value < 0:
        raise ValueError(f"{where}: field {name!r}={_short(value)} must be a non-negative {expected} (a finite one, "
                         "within a float's range)")  # fmt: skip
    return value


def _finite(value) -> bool:
    try:
        return math.isfinite(value)
    except OverflowError:  # an integer past a float's range (hundreds of digits)
        return False


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 40 else f"{text[:37]}..."



def _is_number(value, types: tuple[type, ...]) -> bool:
    # bool is a subclass of int, but `true` is never a length or an id.
    return isinstance(value, types) and not isinstance(value, bool)
