"""Shared pieces of the KV quantization benchmarks (``bench_kv_quant*.py``).

The formats every benchmark compares (the float pool first), the two pool shapes they state
(the tiny preset and a Llama-3-8B-like model), byte arithmetic, and a plain-text table.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from collections.abc import Sequence
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvjax.config.presets import load_preset  # noqa: E402
from kvjax.serving.model import ModelConfig  # noqa: E402
from kvjax.serving.preset import pool_config  # noqa: E402
from kvjax.tiers.page_pool import PoolConfig  # noqa: E402
from pallas_kernels.kv_format import QUANT_FORMATS, KVFormat  # noqa: E402

__all__ = ["ALL_FORMATS", "GIB", "LLAMA3_8B", "ModelShape", "blocks_in", "command_line",
           "format_table", "tiny_shape"]

GIB = 2**30

# The unquantized pool, then every quantized format x scale granularity.
ALL_FORMATS: list[KVFormat] = [KVFormat()] + list(QUANT_FORMATS)


@dataclasses.dataclass(frozen=True)
class ModelShape:
    """The KV-relevant shape of a model: what one pool block of ``page_size`` tokens holds."""

    name: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    page_size: int  # tokens per block
    dtype: str  # the unquantized pool's dtype

    def pool(self, fmt: KVFormat, num_blocks: int = 1) -> PoolConfig:
        return PoolConfig(num_blocks, self.num_layers, self.num_kv_heads, self.page_size,
                          self.head_dim, self.dtype, kv_quant=fmt.quant, kv_scale=fmt.granularity)

    def bytes_per_block(self, fmt: KVFormat) -> int:
        """Bytes of one block (every layer, K and V, ``page_size`` tokens), scales included."""
        return self.pool(fmt).bytes_per_block

    def describe(self) -> str:
        return (f"{self.name}: {self.num_layers} layers, {self.num_kv_heads} KV heads, "
                f"head_dim {self.head_dim}, page {self.page_size}, {self.dtype}")


# 32 layers, 8 KV heads of 128 (GQA), bfloat16 KV, 16-token pages: 2 MiB per block.
LLAMA3_8B = ModelShape("llama-3-8b-like", 32, 8, 128, 16, "bfloat16")


def tiny_shape(preset: str = "tiny") -> ModelShape:
    """The shape of ``preset``'s model and pool."""
    sections = load_preset(preset)
    model = ModelConfig.from_dict(sections["model"])
    pool = pool_config(model, sections["cache"]["page_size"], 1)
    return ModelShape(preset, pool.num_layers, pool.num_kv_heads, pool.head_dim, pool.page_size,
                      pool.dtype)


def blocks_in(budget_bytes: int, bytes_per_block: int) -> int:
    """Whole blocks of ``bytes_per_block`` that fit in ``budget_bytes`` (both in bytes)."""
    if bytes_per_block < 1:
        raise ValueError(f"{bytes_per_block=} must be >= 1")
    if budget_bytes < 0:
        raise ValueError(f"{budget_bytes=} must be >= 0")
    return budget_bytes // bytes_per_block


def format_table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """A ``|``-separated table: the first column left-aligned, the others right-aligned.

    Cells are ``str()``-ed as given (format numbers before); every row must have
    ``len(headers)`` cells.
    """
    for i, row in enumerate(rows):
        if len(row) != len(headers):
            raise ValueError(f"row {i} has {len(row)} cells, expected {len(headers)} "
                             f"(one per header)")
    cells = [[str(h) for h in headers]] + [[str(c) for c in row] for row in rows]
    widths = [max(len(r[j]) for r in cells) for j in range(len(headers))]
    lines = []
    for r, row in enumerate(cells):
        parts = [row[0].ljust(widths[0])] + [c.rjust(w) for c, w in zip(row[1:], widths[1:])]
        lines.append(" | ".join(parts).rstrip())
        if r == 0:
            lines.append("-+-".join("-" * w for w in widths))
    return "\n".join(lines)


def command_line() -> str:
    """The command that is running, to print under its tables."""
    return " ".join([os.path.relpath(sys.executable)] + sys.argv)
