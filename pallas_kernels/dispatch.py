"""The one table of kernel implementations: ``(op, impl) -> function``.

Every public op (:func:`~pallas_kernels.paged_attention`, :func:`~pallas_kernels.write_kv`,
:func:`~pallas_kernels.gather_blocks`, :func:`~pallas_kernels.scatter_blocks`) validates its
arguments, asks :func:`select` for a function and calls it. :func:`select` resolves ``impl``
and ``interpret`` (see :mod:`pallas_kernels.backend`) and binds ``interpret=`` to the Pallas
implementations only: the XLA ones take no such argument.

The implementation modules import nothing from the public ops, so the dependencies point one
way: public op -> dispatch -> implementations.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Collection

from pallas_kernels.backend import PALLAS_IMPLS, resolve_impl, resolve_interpret
from pallas_kernels.block_copy_pallas import (
    gather_blocks_gpu,
    gather_blocks_tpu,
    scatter_blocks_gpu,
    scatter_blocks_tpu,
)
from pallas_kernels.block_copy_xla import gather_blocks_xla, scatter_blocks_xla
from pallas_kernels.kv_write_pallas import (
    write_kv_gpu,
    write_kv_quantized_gpu,
    write_kv_quantized_tpu,
    write_kv_tpu,
)
from pallas_kernels.kv_write_xla import write_kv_quantized_xla, write_kv_xla
from pallas_kernels.paged_attention_gpu import paged_attention_gpu
from pallas_kernels.paged_attention_tpu import paged_attention_tpu
from pallas_kernels.paged_attention_xla import paged_attention_xla

__all__ = ["KERNELS", "OPS", "select", "tuning_keys"]

KERNELS: dict[tuple[str, str], Callable] = {
    ("paged_attention", "xla"): paged_attention_xla,
    ("paged_attention", "pallas_gpu"): paged_attention_gpu,
    ("paged_attention", "pallas_tpu"): paged_attention_tpu,
    ("write_kv", "xla"): write_kv_xla,
    ("write_kv", "pallas_gpu"): write_kv_gpu,
    ("write_kv", "pallas_tpu"): write_kv_tpu,
    # Into a QuantizedPages pool: quantizes the new rows on the way in.
    ("write_kv_quantized", "xla"): write_kv_quantized_xla,
    ("write_kv_quantized", "pallas_gpu"): write_kv_quantized_gpu,
    ("write_kv_quantized", "pallas_tpu"): write_kv_quantized_tpu,
    ("gather_blocks", "xla"): gather_blocks_xla,
    ("gather_blocks", "pallas_gpu"): gather_blocks_gpu,
    ("gather_blocks", "pallas_tpu"): gather_blocks_tpu,
    ("scatter_blocks", "xla"): scatter_blocks_xla,
    ("scatter_blocks", "pallas_gpu"): scatter_blocks_gpu,
    ("scatter_blocks", "pallas_tpu"): scatter_blocks_tpu,
}

OPS = tuple(dict.fromkeys(op for op, _ in KERNELS))

# Where an op's default differs from the backend's (keyed by op and the backend's default).
# On GPU the block copies default to XLA's gather/scatter rather than the Triton kernels: both
# are plain copies of contiguous blocks, bound by memory bandwidth, and XLA's needs no custom
# call. Not yet timed on a GPU: benchmarks/bench_pool_layout.py --impls compares them.
_DEFAULT_OVERRIDES = {
    ("gather_blocks", "pallas_gpu"): "xla",
    ("scatter_blocks", "pallas_gpu"): "xla",
}


# Keyword arguments the public ops pass themselves: not tuning.
_OP_ARGS = frozenset({"layer", "sm_scale", "sliding_window", "soft_cap", "interpret"})


def select(op: str, impl: str | None = None, interpret: bool | None = None,
           tuning: Collection[str] = ()) -> Callable:  # fmt: skip
    """The function that runs ``op`` with implementation ``impl``.

    ``impl=None`` picks this backend's default for ``op``; an unknown ``impl``, or
    ``interpret=False`` for a Pallas implementation off its accelerator, raises
    ``ValueError``, as does a name in ``tuning`` (the caller's tuning keywords) that the
    implementation does not take. A Pallas implementation comes with ``interpret=`` bound.
    """
    if impl is None:
        default = resolve_impl(None)
        impl = _DEFAULT_OVERRIDES.get((op, default), default)
    impl = resolve_impl(impl)
    interpret = resolve_interpret(impl, interpret)
    fn = KERNELS[op, impl]
    if tuning:
        known = tuning_keys(op, impl)
        unknown = sorted(set(tuning) - set(known))
        if unknown:
            takes = f"expected some of {list(known)}" if known else "it takes none"
            raise ValueError(f"tuning {unknown} is not taken by {op} with impl={impl!r}; {takes}")
    if impl in PALLAS_IMPLS:
        return functools.partial(fn, interpret=interpret)
    return fn



@functools.cache
def tuning_keys(op: str, impl: str) -> tuple[str, ...]:
    """The tuning keywords (block sizes, warps) ``op``'s implementation ``impl`` takes."""
    # The quantized writes pass their tuning on to the plain write of the same impl.
    fn = KERNELS["write_kv" if op == "write_kv_quantized" else op, impl]
    params = inspect.signature(fn).parameters.values()
    return tuple(p.name for p in params if p.kind is p.KEYWORD_ONLY and p.name not in _OP_ARGS)
