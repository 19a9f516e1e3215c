"""Shared builders for the tests of the data-moving kernels (KV write, block gather/scatter).

Pools are filled with random *bytes*, NaN and infinity patterns included, and results are
compared byte for byte: a kernel must move bits, change exactly the addressed slots, and
leave every other byte of the pool as it was.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

__all__ = ["IMPLS", "random_bytes", "assert_same_bytes", "lower_for", "shapes_of"]

IMPLS = ("xla", "pallas_gpu", "pallas_tpu")


def random_bytes(rng: np.random.Generator, shape, dtype) -> np.ndarray:
    """An array of ``shape`` whose bytes are uniformly random (any bit pattern of ``dtype``)."""
    dtype = np.dtype(jnp.dtype(dtype))
    raw = rng.integers(0, 256, size=int(np.prod(shape)) * dtype.itemsize, dtype=np.uint8)
    return raw.view(dtype).reshape(shape)


def assert_same_bytes(actual, expected) -> None:
    """Byte-for-byte equality, naming the first differing element on failure."""
    actual, expected = np.asarray(actual), np.asarray(expected)
    assert (actual.shape, actual.dtype) == (expected.shape, expected.dtype)
    as_bytes = lambda x: np.ascontiguousarray(x).view(np.uint8).reshape(x.shape + (x.dtype.itemsize,))
    differs = (as_bytes(actual) != as_bytes(expected)).any(axis=-1)
    if differs.any():
        first = np.unravel_index(int(np.argmax(differs)), actual.shape)
        pytest.fail(f"{int(differs.sum())} elements differ; first at {first}: "
                    f"{actual[first]!r} != {expected[first]!r}")


def lower_for(platform: str, fn, *args) -> str:
    """StableHLO text of ``fn(*args)`` lowered for ``"tpu"`` or ``"cuda"`` without the device.

    This runs the real Mosaic / Triton lowering (shape rules, power-of-two vectors, aliasing);
    only the final compile needs the accelerator. Skips where this JAX cannot target it.
    """
    jitted = jax.jit(fn)
    if platform == "tpu":
        return jitted.trace(*args).lower(lowering_platforms=("tpu",)).as_text()
    try:
        from jax.sharding import AbstractDevice, AbstractMesh, AxisType

        device = AbstractDevice(device_kind="NVIDIA H100 80GB HBM3", num_cores=132,
                                platform="gpu")
        mesh = AbstractMesh((1,), ("x",), (AxisType.Explicit,), abstract_device=device)
    except (ImportError, TypeError) as e:  # older JAX: no abstract GPU device to target
        pytest.skip(f"cannot target an abstract GPU with this JAX: {e}")
    with jax.sharding.use_abstract_mesh(mesh):
        return jitted.trace(*args).lower(lowering_platforms=("cuda",)).as_text()


def shapes_of(*arrays):
    """``jax.ShapeDtypeStruct`` stand-ins, so lowering allocates nothing."""
    return tuple(jax.ShapeDtypeStruct(a.shape, a.dtype) for a in arrays)

