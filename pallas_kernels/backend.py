"""Choosing a kernel implementation for the current JAX backend.

Every public kernel in :mod:`pallas_kernels` takes ``impl=`` and ``interpret=``:

* ``impl=None`` picks the best implementation for ``jax.default_backend()``:
  ``"pallas_gpu"`` on GPU, ``"pallas_tpu"`` on TPU and ``"xla"`` (plain jnp lowered by XLA,
  the fast path) on CPU.
* ``impl="xla" | "pallas_gpu" | "pallas_tpu"`` forces one. A Pallas implementation off its
  own accelerator only runs in interpret mode; ``interpret=None`` turns that on by itself.
"""

from __future__ import annotations

import jax
from jax.experimental.pallas import tpu as pltpu

__all__ = ["IMPLS", "PALLAS_IMPLS", "resolve_impl", "resolve_interpret"]

IMPLS = ("xla", "pallas_gpu", "pallas_tpu")
PALLAS_IMPLS = ("pallas_gpu", "pallas_tpu")

_NATIVE_BACKEND = {"pallas_gpu": "gpu", "pallas_tpu": "tpu"}


def resolve_impl(impl: str | None) -> str:
    """Returns the implementation name to run, validating an explicit choice."""
    if impl is None:
        backend = jax.default_backend()
        return {"gpu": "pallas_gpu", "tpu": "pallas_tpu"}.get(backend, "xla")
    if impl not in IMPLS:
        raise ValueError(f"{impl=} is not a known implementation; expected one of {IMPLS}")
    return impl


def resolve_interpret(impl: str, interpret: bool | pltpu.InterpretParams | None) -> bool | pltpu.InterpretParams:
    """Whether a Pallas implementation must run in interpret mode.

    ``None`` means: interpret exactly when the implementation's own accelerator is absent.
    Asking a Pallas kernel to compile for a backend it cannot target is a caller error. A
    ``pltpu.InterpretParams`` (the TPU simulator's settings, e.g. ``detect_races=True``) is
    passed on as it is to ``pallas_tpu``; ValueError for another implementation.
    """
    if isinstance(interpret, pltpu.InterpretParams):
        if impl != "pallas_tpu":
            raise ValueError(f"interpret={interpret!r} configures the TPU simulator; {impl=} takes a bool or None")
        return interpret
    if impl not in PALLAS_IMPLS:
        return False
    native = jax.default_backend() == _NATIVE_BACKEND[impl]
    if interpret is None:
        return not native
    if not interpret and not native:
        raise ValueError(
            f"{impl=} cannot compile on backend {jax.default_backend()!r}; "
            "pass interpret=True (or None) to run it in interpret mode")
    return bool(interpret)
