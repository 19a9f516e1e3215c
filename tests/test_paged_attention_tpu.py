"""The TPU (Mosaic) paged-attention kernel under the TPU interpreter, against the reference.

The interpreter simulates VMEM, DMAs and semaphores on CPU and fills fresh VMEM with NaN, so
a read of a slot that was never fetched shows up as NaN. Each distinct shape or static option
costs one interpreter compile (seconds on this machine), so the grid is a small TPU-legal
subset of the shared one; cases reuse shapes where they can.
"""

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu
from paged_attention_cases import DECODE, PREFILL_EDGES, assert_matches_reference

from pallas_kernels import paged_attention
from pallas_kernels.example_inputs import make_case
from pallas_kernels.paged_attention_tpu import paged_attention_tpu

# (dtype, page_size, head_dim, num_q_heads, num_kv_heads): shapes the TPU tiling accepts.
TPU_GRID = [
    (jnp.float32, 8, 128, 4, 2),
    (jnp.float32, 16, 256, 8, 1),
    (jnp.bfloat16, 16, 128, 8, 2),
]


def _tpu(case, **kwargs):
    return paged_attention(*case.args(), layer=case.layer, impl="pallas_tpu", interpret=True,
                           **kwargs)


@pytest.mark.parametrize("dtype,page_size,head_dim,num_q_heads,num_kv_heads", TPU_GRID)
@pytest.mark.parametrize("lengths", [DECODE, PREFILL_EDGES])
def test_matches_reference(dtype, page_size, head_dim, num_q_heads, num_kv_heads, lengths):
    q_lens, kv_lens = lengths(page_size)
    case = make_case(0, q_lens=q_lens, kv_lens=kv_lens, dtype=dtype, page_size=page_size,
                     head_dim=head_dim, num_q_heads=num_q_heads, num_kv_heads=num_kv_heads)
    assert_matches_reference(case, _tpu(case))


def _mixed_case(seed=1):
    # A 21-token prefill spanning query blocks, a chunk over 3 cached pages, a sequence with
    # cached KV but no new token this step, two decodes.
    return make_case(seed, q_lens=[21, 4, 0, 1, 1], kv_lens=[21, 28, 17, 40, 9], head_dim=128)


@pytest.mark.parametrize("sliding_window,soft_cap", [(5, None), (9, 2.0)])
def test_window_and_soft_cap(sliding_window, soft_cap):
    case = _mixed_case()
    kw = dict(sliding_window=sliding_window, soft_cap=soft_cap)
    assert_matches_reference(case, _tpu(case, block_q=8, pages_per_block=2, **kw), **kw)


def test_big_blocks_span_many_sequences():
    """A 32-token block holds a prefill, a chunk, an idle and two decode sequences at once;
    3 pages per item leaves a short last run (the 40-token sequence has 5 pages)."""
    case = _mixed_case()
    assert_matches_reference(case, _tpu(case, block_q=32, pages_per_block=3))


def _random_batch(rng, *, max_seqs=6, max_tokens=48, max_kv=48):
    """Random ragged lengths: decodes, whole prefills, chunks over cached KV, idle sequences."""
    q_lens, kv_lens = [], []
    for _ in range(rng.integers(1, max_seqs + 1)):
        kv = int(rng.integers(1, max_kv + 1))
        q = int(rng.choice([1, kv, rng.integers(1, kv + 1), 0]))
        if sum(q_lens) + q <= max_tokens:
            q_lens.append(q)
            kv_lens.append(kv if q else int(rng.integers(0, max_kv + 1)))
    return q_lens, kv_lens


def test_random_ragged_batches():
    """Fixed shapes (one compile), random lengths: whatever mix lands in a query block."""
    rng = np.random.default_rng(7)
    max_seqs, max_tokens, pages_per_seq, num_blocks = 6, 48, 6, 40
    for seed in range(6):
        q_lens, kv_lens = _random_batch(rng)
        pages = sum(-(-kv // 8) for kv in kv_lens)
        case = make_case(seed, q_lens=q_lens, kv_lens=kv_lens, head_dim=128,
                         pages_per_seq=pages_per_seq, pad_seqs=max_seqs - len(q_lens),
                         pad_tokens=max_tokens - sum(q_lens),
                         spare_pages=num_blocks - 1 - pages)
        # One page per item: the most item changes, each prefetching across a sequence edge.
        assert_matches_reference(case, _tpu(case, block_q=8, pages_per_block=1))


def test_no_races_in_double_buffering():
    case = _mixed_case()
    params = pltpu.InterpretParams(detect_races=True, dma_execution_mode="eager")
    out = paged_attention_tpu(*case.args(), layer=case.layer, sm_scale=0.125, interpret=params,
                              block_q=8, pages_per_block=2)
    assert_matches_reference(case, out, sm_scale=0.125)


def test_num_seqs_zero_gives_all_zero_output():
    case = _mixed_case()  # same shapes and options as above: no new compile
    case.num_seqs = jnp.array([0], jnp.int32)
    out = _tpu(case, block_q=32, pages_per_block=3)
    np.testing.assert_array_equal(np.asarray(out, np.float32), 0.0)


def test_attention_follows_the_table():
    """Swapping two decode sequences' table rows and lengths swaps their outputs."""
    case = _mixed_case(seed=2)
    case.q = case.q.at[26].set(case.q[25])  # both decode tokens ask the same question
    tables = np.asarray(case.block_tables).copy()
    tables[[3, 4]] = tables[[4, 3]]
    lens = np.asarray(case.seq_lens).copy()
    lens[[3, 4]] = lens[[4, 3]]
    swapped = dataclasses.replace(case, block_tables=jnp.asarray(tables),
                                  seq_lens=jnp.asarray(lens))
    out = _tpu(case, block_q=32, pages_per_block=3)
    out_swapped = _tpu(swapped, block_q=32, pages_per_block=3)
    assert not np.allclose(out[25], out[26])
    np.testing.assert_allclose(out_swapped[25], out[26], rtol=1e-6)
    np.testing.assert_allclose(out_swapped[26], out[25], rtol=1e-6)


def test_empty_batch_returns_empty():
    case = make_case(3, q_lens=[], kv_lens=[], head_dim=128, pad_tokens=0)
    out = _tpu(case)
    assert out.shape == (0, 4, 128)


@pytest.mark.parametrize("kwargs,match", [
    (dict(dtype=jnp.float16), r"dtype=float16 is not supported by the TPU kernel"),
    (dict(page_size=8, dtype=jnp.bfloat16), r"page_size=8 must be a multiple of 16"),
    (dict(page_size=12), r"page_size=12 must be a multiple of 8"),
    (dict(head_dim=64), r"head_dim=64 must be a multiple of 128"),
])
def test_rejects_layouts_the_tpu_cannot_tile(kwargs, match):
    case = make_case(4, q_lens=[1], kv_lens=[3], **{"head_dim": 128, **kwargs})
    with pytest.raises(ValueError, match=match):
        _tpu(case)


@pytest.mark.parametrize("tuning,match", [
    (dict(block_q=3), r"block_q=3 must be positive with block_q \* group \(group=2\) a multiple"),
    (dict(block_q=0), r"block_q=0 must be positive"),
    (dict(pages_per_block=0), r"pages_per_block=0 must be a positive number of pages"),
])
def test_rejects_bad_tuning(tuning, match):
    case = make_case(4, q_lens=[1], kv_lens=[3], head_dim=128)
    with pytest.raises(ValueError, match=match):
        _tpu(case, **tuning)
