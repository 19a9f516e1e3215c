"""The GPU (Triton-lowered Pallas) ragged paged attention against the float32 reference.

Off a GPU every case runs the kernel in interpret mode; on a GPU the same cases run compiled,
so this file is also the hardware check (``benchmarks/gpu_check.sh``).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from paged_attention_cases import DECODE, GRID, PREFILL_EDGES, assert_matches_reference

import pallas_kernels.paged_attention_gpu as gpu_module
import pallas_kernels.paged_attention_gpu_plan as gpu_plan
from pallas_kernels import paged_attention
from pallas_kernels.example_inputs import make_case

ON_GPU = jax.default_backend() == "gpu"
# JAX 0.12 warns on every Triton lowering that the Pallas Triton backend is deprecated.
pytestmark = pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated")


def _attend(case, **kw):
    return paged_attention(*case.args(), layer=case.layer, impl="pallas_gpu",
                           interpret=not ON_GPU, **kw)


def _mixed_lengths(page_size: int):
    """DECODE and PREFILL_EDGES in one ragged batch: one compile covers both layouts."""
    (dq, dkv), (pq, pkv) = DECODE(page_size), PREFILL_EDGES(page_size)
    return dq + pq, dkv + pkv


# Split-K on every other grid entry: both paths see float32 and bfloat16 without doubling the
# number of interpret-mode compiles.
@pytest.mark.parametrize("dtype,page_size,head_dim,num_q_heads,num_kv_heads,num_splits",
                         [(*entry, 1 + i % 2) for i, entry in enumerate(GRID)])
def test_matches_reference(dtype, page_size, head_dim, num_q_heads, num_kv_heads, num_splits):
    q_lens, kv_lens = _mixed_lengths(page_size)
    case = make_case(0, q_lens=q_lens, kv_lens=kv_lens, dtype=dtype, page_size=page_size,
                     head_dim=head_dim, num_q_heads=num_q_heads, num_kv_heads=num_kv_heads)
    assert_matches_reference(case, _attend(case, num_splits=num_splits))


@pytest.mark.parametrize("sliding_window,soft_cap,num_splits",
                         [(1, None, 1), (9, 2.0, 3), (None, 5.0, 2)])
def test_window_and_soft_cap(sliding_window, soft_cap, num_splits):
    case = make_case(1, q_lens=[9, 1, 4], kv_lens=[9, 30, 20])
    kw = dict(sliding_window=sliding_window, soft_cap=soft_cap)
    assert_matches_reference(case, _attend(case, num_splits=num_splits, **kw), **kw)


def test_long_context_split_k():
    """Hundreds of keys per sequence over 4 splits: the combine of partial softmaxes."""
    case = make_case(3, q_lens=[1, 16], kv_lens=[500, 300], page_size=16, head_dim=64,
                     dtype=jnp.bfloat16)
    out = _attend(case, sm_scale=0.05, num_splits=4)
    assert_matches_reference(case, out, sm_scale=0.05)


@pytest.mark.parametrize("block_q,pages_per_compute_block,max_q_len",
                         [(8, 2, None), (32, 4, 7)])
def test_block_sizes_do_not_change_result(block_q, pages_per_compute_block, max_q_len):
    case = make_case(2, q_lens=[1, 7, 1, 5], kv_lens=[25, 7, 8, 40], page_size=8)
    out = _attend(case, block_q=block_q, pages_per_compute_block=pages_per_compute_block,
                  max_q_len=max_q_len)
    assert_matches_reference(case, out)


def test_decode_hint_float16():
    q_lens, kv_lens = DECODE(16)
    case = make_case(4, q_lens=q_lens, kv_lens=kv_lens, page_size=16, head_dim=64,
                     num_q_heads=8, num_kv_heads=2, dtype=jnp.float16)
    assert_matches_reference(case, _attend(case, max_q_len=1, num_splits=2))


def _group_of_three_case(seed: int):
    """6 query heads over 2 KV heads: the group of 3 is padded to 4 rows inside."""
    return make_case(seed, q_lens=[3, 1, 6], kv_lens=[3, 17, 30], num_q_heads=6, num_kv_heads=2)


def test_group_not_a_power_of_two():
    case = _group_of_three_case(5)
    assert_matches_reference(case, _attend(case))


def test_num_seqs_zero_gives_all_zero_output():
    case = _group_of_three_case(8)
    case.num_seqs = jnp.array([0], jnp.int32)
    np.testing.assert_array_equal(np.asarray(_attend(case)), 0.0)


def test_table_entries_past_last_page_are_not_followed():
    """Entries past a sequence's last page may hold out-of-pool ids; the kernel skips them."""
    case = _group_of_three_case(9)
    tables = np.asarray(case.block_tables).copy()
    num_blocks = case.kv_pages.shape[0]
    tables[0, 1:] = 10 * num_blocks  # 3 tokens: one page
    tables[1, 3:] = -7  # 17 tokens: three pages
    tables[3] = -1  # padding sequence
    case.block_tables = jnp.asarray(tables)
    assert_matches_reference(case, _attend(case))


