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



def check_quantized_block_copies(fmt, shape, ids, *, seed: int, **kernel_kwargs) -> None:
    """Gather and scatter of a quantized pool of ``shape`` move data and scales together,
    bit-exactly for any bit pattern (NaN payloads included); a padding id gathers zero data
    and zero scales and is skipped by scatter. Compared with the references."""
    from pallas_kernels import (
        gather_blocks,
        gather_blocks_reference,
        scatter_blocks,
        scatter_blocks_reference,
    )
    from pallas_kernels.kv_format import QuantizedPages

    rng = np.random.default_rng(seed)

    def random_pool(lead):
        block = (lead,) + tuple(shape[1:])
        return QuantizedPages(jnp.asarray(random_bytes(rng, block, fmt.storage_dtype)),
                              jnp.asarray(random_bytes(rng, fmt.scales_shape(block), jnp.float32)))

    pool = random_pool(shape[0])
    ids = jnp.asarray(ids, jnp.int32)
    blocks = gather_blocks(pool, ids, **kernel_kwargs)
    for got, want in zip(jax.tree.leaves(blocks), jax.tree.leaves(gather_blocks_reference(pool, ids))):
        assert_same_bytes(got, want)
    padding = int(np.argmax(np.asarray(ids) < 0))
    assert not np.asarray(blocks.data[padding]).view(np.uint8).any()
    assert not np.asarray(blocks.scales[padding]).view(np.uint32).any()

    src = random_pool(len(ids))
    expect = scatter_blocks_reference(pool, ids, src)
    out = scatter_blocks(jax.tree.map(jnp.copy, pool), ids, src, **kernel_kwargs)
    for got, want in zip(jax.tree.leaves(out), jax.tree.leaves(expect)):
        assert_same_bytes(got, want)
