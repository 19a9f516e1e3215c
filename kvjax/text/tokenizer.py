"""Tokenizers: a built-in byte-level tokenizer and an adapter for any ``str -> ids`` callable.

The engine needs two things from a tokenizer: ``encode(text)`` giving int32 token ids that the
model's embedding can index, and (for streaming text back) ``decode(ids)``. ``ByteTokenizer`` is
self-contained (UTF-8 bytes are ids 0..255, named special tokens follow at 256, 257, ...), so
demos and tests need no vocabulary file. ``as_tokenizer`` wraps anything else: a callable
``str -> sequence of ints``, or an object with ``encode``/``decode`` methods (a Hugging Face
tokenizer, a SentencePiece processor). Every id a wrapped tokenizer returns is checked against
the stated vocabulary, so a mismatched tokenizer fails at the boundary with the id and its
position rather than reading a wrong embedding row or, on device, an arbitrary one.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Protocol, runtime_checkable

import numpy as np

from kvjax.text.tokens import validate_tokens

__all__ = [
    "BYTE_VOCAB",
    "ByteTokenizer",
    "Tokenizer",
    "TokenizerAdapter",
    "as_tokenizer",
]

BYTE_VOCAB = 256
"""Ids 0..255 are raw UTF-8 bytes in ``ByteTokenizer``; special ids start here."""


@runtime_checkable
class Tokenizer(Protocol):
    """What the engine calls. ``vocab_size`` is None when the tokenizer does not state one."""

    @property
    def vocab_size(self) -> int | None: ...

    def encode(self, text: str) -> np.ndarray: ...

    def decode(self, ids: Sequence[int] | np.ndarray) -> str: ...


@dataclasses.dataclass(frozen=True, slots=True)
class ByteTokenizer:
    """UTF-8 bytes as token ids 0..255, then ``special_tokens`` at ids 256, 257, ... in order.

    ``encode`` never fails on a ``str``: lone surrogates (not valid Unicode scalar values, e.g.
    from a JSON ``"\\ud800"``) are written as their surrogate-pass bytes and decode back as
    U+FFFD. ``decode`` uses ``errors="replace"``, so ids cut mid-character give U+FFFD instead
    of an exception; special ids are dropped unless ``skip_special_tokens=False``, which writes
    their names.

    >>> tok = ByteTokenizer(add_bos=True)
    >>> ids = tok.encode("hé")
    >>> ids.tolist(), tok.vocab_size
    ([256, 104, 195, 169], 258)
    >>> tok.decode(ids), tok.decode(ids, skip_special_tokens=False)
    ('hé', '<bos>hé')
    """

    special_tokens: tuple[str, ...] = ("<bos>", "<eos>")
    add_bos: bool = False
    add_eos: bool = False

    def __post_init__(self) -> None:
        specials = self.special_tokens
        if isinstance(specials, str) or not all(isinstance(s, str) and s for s in specials):
            raise ValueError(f"special_tokens={specials!r} must be a tuple of non-empty names")
        if len(set(specials)) != len(specials):
            raise ValueError(f"special_tokens={specials!r} contains a duplicate name")
        object.__setattr__(self, "special_tokens", tuple(specials))
        for flag, name in (("add_bos", "<bos>"), ("add_eos", "<eos>")):
            if not isinstance(getattr(self, flag), bool):  # "no" would be truthy: a BOS nobody asked for
                raise ValueError(f"{flag}={getattr(self, flag)!r} must be a bool")
            if getattr(self, flag) and name not in specials:
                raise ValueError(f"{flag}=True needs {name!r} in special_tokens={specials!r}")

    @property
    def vocab_size(self) -> int:
        """Number of ids: 256 bytes plus the special tokens."""
        return BYTE_VOCAB + len(self.special_tokens)

    @property
    def bos_id(self) -> int | None:
        return self.token_id("<bos>") if "<bos>" in self.special_tokens else None

    @property
    def eos_id(self) -> int | None:
        return self.token_id("<eos>") if "<eos>" in self.special_tokens else None

    def token_id(self, name: str) -> int:
        """Id of a special token by name; ValueError listing the names when unknown."""
        if name not in self.special_tokens:
            raise ValueError(
                f"unknown special token {name!r}; expected one of {self.special_tokens}"
            )
        return BYTE_VOCAB + self.special_tokens.index(name)

    def encode(self, text: str) -> np.ndarray:
        """Token ids of ``text``: int32[len(utf8 bytes) + bos + eos]."""
        if not isinstance(text, str):
            raise TypeError(f"text must be a str, got {type(text).__name__}")
        body = np.frombuffer(text.encode("utf-8", errors="surrogatepass"), np.uint8)
        head = np.asarray([self.bos_id] if self.add_bos else [], np.int32)
        tail = np.asarray([self.eos_id] if self.add_eos else [], np.int32)
        return np.concatenate([head, body.astype(np.int32), tail])

    def decode(self, ids: Sequence[int] | np.ndarray, *, skip_special_tokens: bool = True) -> str:
        """Text of ``ids``; ValueError naming the first id outside ``[0, vocab_size)``."""
        array = validate_tokens(ids, self.vocab_size)
        special = array >= BYTE_VOCAB
        if not special.any():
            return _utf8(array)
        # Specials split the byte stream: decode each byte run on its own so a special id
        # between two halves of a character is not glued into one.
        pieces, start = [], 0
        for index in np.flatnonzero(special):
            pieces.append(_utf8(array[start:index]))
            if not skip_special_tokens:
                pieces.append(self.special_tokens[int(array[index]) - BYTE_VOCAB])
            start = index + 1
        pieces.append(_utf8(array[start:]))
        return "".join(pieces)


class TokenizerAdapter:
    """A ``Tokenizer`` around a foreign encode function (and optional decode function).

    Every ``encode`` result is converted to int32 and checked against ``vocab_size`` (when one
    is known); a bad id raises ValueError with the id, its position and the tokenizer's name.
    """

    __slots__ = ("_encode", "_decode", "_vocab_size", "name")

    def __init__(
        self,
        encode: Callable[[str], Sequence[int]],
        decode: Callable[[list[int]], str] | None = None,
        vocab_size: int | None = None,
        name: str = "tokenizer",
    ) -> None:
        if not callable(encode):
            raise TypeError(f"encode={encode!r} must be callable (str -> sequence of ints)")
        if decode is not None and not callable(decode):
            raise TypeError(f"decode={decode!r} must be callable (list of ints -> str) or None")
        self._encode, self._decode, self.name = encode, decode, name
        self._vocab_size = _checked_vocab_size(vocab_size)

    @property
    def vocab_size(self) -> int | None:
        return self._vocab_size

    @property
    def wrapped(self) -> object | None:
        """The tokenizer whose bound ``encode`` this adapts (None for a plain function)."""
        return getattr(self._encode, "__self__", None)

    def encode(self, text: str) -> np.ndarray:
        if not isinstance(text, str):
            raise TypeError(f"text must be a str, got {type(text).__name__}")
        ids = self._encode(text)
        try:
            return validate_tokens(ids, self._vocab_size)
        except ValueError as error:
            raise ValueError(f"{self.name} encode() output: {error}") from None

    def decode(self, ids: Sequence[int] | np.ndarray) -> str:
        if self._decode is None:
            raise TypeError(
                f"{self.name} was given no decode function; pass decode= to as_tokenizer"
            )
        return self._decode(validate_tokens(ids, self._vocab_size).tolist())


def as_tokenizer(
    tokenizer: object,
    *,
    decode: Callable[[list[int]], str] | None = None,
    vocab_size: int | None = None,
) -> Tokenizer:
    """A ``Tokenizer`` from a ``ByteTokenizer``, an object with ``encode``, or a callable.

    ``vocab_size`` is the model's vocabulary (ids must be below it); it defaults to the
    object's integer ``vocab_size`` attribute. For a Hugging Face tokenizer pass the model's
    vocabulary explicitly: its ``vocab_size`` attribute leaves out added tokens.
    An object with ``encode`` but no ``decode`` (or a plain callable without ``decode=``)
    can encode; its ``decode`` raises TypeError.
    """
    if tokenizer is None or isinstance(tokenizer, (str, bytes)):
        raise TypeError(_NOT_A_TOKENIZER.format(tokenizer=tokenizer))
    stated = getattr(tokenizer, "vocab_size", None)
    if isinstance(tokenizer, (ByteTokenizer, TokenizerAdapter)) and vocab_size in (None, stated):
        return tokenizer
    if vocab_size is None and _is_int(stated):
        vocab_size = int(stated)
    name = type(tokenizer).__name__
    if callable(getattr(tokenizer, "encode", None)):
        own_decode = getattr(tokenizer, "decode", None)
        decode = decode if decode is not None else (own_decode if callable(own_decode) else None)
        return TokenizerAdapter(tokenizer.encode, decode, vocab_size, name)
    if callable(tokenizer):
        return TokenizerAdapter(tokenizer, decode, vocab_size, getattr(tokenizer, "__name__", name))
    raise TypeError(_NOT_A_TOKENIZER.format(tokenizer=tokenizer))


_NOT_A_TOKENIZER = (
    "tokenizer={tokenizer!r} must be a callable (str -> sequence of ints) or an object with "
    "encode(text) and decode(ids) methods"
)


def _checked_vocab_size(vocab_size: int | None) -> int | None:
    if vocab_size is None:
        return None
    if not _is_int(vocab_size) or not 0 < vocab_size <= 2**31:
        raise ValueError(f"{vocab_size=} must be a positive integer <= 2**31 (ids are int32) or None")
    return int(vocab_size)


def _is_int(value: object) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


def _utf8(byte_ids: np.ndarray) -> str:
    return byte_ids.astype(np.uint8).tobytes().decode("utf-8", errors="replace")
