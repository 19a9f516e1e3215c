"""Token ids as kvjax keeps them: one canonical layout, validated once at the boundary.

Token ids are little-endian int32 (``TOKEN_DTYPE``): the bytes the prefix trie compares and
block keys hash, identical across processes and machines. ``validate_tokens`` checks a
prompt's ids against a vocabulary and names the first bad one; ``token_bytes`` does the same
and returns the bytes.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

__all__ = ["TOKEN_DTYPE", "token_bytes", "validate_tokens"]

TOKEN_DTYPE = np.dtype("<i4")
"""Canonical token layout: little-endian int32, the bytes that keys and the trie compare."""

_INT32_LIMIT = 2**31


def validate_tokens(tokens: Sequence[int] | np.ndarray, vocab_size: int | None) -> np.ndarray:
    """Return ``tokens`` as a 1-D little-endian int32 array, checking every id.

    Ids must lie in ``[0, vocab_size)`` (or ``[0, 2**31)`` without a vocabulary). Raises
    ValueError naming the first bad id and its index. The result may share memory with the
    input when it already has the canonical dtype; callers must not mutate it.
    """
    array = np.asarray(tokens)
    if array.dtype.kind == "f" and not isinstance(tokens, np.ndarray):
        # Python ints past int64 next to small ones ([1, 2**63]) become float64, which would
        # name 2**63 as 9.223372036854776e+18: keep the values as sent
        array = np.asarray(tokens, dtype=object)
    if array.ndim != 1:
        if isinstance(tokens, (str, bytes)):  # a 0-d array: "got shape ()" did not say text was passed
            raise ValueError(f"tokens must be a 1-D sequence of token ids (ints), got {type(tokens).__name__} "
                             f"{tokens[:32]!r}: text needs tokenizing first")
        raise ValueError(f"tokens must be 1-D, got shape {array.shape}")
    if array.size == 0:
        return np.zeros(0, TOKEN_DTYPE)
    if array.dtype.kind not in "iu":
        if array.dtype.kind == "f" or array.dtype == object:
            array = _integral_or_raise(array)
        else:
            raise ValueError(f"tokens must be integers, got dtype {array.dtype}")
    limit = _limit(vocab_size)
    if array.dtype == TOKEN_DTYPE:  # one pass: negative ids wrap to >= 2**31 as uint32
        out_of_range = int(array.view(np.uint32).max()) >= limit
    else:
        out_of_range = array.min() < 0 or array.max() >= limit
    if out_of_range:
        bad = np.flatnonzero((array < 0) | (array >= limit))[0]
        raise ValueError(
            f"token id {int(array[bad])} at index {bad} is out of range; expected 0 <= id < {limit}"
            + ("" if vocab_size is None else f" ({vocab_size=})")
        )
    return array.astype(TOKEN_DTYPE, copy=False)


def token_bytes(tokens: Sequence[int] | np.ndarray, vocab_size: int | None) -> bytes:
    """``validate_tokens(tokens, vocab_size).tobytes()``, cheaper for int32 input.

    The range check runs over the fresh (cache-hot) copy instead of the caller's array, so a
    prompt is read from memory once, not twice. Same errors as ``validate_tokens``.
    """
    array = np.asarray(tokens)
    if array.dtype != TOKEN_DTYPE or array.ndim != 1:  # the ints as sent, if numpy made them floats
        return validate_tokens(tokens if array.dtype.kind == "f" else array, vocab_size).tobytes()
    buf = array.tobytes()
    limit = _limit(vocab_size)
    if buf and int(np.frombuffer(buf, np.uint32).max()) >= limit:  # negative ids wrap high
        validate_tokens(array, vocab_size)  # raises, naming the bad id and its index
    return buf


# --- helpers -------------------------------------------------------------------------------


def _limit(vocab_size: int | None) -> int:
    """One past the largest valid id: ids are int32, whatever the vocabulary's size claims
    (past 2**31 an id would wrap to a negative one)."""
    return _INT32_LIMIT if vocab_size is None else min(int(vocab_size), _INT32_LIMIT)


def _integral_or_raise(array: np.ndarray) -> np.ndarray:
    try:
        as_float = array.astype(np.float64)
    except (TypeError, ValueError):
        raise ValueError(f"tokens must be integers, got {array.dtype} values") from None
    bad = np.flatnonzero(~np.isfinite(as_float) | (as_float != np.floor(as_float)))
    if bad.size:
        raise ValueError(f"token id {_item(array[bad[0]])!r} at index {bad[0]} is not an integer")
    huge = np.flatnonzero(np.abs(as_float) >= _INT32_LIMIT)  # named as given, not as int64 would wrap it
    if huge.size:
        raise ValueError(f"token id {_item(array[huge[0]])!r} at index {huge[0]} is out of range; expected "
                         f"0 <= id < {_INT32_LIMIT}")  # fmt: skip
    return as_float.astype(np.int64)


def _item(value):
    """A numpy scalar as its Python value; an object array's element (a Python int, say) as it is."""
    return value.item() if isinstance(value, np.generic) else value
