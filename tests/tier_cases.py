"""Shared builders for the tier and transfer tests: random KV blocks, keys, bit comparison."""

import ml_dtypes
import numpy as np

DTYPES = ["float32", "bfloat16", "float16", "int8", "float8_e4m3fn", "float8_e5m2"]


def np_dtype(dtype) -> np.dtype:
    return np.dtype(getattr(ml_dtypes, dtype, dtype))


def random_blocks(n, block_shape, dtype="float32", seed=0) -> np.ndarray:
    """[n, *block_shape] of random bit patterns (NaNs and infinities included) as `dtype`."""
    dtype = np_dtype(dtype)
    raw = np.random.default_rng(seed).integers(
        0, 256, size=(n, *block_shape, dtype.itemsize), dtype=np.uint8)
    return raw.view(dtype).reshape(n, *block_shape)


def int_keys(n, start=0) -> list[bytes]:
    """Keys start..start+n-1 as 16-byte little-endian integers."""
    return [i.to_bytes(16, "little") for i in range(start, start + n)]


def same_bits(a, b) -> bool:
    """Equal shape, dtype and bytes (NaN payloads included)."""
    a, b = np.asarray(a), np.asarray(b)
    return a.shape == b.shape and a.dtype == b.dtype and np.array_equal(
        a.view(np.uint8), b.view(np.uint8))


def block_bytes(block_shape, dtype="float32") -> int:
    return int(np.prod(block_shape)) * np_dtype(dtype).itemsize
