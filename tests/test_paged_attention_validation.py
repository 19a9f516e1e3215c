"""Every validation message of the paged-attention wrapper and the host-side metadata check,
and how an implementation is chosen (the dispatch table)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels import (
    check_paged_attention_metadata,
    check_slot_mapping,
    paged_attention,
    scatter_blocks,
)
from pallas_kernels.backend import IMPLS, resolve_impl, resolve_interpret
from pallas_kernels.dispatch import KERNELS, OPS, select, tuning_keys
from pallas_kernels.example_inputs import make_case


@pytest.fixture(scope="module")
def case():
    return make_case(0, q_lens=[2, 1], kv_lens=[5, 9])


def _call(case, **overrides):
    args = dict(q=case.q, kv_pages=case.kv_pages, block_tables=case.block_tables,
                seq_lens=case.seq_lens, cu_q_lens=case.cu_q_lens, num_seqs=case.num_seqs)
    kw = dict(layer=case.layer, impl="xla")
    for name, value in overrides.items():
        (args if name in args else kw)[name] = value
    return paged_attention(**args, **kw)


@pytest.mark.parametrize("override,message", [
    (lambda c: dict(kv_pages=c.kv_pages[0]), r"kv_pages.shape=.* must be \[num_blocks"),
    (lambda c: dict(layer=2), r"layer=2 is out of range for num_layers=2"),
    (lambda c: dict(layer=1.0), r"layer=1.0 must be a Python int"),
    (lambda c: dict(q=c.q[:, :, :16]), r"q head_dim=16 must equal the pool's head_dim=32"),
    (lambda c: dict(q=c.q[:, :3]), r"num_q_heads=3 must be a multiple of num_kv_heads=2"),
    (lambda c: dict(q=c.q[0]), r"q.shape=\(4, 32\) must be \[num_tokens"),
    (lambda c: dict(q=c.q.astype(jnp.int32)), r"q.dtype=int32 must be one of"),
    (lambda c: dict(q=c.q.astype(jnp.bfloat16)), r"kv_pages.dtype=float32 must equal q.dtype"),
    (lambda c: dict(block_tables=c.block_tables.astype(jnp.float32)),
     r"block_tables.dtype=float32 must be int32"),
    (lambda c: dict(block_tables=c.block_tables[0]), r"block_tables.shape=.* must have rank 2"),
    (lambda c: dict(seq_lens=c.seq_lens[:2]), r"seq_lens.shape=\(2,\) must be \(3,\)"),
    (lambda c: dict(cu_q_lens=c.cu_q_lens[:3]), r"cu_q_lens.shape=\(3,\) must be \(4,\)"),
    (lambda c: dict(num_seqs=jnp.array(2, jnp.int32)), r"num_seqs must be int32\[1\]"),
    (lambda c: dict(sliding_window=0), r"sliding_window=0 must be an int in \[1, 2\*\*31\) or None"),
    (lambda c: dict(soft_cap=-1.0), r"soft_cap=-1.0 must be a finite positive float"),
    (lambda c: dict(sm_scale=0.0), r"sm_scale=0.0 must be a finite positive float"),
    (lambda c: dict(impl="cuda"), r"impl='cuda' is not a known implementation"),
    # a list, a bool layer and a string scale were an AttributeError, layer 1 and a TypeError
    (lambda c: dict(block_tables=np.asarray(c.block_tables).tolist()),
     r"^block_tables must be an array \(jax or numpy\), got list$"),
    (lambda c: dict(block_tables=np.asarray(c.block_tables).tolist(), num_seqs=None),
     r"^block_tables must be an array \(jax or numpy\), got list$"),
    (lambda c: dict(q=np.asarray(c.q).tolist()), r"^q must be an array \(jax or numpy\), got list$"),
    (lambda c: dict(kv_pages=None), r"^kv_pages must be an array \(jax or numpy\), got NoneType$"),
    (lambda c: dict(layer=True), r"^layer=True must be a Python int"),
    (lambda c: dict(sm_scale="1"), r"^sm_scale='1' must be a finite positive float or None$"),
    (lambda c: dict(soft_cap=[30.0]), r"^soft_cap=\[30.0\] must be a finite positive float or None$"),
])
def test_static_errors(case, override, message):
    with pytest.raises(ValueError, match=message):
        _call(case, **override(case))


def test_pallas_cannot_compile_off_its_backend():
    assert resolve_impl(None) == "xla"  # this suite runs on CPU
    assert resolve_interpret("pallas_gpu", None) is True
    assert resolve_interpret("xla", True) is False
    with pytest.raises(ValueError, match=r"impl='pallas_tpu' cannot compile on backend 'cpu'"):
        resolve_interpret("pallas_tpu", False)


def test_every_op_has_every_implementation():
    assert set(OPS) == {"paged_attention", "write_kv", "write_kv_quantized", "gather_blocks",
                        "scatter_blocks"}
    assert set(KERNELS) == {(op, impl) for op in OPS for impl in IMPLS}


def test_select_binds_interpret_to_pallas_implementations_only():
    assert select("write_kv", "xla", interpret=True) is KERNELS["write_kv", "xla"]
    write = select("write_kv", "pallas_tpu")
    assert write.func is KERNELS["write_kv", "pallas_tpu"] and write.keywords == {"interpret": True}
    with pytest.raises(ValueError, match=r"impl='pallas_gpu' cannot compile on backend 'cpu'"):
        select("gather_blocks", "pallas_gpu", interpret=False)
    with pytest.raises(ValueError, match=r"impl='cuda' is not a known implementation"):
        select("write_kv", "cuda")


def test_tuning_a_kernel_does_not_take_is_refused_by_name():
    # A GPU config's num_warps on the CPU path, and a typo, each named with what the impl takes.
    with pytest.raises(ValueError, match=r"tuning \['num_warps'\] is not taken by gather_blocks with "
                                         r"impl='xla'; it takes none"):
        select("gather_blocks", "xla", tuning={"num_warps": 4})
    with pytest.raises(ValueError, match=r"tuning \['block_k'\] is not taken by paged_attention with "
                                         r"impl='pallas_tpu'; expected some of \['block_q', 'pages_per_block', "
                                         r"'vmem_limit_bytes'\]"):
        select("paged_attention", "pallas_tpu", tuning={"block_q": 8, "block_k": 8})
    # The quantized write passes its tuning on to the plain write of its impl.
    assert tuning_keys("write_kv_quantized", "pallas_tpu") == tuning_keys("write_kv", "pallas_tpu") == (
        "tokens_per_step",)
    for op, impl in KERNELS:  # every impl takes its own tuning keywords
        select(op, impl, tuning=tuning_keys(op, impl))
    pages = jnp.arange(2 * 8, dtype=jnp.float32).reshape(2, 1, 2, 1, 2, 2)
    with pytest.raises(ValueError, match=r"tuning \['num_warps'\] is not taken by scatter_blocks"):
        scatter_blocks(pages, jnp.array([1], jnp.int32), pages[:1], impl="xla", num_warps=4)


def test_defaults_per_backend(monkeypatch):
    assert select("paged_attention") is KERNELS["paged_attention", "xla"]  # CPU
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    attend = select("paged_attention")
    assert attend.func is KERNELS["paged_attention", "pallas_gpu"]
    assert attend.keywords == {"interpret": False}
    # Block copies are plain copies: on GPU XLA's gather/scatter is the default.
    assert select("gather_blocks") is KERNELS["gather_blocks", "xla"]
    assert select("scatter_blocks") is KERNELS["scatter_blocks", "xla"]


def test_example_inputs_reject_more_new_tokens_than_kv():
    with pytest.raises(ValueError, match=r"q_lens=\[3, 1\] must not exceed kv_lens=\[2, 9\]"):
        make_case(0, q_lens=[3, 1], kv_lens=[2, 9])


def _metadata(case, **overrides):
    meta = dict(block_tables=case.block_tables, seq_lens=case.seq_lens,
                cu_q_lens=case.cu_q_lens, num_seqs=case.num_seqs)
    meta.update(overrides)
    check_paged_attention_metadata(**meta, num_blocks=case.kv_pages.shape[0], page_size=8,
                                   num_tokens=case.q.shape[0])


def test_metadata_accepts_a_valid_batch(case):
    _metadata(case)


@pytest.mark.parametrize("override,message", [
    (dict(num_seqs=np.array([4])), r"num_seqs=4 must be within \[0, 3\]"),
    (dict(cu_q_lens=np.array([1, 2, 3, 3])), r"cu_q_lens\[0\]=1 must be 0"),
    (dict(cu_q_lens=np.array([0, 2, 1, 1])), r"cu_q_lens\[2\]=1 < cu_q_lens\[1\]=2"),
    (dict(cu_q_lens=np.array([0, 2, 99, 99])), r"cu_q_lens\[num_seqs\]=99 exceeds num_tokens=6"),
    (dict(seq_lens=np.array([1, 9, 0])), r"seq_lens\[0\]=1 must be >= its query length 2"),
    (dict(seq_lens=np.array([5, 99, 0])), r"seq_lens\[1\]=99 .* capacity 24 tokens"),
])
def test_metadata_errors(case, override, message):
    with pytest.raises(ValueError, match=message):
        _metadata(case, **override)


def test_metadata_rejects_block_outside_pool(case):
    tables = np.array(case.block_tables)
    tables[1, 1] = 1000
    with pytest.raises(ValueError, match=r"block_tables\[1, 1\]=1000 is outside the pool"):
        _metadata(case, block_tables=tables)


def test_slot_mapping_errors():
    check_slot_mapping(np.array([0, 5, -1, -1]), num_blocks=2, page_size=4)
    with pytest.raises(ValueError, match=r"slot 8 is outside the pool of 8 slots"):
        check_slot_mapping(np.array([0, 8]), num_blocks=2, page_size=4)
    with pytest.raises(ValueError, match=r"slot 3 is written more than once"):
        check_slot_mapping(np.array([3, 1, 3]), num_blocks=2, page_size=4)


@pytest.mark.parametrize("override,message", [
    (lambda c: dict(soft_cap=float("inf")), r"soft_cap=inf must be a finite positive float"),  # NaN everywhere
    (lambda c: dict(sm_scale=float("inf")), r"sm_scale=inf must be a finite positive float"),
    (lambda c: dict(num_seqs=2), r"num_seqs=2 must be an int32\[1\] array"),
    (lambda c: dict(sliding_window=2**40), r"sliding_window=1099511627776 must be an int in \[1, 2\*\*31\)"),
    (lambda c: dict(sliding_window=True), r"sliding_window=True must be an int"),
    (lambda c: dict(block_tables=c.block_tables[:0], seq_lens=c.seq_lens[:0], cu_q_lens=c.cu_q_lens[:1],
                    num_seqs=jnp.array([0], jnp.int32)), r"block_tables.shape=\(0, \d+\) has no row"),
])
def test_static_errors_past_the_ordinary_ones(case, override, message):
    with pytest.raises(ValueError, match=message):
        _call(case, **override(case))


def test_a_numpy_int_sliding_window_is_an_int(case):
    np.testing.assert_array_equal(np.asarray(_call(case, sliding_window=np.int32(3))),
                                  np.asarray(_call(case, sliding_window=3)))


@pytest.mark.parametrize("impl", IMPLS)
def test_an_empty_batch_gives_an_empty_result_on_every_implementation(impl):
    # head_dim 128: what the TPU layout takes; the Triton path used to fail its own bound
    case = make_case(0, q_lens=[0, 0], kv_lens=[4, 0], pad_tokens=0, head_dim=128)
    out = _call(case, impl=impl)
    assert out.shape == case.q.shape == (0, *case.q.shape[1:])


def test_tpu_simulator_settings_reach_the_kernel_as_given():
    params = pltpu.InterpretParams(detect_races=True)
    assert resolve_interpret("pallas_tpu", params) is params  # it used to become True: the defaults
    assert select("gather_blocks", "pallas_tpu", params).keywords == {"interpret": params}
    with pytest.raises(ValueError, match=r"configures the TPU simulator; impl='pallas_gpu' takes a bool or None"):
        resolve_interpret("pallas_gpu", params)
