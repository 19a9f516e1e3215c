"""Stop strings: a request ends when its generated text contains one (OpenAI's and vLLM's ``stop``).

The text is the generated tokens decoded with the engine's tokenizer. A request ends at the
token whose text first holds a stop string; its answer is the text cut at the earliest
occurrence of any stop string (the stop string itself left out, as OpenAI does), while its
output tokens keep every generated token (as vLLM does).

``min_tokens`` (vLLM's): before the request has generated that many tokens nothing ends it,
and a stop string counts only if it ends in text of the ``min_tokens``-th token or later; one
wholly inside the text of the first ``min_tokens - 1`` tokens is ordinary text.

Each check decodes the whole output and searches all of it: O(output length) per token. A
window over the newest text would be cheaper but is only correct for a decoder whose text of
a prefix is a prefix of the later text, which a plugged-in tokenizer need not be.

The same :class:`StopStrings` serves the engine (``Request.stop_when``) and the HTTP stream
(``kvjax.cluster.openai_api.TextStream``), so a stream cuts where the final answer does.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

import numpy as np

__all__ = ["StopStrings", "as_stop_strings", "stop_checker"]

_log = logging.getLogger(__name__)


def as_stop_strings(stop) -> tuple[str, ...]:
    """``stop`` as a tuple of non-empty strings: a str is one stop string; a sequence of str
    is several; an empty sequence is none. ValueError naming the value otherwise."""
    expected = "a non-empty str or a sequence of non-empty strs"
    if isinstance(stop, str):
        stop = (stop,)
    elif isinstance(stop, (bytes, bytearray)) or not isinstance(stop, Sequence):
        raise ValueError(f"stop={stop!r} must be {expected} (stop strings)")
    stop = tuple(stop)
    bad = [item for item in stop if not isinstance(item, str) or not item]
    if bad:
        raise ValueError(f"stop={stop!r} must be {expected}; {bad[0]!r} is not a non-empty str")
    return stop


def stop_checker(stop, tokenizer, min_tokens: int = 0) -> StopStrings | None:
    """The ``Request.stop_when`` of stop strings ``stop`` searched in what ``tokenizer`` decodes
    (None: no stop strings). ValueError for bad stop strings, or a tokenizer that cannot
    decode (a plugged-in one given no decode function)."""
    stop = as_stop_strings(stop)
    if not stop:
        return None
    try:
        probe = tokenizer.decode(np.zeros(0, np.int32))
    except Exception as error:  # TypeError: a TokenizerAdapter given no decode; AttributeError: no decode at all
        raise ValueError(f"stop={stop!r} needs a tokenizer that decodes (stop strings are searched in the decoded "
                         f"output); this one cannot: {type(error).__name__}: {error}") from None  # fmt: skip
    if not isinstance(probe, str):
        raise ValueError(f"stop={stop!r} needs a tokenizer whose decode returns a str; this one returned "
                         f"{type(probe).__name__}")  # fmt: skip
    return StopStrings(stop, tokenizer.decode, min_tokens)


class StopStrings:
    """Finds the earliest stop string in the text of a growing token sequence.

    ``decode`` maps token ids to text (the engine's tokenizer). Called with a request (the
    engine sets it as ``Request.stop_when``) it decodes the request's output tokens and says
    whether they hold a stop string; ``cut`` is then the index in that text where the answer
    ends. A decode that fails there is logged and stops the checks (the request runs on to
    its length): an exception inside the scheduler's step would leave it half-recorded.
    """

    __slots__ = ("stops", "min_tokens", "cut", "_decode", "_floor", "_broken")

    def __init__(self, stop: str | Sequence[str], decode: Callable[[np.ndarray], str], min_tokens: int = 0):
        self.stops = as_stop_strings(stop)
        if not self.stops:
            raise ValueError("StopStrings needs at least one stop string")
        self.min_tokens = min_tokens
        self.cut: int | None = None  # where the answer ends in the decoded output, once found
        self._decode = decode
        self._floor: int | None = None  # a stop string must end past this index (min_tokens)
        self._broken = False

    def __call__(self, request) -> bool:
        """Whether ``request``'s output (a ``Request``) holds a stop string; sets ``cut``."""
        if self._broken or request.num_output_tokens < self.min_tokens:
            return False
        token_ids = request.output_token_ids
        try:
            cut = self.find(self._decode(token_ids), token_ids)
        except Exception:  # a plugged-in decode: the tokens stay right, only the stop strings go unchecked
            _log.exception("request %r: decoding its output failed; its stop strings are no longer checked",
                           request.request_id)  # fmt: skip
            self._broken = True
            return False
        self.cut = cut
        return cut is not None

    def find(self, text: str, token_ids) -> int | None:
        """Where the earliest stop string in ``text`` (the decoded ``token_ids``) starts, or
        None; occurrences that end within the text of the first ``min_tokens - 1`` tokens
        (and all of them while there are fewer than ``min_tokens`` tokens) do not count."""
        if len(token_ids) < self.min_tokens:
            return None
        if self._floor is None:  # once: the text of the first min_tokens - 1 tokens does not change
            head = token_ids[: self.min_tokens - 1]
            self._floor = len(_stable(self._decode(head))) if self.min_tokens > 1 else 0
        floor = self._floor
        starts = [text.find(stop, max(0, floor - len(stop) + 1)) for stop in self.stops]
        found = [start for start in starts if start >= 0]
        return min(found) if found else None

    def answer(self, text: str) -> str:
        """``text`` (the whole output decoded) cut before the stop string that ended the
        request; all of it when none did."""
        return text if self.cut is None else text[: self.cut]

    def held_back(self, text: str) -> int:
        """The length of the longest end of ``text`` that begins some stop string (and is
        shorter than it): text a stream must not send yet, as the next tokens may complete
        a stop string there."""
        longest = 0
        for stop in self.stops:
            for size in range(min(len(stop) - 1, len(text)), longest, -1):
                if text.endswith(stop[:size]):
                    longest = size
                    break
        return longest


def _stable(text: str) -> str:
    """``text`` without a trailing U+FFFD: a byte-level decode of a character cut short."""
    return text.removesuffix("\ufffd")
