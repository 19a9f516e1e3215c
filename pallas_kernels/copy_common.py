"""Pieces shared by the data-moving kernels (KV write, block gather/scatter), and the Triton
compiler parameters every GPU kernel uses."""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax.experimental.pallas import triton as plgpu

__all__ = ["in_pool", "on_bits", "pow2_pieces", "largest_pow2_divisor", "run_copies", "tpu_interpret_mode",
           "triton_params"]

_UINT_OF_WIDTH = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint64}
_BITS_NOT_KEPT = frozenset({jnp.dtype(jnp.float8_e5m2)})


def on_bits(*positions: int):
    """Runs the wrapped function on unsigned-integer views of the arguments at ``positions``
    when their dtype is one whose bits XLA does not keep, and views the result back.

    The copy kernels promise bit-exact moves, but XLA's CPU backend rewrites the NaN
    payloads of float8_e5m2 in every gather, scatter and concatenate (measured: the other
    float8 formats, float16, bfloat16 and float32 keep their bits). Integers are never
    rewritten. The views are not free on CPU (XLA runs a pass over the pool there), so every
    other dtype goes through untouched.
    """
    def wrap(fn):
        @functools.wraps(fn)
        def wrapped(*args, **kwargs):
            dtype = jnp.dtype(args[positions[0]].dtype)
            if dtype not in _BITS_NOT_KEPT:
                return fn(*args, **kwargs)
            args = [_bits(a) if i in positions else a for i, a in enumerate(args)]
            return jax.lax.bitcast_convert_type(fn(*args, **kwargs), dtype)
        return wrapped
    return wrap


def _bits(x):
    return jax.lax.bitcast_convert_type(x, _UINT_OF_WIDTH[jnp.dtype(x.dtype).itemsize])


def pow2_pieces(n: int) -> list[tuple[int, int]]:
    """Splits ``range(n)`` into ``(start, size)`` runs of power-of-two sizes, largest first.

    Triton only loads and stores power-of-two vectors; 96 elements move as 64 + 32.
    """
    pieces, start = [], 0
    for bit in reversed(range(n.bit_length())):
        if n & (1 << bit):
            pieces.append((start, 1 << bit))
            start += 1 << bit
    return pieces


def largest_pow2_divisor(n: int, cap: int) -> int:
    """The largest power of two that divides ``n`` and is at most ``cap`` (both >= 1)."""
    return min(n & -n, 1 << (cap.bit_length() - 1))


def run_copies(count: int, copies_at: Callable[[jax.Array], Sequence[tuple]]) -> None:
    """Starts every live DMA of ``copies_at(i)`` for ``i < count``, then waits for them all.

    ``copies_at(i)`` returns ``(live, descriptor)`` pairs and must be pure in ``i``: it is
    called again to rebuild the same descriptors for the waits. Starting all before waiting
    any keeps ``count`` DMAs in flight at once; the grid around this bounds that number.
    Every descriptor must share the DMA semaphore and move the same number of bytes, so any
    wait matches any completed copy.
    """
    def start(i, carry):
        for live, copy in copies_at(i):
            pl.when(live)(copy.start)
        return carry

    def wait(i, carry):
        for live, copy in copies_at(i):
            pl.when(live)(copy.wait)
        return carry

    jax.lax.fori_loop(0, count, start, 0)
    jax.lax.fori_loop(0, count, wait, 0)


def in_pool(index, size: int):
    """Whether a block id (or slot) read from the ids a kernel was given lies in ``[0, size)``:
    every implementation treats one outside as padding (reads zeros, writes nothing), as XLA's
    gather and scatter do; the checks that refuse it are the caller's (``check_block_ids``)."""
    return (index >= 0) & (index < size)


def tpu_interpret_mode(interpret: bool | pltpu.InterpretParams):
    """The ``interpret=`` value for a TPU ``pallas_call``: the TPU simulator (an
    ``InterpretParams`` given is used as it is), or compiled."""
    if isinstance(interpret, pltpu.InterpretParams):
        return interpret
    return pltpu.InterpretParams() if interpret else False


def triton_params(num_warps: int, num_stages: int = 1):
    """Triton compiler parameters for a compiled (not interpreted) GPU ``pallas_call``."""
    # plgpu.CompilerParams in every supported JAX (0.11.2 and 0.12 alike); the older name,
    # TritonCompilerParams, belongs to releases below setup.cfg's floor.
    return plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages)