def test_work_items_cover_every_query_token_once():
    """The work list matches a direct enumeration of (sequence, query block)."""
    cu = np.array([0, 5, 5, 6, 15, 15], np.int32)  # q_lens 5, 0, 1, 9, (padding seq)
    seq_lens = np.array([7, 4, 30, 9, 0], np.int32)
    plan = gpu_plan.Plan(num_kv_heads=1, group=4, group_pad=4, block_q=4, page_size=8,
                            pages_per_block=2, num_work=gpu_plan.num_work_items(16, 5, 4, 16),
                            num_splits=1)
    work_items = jax.jit(gpu_plan.work_items, static_argnums=3)  # one compile, not per op
    work = np.asarray(work_items(jnp.asarray(cu), jnp.asarray(seq_lens),
                                 jnp.array([4], jnp.int32), plan))
    expected = []
    for s in range(4):
        q_len = cu[s + 1] - cu[s]
        for first in range(0, q_len, 4):
            rows = min(4, q_len - first)
            expected.append([s, cu[s] + first, rows, seq_lens[s] - q_len + first, seq_lens[s]])
    assert work.shape[0] >= len(expected)
    np.testing.assert_array_equal(work[: len(expected)], expected)
    np.testing.assert_array_equal(work[len(expected):, 2], 0)  # spare items have no rows


def test_work_item_bound_holds_for_any_layout():
    rng = np.random.default_rng(0)
    for _ in range(300):
        num_tokens, max_num_seqs = int(rng.integers(1, 64)), int(rng.integers(1, 16))
        block_q = int(2 ** rng.integers(0, 5))
        q_lens = rng.multinomial(int(rng.integers(0, num_tokens + 1)),
                                 np.ones(max_num_seqs) / max_num_seqs)
        max_q_len = max(1, int(q_lens.max()))
        needed = int(np.sum(-(-q_lens // block_q)))
        assert needed <= gpu_plan.num_work_items(num_tokens, max_num_seqs, block_q, max_q_len)
    # A decode batch (one token per sequence) gets exactly one item per token.
    assert gpu_plan.num_work_items(256, 256, 4, 1) == 256
    assert gpu_plan.num_work_items(256, 256, 4, 256) == 256


@pytest.mark.parametrize("kw,case_kw,match", [
    ({}, dict(head_dim=48), r"head_dim=48 must be a power of two"),
    ({}, dict(page_size=12), r"page_size=12 must be a power of two"),
    (dict(pages_per_compute_block=1), dict(page_size=8),
     r"pages_per_compute_block=1 must be a power of two with .*page_size=8"),
    (dict(pages_per_compute_block=3), dict(page_size=16), r"pages_per_compute_block=3"),
    (dict(block_q=2), {}, r"block_q=2 must be a power of two with block_q \* group_pad=2"),
    (dict(num_splits=0), {}, r"num_splits=0 must be a positive int"),
    (dict(max_q_len=0), {}, r"max_q_len=0 must be a positive int"),
])
def test_rejects_configs_the_gpu_kernel_cannot_run(kw, case_kw, match):
    case = make_case(10, q_lens=[1, 2], kv_lens=[5, 9], **case_kw)
    with pytest.raises(ValueError, match=match):
        _attend(case, **kw)


@pytest.mark.skipif(ON_GPU, reason="on a GPU the other tests compile the kernel for real")
def test_lowers_to_a_triton_kernel_with_the_planned_grid(monkeypatch):
    """Lowering for CUDA without a GPU catches ops or tile shapes Triton cannot take."""
    gpu_info = pytest.importorskip("jax._src.pallas.triton.gpu_info")
    h200 = gpu_info.GpuInfo(gpu_version=gpu_info.GpuVersion.H200, arch_name="9.0",
                            compute_capability=90)
    monkeypatch.setattr(gpu_info, "get_gpu_info", lambda *a, **k: h200)
    case = make_case(11, q_lens=[1] * 6, kv_lens=[40, 3, 17, 64, 1, 9], page_size=16,
                     head_dim=64, num_q_heads=8, num_kv_heads=2, dtype=jnp.bfloat16,
                     pad_seqs=2, pad_tokens=2, pages_per_seq=64)
    fn = jax.jit(lambda *a: gpu_module.paged_attention_gpu(
        *a, layer=1, sm_scale=0.1, soft_cap=3.0, sliding_window=20, pages_per_compute_block=8))
    text = fn.trace(*case.args()).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("__gpu$xla.gpu.triton") == 1
    # A decode batch of 8 token slots: one work item each, times 2 KV heads, is far too few
    # programs, so split-K cuts the 64-page table (8 steps of 8 pages) into 4 shares.
    assert "grid_x = 8 : i32, grid_y = 2 : i32, grid_z = 4 : i32" in text
