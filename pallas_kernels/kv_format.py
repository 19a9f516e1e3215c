"""Quantized KV pages: int8 and fp8 pools with scales, as one pytree the kernels accept.

A quantized pool is a :class:`QuantizedPages`: ``data`` holds the quantized K/V in the
pool's usual layout and ``scales`` (float32) sits beside it, block-major like the data, so a
block's scales move with its pages through gather/scatter and every tier::

    data    # [num_blocks, num_layers, 2, num_kv_heads, page_size, head_dim]  int8 / float8
    scales  # [num_blocks, num_layers, 2, num_kv_heads, page_size]  per token and KV head
            # [num_blocks, num_layers, 2, num_kv_heads, 1]          per page and KV head

A value dequantizes as ``float32(data) * scale``. Every kernel takes either a plain float
pool or a ``QuantizedPages`` as ``kv_pages``: the format is a property of the pool.

Formats (:data:`FORMATS`): ``int8`` (symmetric, round to nearest, ``[-127, 127]``),
``fp8_e4m3`` (``float8_e4m3fn``, max 448) and ``fp8_e5m2`` (max 57344). The scale maps the
absolute maximum of what it covers onto the format's maximum; a scale of 0 means "all zero"
(and, for a per-page scale, "nothing written yet").

Granularity, the trade-off (measured by ``benchmarks/bench_kv_quant.py``, CPU, XLA path):

* ``token``: one scale per token, KV head and K/V. Writing a token never touches another
  token, so decode writes stay one row per token; the error is that of quantizing one
  ``head_dim`` vector. Costs ``4 / head_dim`` bytes of scale per element: 1.031 bytes per
  element at head_dim 128 (992 blocks per GiB for a Llama-3-8B-like shape against 512 in
  bfloat16), 1.125 at head_dim 32.
* ``page``: one scale per page, KV head and K/V: 1.002 bytes per element (1022 blocks per
  GiB). But tokens arrive one at a time, so when a new token's magnitude exceeds the page's
  scale the whole page is requantized with the larger scale (a read-modify-write of
  ``page_size`` rows instead of one: int8 decode writes 5.1x the bfloat16 write's time, where
  per-token int8 took 1.7x), and earlier tokens lose precision to the page's largest
  outlier: with a few outlier channels int8 attention error grows from 4.3% to 6.0-6.2%
  (1.5x), fp8 barely changes with token outliers (a float format keeps relative precision).

Per-token scales are the default: nearly all of the capacity gain, none of the write
amplification, and a token's stored K/V depends only on that token, so a cache hit reads
exactly what recomputing would have written (cached and uncached runs agree). With per-page
scales the stored bytes depend on how the page was filled (one prefill, or token by token
with requantizations), so cached and uncached runs are only close, not bit-equal. The XLA
per-page write also gathers and rewrites each new token's whole page (a prefill chunk moves
``page_size`` times its rows, duplicates included), bounded by the step, not the pool. Attention error on standard-normal K/V: int8 0.8-0.9%, fp8_e4m3 2.8-3.5%,
fp8_e5m2 6-7%; the end-to-end effect on the tiny model is in
``benchmarks/bench_kv_quant_quality.py``.

Pages fill in order (KV is append-only): a write whose first slot in a page is offset 0
starts that page afresh and discards its old scale, which is what lets a reused block (whose
freed content stays in place) start clean.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

__all__ = [
    "FORMATS",
    "GRANULARITIES",
    "QUANT_FORMATS",
    "KVFormat",
    "QuantizedPages",
    "is_quantized",
    "quantize",
    "dequantize",
    "dequantize_pool",
    "quantize_pool",
    "pool_dtype",
    "parse_quant",
    "encode",
    "empty_pool",
    "relative_error",
]

GRANULARITIES = ("token", "page")


@dataclasses.dataclass(frozen=True)
class _Spec:
    dtype: jnp.dtype
    qmax: float


FORMATS = {
    "int8": _Spec(jnp.dtype(jnp.int8), 127.0),
    "fp8_e4m3": _Spec(jnp.dtype(jnp.float8_e4m3fn), float(jnp.finfo(jnp.float8_e4m3fn).max)),
    "fp8_e5m2": _Spec(jnp.dtype(jnp.float8_e5m2), float(jnp.finfo(jnp.float8_e5m2).max)),
}


@dataclasses.dataclass(frozen=True)
class KVFormat:
    """How pool pages are stored: ``quant=None`` is the plain float pool (the default)."""

    quant: str | None = None
    granularity: str = "token"

    def __post_init__(self):
        # a list is unhashable: `in FORMATS` raised a TypeError that named neither
        if self.quant is not None and (not isinstance(self.quant, str) or self.quant not in FORMATS):
            raise ValueError(
                f"kv quant={self.quant!r} is not a known format; expected None or one of "
                f"{tuple(FORMATS)}")
        if self.granularity not in GRANULARITIES:
            raise ValueError(
                f"kv scale granularity={self.granularity!r} must be one of {GRANULARITIES}")

    @property
    def quantized(self) -> bool:
        return self.quant is not None

    @property
    def storage_dtype(self) -> jnp.dtype:
        return FORMATS[self.quant].dtype

    @property
    def qmax(self) -> float:
        return FORMATS[self.quant].qmax

    def scales_shape(self, data_shape) -> tuple[int, ...]:
        """Scale array shape for a data array ``[..., page_size, head_dim]``."""
        lead = tuple(data_shape[:-2])
        return lead + ((data_shape[-2],) if self.granularity == "token" else (1,))

    def bytes_per_element(self, head_dim: int, page_size: int) -> float:
        """Stored bytes per K or V element, scales included."""
        per_scale = head_dim if self.granularity == "token" else head_dim * page_size
        return self.storage_dtype.itemsize + 4.0 / per_scale

    def name(self) -> str:
        if not self.quantized:
            return "none"
        return f"{self.quant}/{self.granularity}"


# Every quantized format: each of FORMATS with each scale granularity.
QUANT_FORMATS: tuple[KVFormat, ...] = tuple(KVFormat(q, g) for q in FORMATS for g in GRANULARITIES)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class QuantizedPages:
    """A quantized pool (or a stack of gathered blocks): data plus float32 scales.

    ``shape``, ``ndim`` and ``dtype`` are the data's, so shape checks written for a plain pool
    read the same; ``format`` recovers the :class:`KVFormat`.
    """

    data: jax.Array
    scales: jax.Array

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.data.shape)

    @property
    def ndim(self) -> int:
        return self.data.ndim

    @property
    def dtype(self):
        return self.data.dtype

    @property
    def nbytes(self) -> int:
        return int(self.data.nbytes) + int(self.scales.nbytes)

    @property
    def format(self) -> KVFormat:
        dtype = jnp.dtype(self.data.dtype)
        quant = next((n for n, s in FORMATS.items() if s.dtype == dtype), None)
        if quant is None:
            raise ValueError(f"QuantizedPages.data.dtype={dtype} is not one of the formats "
                             f"{ {n: str(s.dtype) for n, s in FORMATS.items()} }")
        granularity = "token" if self.scales.shape[-1] == self.data.shape[-2] else "page"
        return KVFormat(quant, granularity)

    def __getitem__(self, index):
        """Indexes the leading (block) axis of data and scales together."""
        return QuantizedPages(self.data[index], self.scales[index])


def parse_quant(value, name: str = "kv_quant", scale: str = "token",
                scale_name: str = "kv_scale") -> str | None:
    """A config's quantization setting: ``None``, ``""`` and ``"none"`` mean unquantized;
    otherwise one of :data:`FORMATS`. ``scale`` (its granularity setting) other than the
    default only makes sense with a format. ValueError naming the value otherwise."""
    if value is not None and not isinstance(value, str):  # a list is unhashable: a TypeError below
        raise ValueError(f"{name}={value!r} must be a format name (str) or None")
    if not isinstance(scale, str):
        raise ValueError(f"{scale_name}={scale!r} must be one of {GRANULARITIES}")
    quant = None if value in (None, "", "none") else value
    if quant is not None and quant not in FORMATS:
        raise ValueError(f"{name}={value!r} is not a known format; expected 'none' or one of "
                         f"{tuple(FORMATS)}")
    if scale not in GRANULARITIES:
        raise ValueError(f"{scale_name}={scale!r} must be one of {GRANULARITIES}")
    if quant is None and scale != "token":
        raise ValueError(f"{scale_name}={scale!r} needs {name} set to a format; {name}={value!r}")
    return quant


def is_quantized(kv_pages) -> bool:
    return isinstance(kv_pages, QuantizedPages)


def pool_dtype(kv_pages):
    """The float dtype attention computes in for this pool (float32 for quantized pools)."""
    return jnp.float32 if is_quantized(kv_pages) else kv_pages.dtype


def _xp(x):
    return jnp if isinstance(x, jax.Array) else np


def quantize(x, fmt: KVFormat, scale=None):
    """Quantizes ``x`` (``[..., page_size, head_dim]``) to ``(data, scales)``.

    Without ``scale`` it is computed from ``x`` at ``fmt``'s granularity; a given ``scale``
    (shaped like the result's ``scales``) is used as is. Works on numpy (for references) and
    jax arrays alike.
    """
    xp = _xp(x)
    x32 = x.astype(np.float32) if xp is np else x.astype(jnp.float32)
    if scale is None:
        amax = xp.max(xp.abs(x32), axis=-1)  # [..., page]
        if fmt.granularity == "page":
            amax = xp.max(amax, axis=-1, keepdims=True)
        scale = amax / np.float32(fmt.qmax)
    data = encode(x32, scale[..., None], fmt)
    return data, scale.astype(np.float32)


def encode(x32, scale, fmt: KVFormat):
    """``x32 / scale`` in the storage format (0 where the scale is 0); ``scale`` broadcasts."""
    xp = jnp if isinstance(x32, jax.Array) or isinstance(scale, jax.Array) else np
    safe = xp.where(scale > 0, scale, np.float32(1))
    y = xp.where(scale > 0, x32 / safe, np.float32(0))
    if fmt.quant == "int8":
        y = xp.clip(xp.round(y), -127, 127)
    else:
        y = xp.clip(y, -fmt.qmax, fmt.qmax)  # saturate instead of overflowing to inf/NaN
    return y.astype(fmt.storage_dtype)


def dequantize(data, scales):
    """``float32(data) * scales`` with ``scales`` shaped ``[..., page or 1]``."""
    xp = _xp(data)
    return data.astype(np.float32) * xp.asarray(scales)[..., None]


def dequantize_pool(kv_pages):
    """A float32 pool from a quantized one (plain pools are returned unchanged)."""
    if not is_quantized(kv_pages):
        return kv_pages
    return dequantize(kv_pages.data, kv_pages.scales)


def quantize_pool(pages, fmt: KVFormat):
    """A :class:`QuantizedPages` from a float pool or block stack (``fmt`` must quantize)."""
    if not fmt.quantized:
        raise ValueError("quantize_pool needs a quantized format, got quant=None")
    data, scales = quantize(pages, fmt)
    return QuantizedPages(data, scales)


def empty_pool(shape, fmt: KVFormat, dtype=jnp.float32):
    """Zero-filled pool arrays of ``shape``: a plain array, or data plus zero scales."""
    if not fmt.quantized:
        return jnp.zeros(shape, dtype)
    return QuantizedPages(jnp.zeros(shape, fmt.storage_dtype),
                          jnp.zeros(fmt.scales_shape(shape), jnp.float32))


def relative_error(approx, exact) -> float:
    """``||approx - exact|| / ||exact||`` in float64 (the quality bound the tests use)."""
    a = np.asarray(jnp.asarray(approx, jnp.float32), np.float64)
    e = np.asarray(jnp.asarray(exact, jnp.float32), np.float64)
    return float(np.linalg.norm(a - e) / max(np.linalg.norm(e), math.ulp(1.0)))
