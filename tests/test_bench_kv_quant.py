"""The pure helpers of the KV quantization benchmarks (the benchmarks themselves never run here)."""

import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

from bench_kv_quant_quality import greedy_agreement  # noqa: E402
from bench_kv_quant_replay import tier_blocks, trace_block_bytes  # noqa: E402
from kv_quant_common import GIB, LLAMA3_8B, blocks_in, format_table  # noqa: E402

from pallas_kernels.kv_format import KVFormat  # noqa: E402


def test_trace_block_bytes_by_hand():
    # 512 tokens = 32 pages of 16; a page: 32 layers x K,V x 8 heads x 16 tokens x 128 dims.
    elements = 32 * 2 * 8 * 16 * 128
    assert trace_block_bytes(LLAMA3_8B, KVFormat(), 512) == 32 * elements * 2  # bfloat16
    token_scales = 32 * 2 * 8 * 16 * 4  # one float32 per token, K/V and head
    assert trace_block_bytes(LLAMA3_8B, KVFormat("int8", "token"), 512) == 32 * (elements + token_scales)
    page_scales = 32 * 2 * 8 * 4  # one float32 per page, K/V and head
    assert trace_block_bytes(LLAMA3_8B, KVFormat("fp8_e4m3", "page"), 512) == 32 * (elements + page_scales)


def test_tier_blocks_at_the_stated_budget():
    budgets = {"device": 2 * GIB, "host": 16 * GIB}
    assert tier_blocks(LLAMA3_8B, KVFormat(), budgets, 512) == {"device": 32, "host": 256}
    # int8 with token scales: 33 MiB per block; 2 GiB / 33 MiB = 62.06, 16 GiB / 33 MiB = 496.5.
    assert tier_blocks(LLAMA3_8B, KVFormat("int8", "token"), budgets, 512) == {"device": 62, "host": 496}


def test_trace_block_must_be_whole_pages():
    with pytest.raises(ValueError, match="block_tokens=500 must be a multiple of page_size=16"):
        trace_block_bytes(LLAMA3_8B, KVFormat(), 500)


def test_blocks_in():
    assert blocks_in(10, 3) == 3
    assert blocks_in(2, 3) == 0
    with pytest.raises(ValueError, match="bytes_per_block=0 must be >= 1"):
        blocks_in(10, 0)
    with pytest.raises(ValueError, match="budget_bytes=-1 must be >= 0"):
        blocks_in(-1, 3)


def test_format_table_aligns_columns():
    table = format_table(["format", "x"], [["int8", "1.5"], ["fp8_e5m2/page", "10.25"]])
    assert table.splitlines() == [
        "format        |     x",
        "--------------+------",
        "int8          |   1.5",
        "fp8_e5m2/page | 10.25",
    ]


def test_format_table_rejects_ragged_rows():
    with pytest.raises(ValueError, match="row 1 has 1 cells, expected 2"):
        format_table(["a", "b"], [["1", "2"], ["3"]])


def test_greedy_agreement_counts_positions_prefixes_and_requests():
    reference = {"a": np.array([1, 2, 3, 4]), "b": np.array([5, 6])}
    other = {"a": np.array([1, 2, 9, 4]), "b": np.array([5, 6])}
    agree = greedy_agreement(reference, other)
    assert agree.identical_tokens == pytest.approx(5 / 6)  # 3 of a's 4, both of b's
    assert agree.mean_prefix == pytest.approx((2 + 2) / 2)  # a differs at index 2
    assert agree.identical_requests == pytest.approx(1 / 2)
    assert agree.mean_length == pytest.approx(3)


def test_greedy_agreement_missing_and_short_outputs_differ():
    reference = {"a": np.array([1, 2, 3]), "b": np.array([4])}
    agree = greedy_agreement(reference, {"a": np.array([1, 2])})
    assert agree.identical_tokens == pytest.approx(2 / 4)
    assert agree.mean_prefix == pytest.approx((2 + 0) / 2)
    assert agree.identical_requests == 0.0
    with pytest.raises(ValueError, match="reference has no requests"):
        greedy_agreement({}, {})
