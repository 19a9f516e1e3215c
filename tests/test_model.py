"""The tiny Flax model: the paged forward must match the dense, uncached forward."""

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from kvjax.serving.model import BatchInputs, ModelConfig, Transformer

PAGE = 8


def _pool(cfg, num_blocks=16):
    # NaN, not zeros: any read of a slot the model never wrote shows up in the logits.
    return jnp.full((num_blocks, cfg.num_layers, 2, cfg.num_kv_heads, PAGE, cfg.head_dim),
                    jnp.nan, jnp.float32)


BUCKET = 32  # every step padded to one token count: one compilation for the whole file


@nnx.jit
def _forward(model, batch, pool):
    return model(batch, pool)


def _step(model, pool, tokens, blocks, start, end):
    n = end - start
    pos = np.zeros(BUCKET, np.int32)
    pos[:n] = np.arange(start, end)
    slots = np.full(BUCKET, -1, np.int32)
    slots[:n] = [blocks[p // PAGE] * PAGE + p % PAGE for p in range(start, end)]
    padded = np.zeros(BUCKET, np.int32)
    padded[:n] = tokens[start:end]
    table = np.zeros((1, 8), np.int32)
    table[0, : len(blocks)] = blocks
    batch = BatchInputs(
        tokens=jnp.asarray(padded), positions=jnp.asarray(pos),
        slot_mapping=jnp.asarray(slots), block_tables=jnp.asarray(table),
        seq_lens=jnp.array([end], jnp.int32), cu_q_lens=jnp.array([0, n], jnp.int32),
        num_seqs=jnp.array([1], jnp.int32))
    logits, pool = _forward(model, batch, pool)
    return logits[:n], pool


@nnx.jit
def _dense(model, tokens):
    return model.forward_dense(tokens)


@pytest.fixture(scope="module")
def model():
    return Transformer(ModelConfig(num_layers=2, d_model=64, num_q_heads=4, num_kv_heads=2,
                                   head_dim=16, mlp_dim=128))


@pytest.mark.parametrize("chunks", [[21], [8, 13], [5, 1, 1, 14], [16, 5]])
def test_chunked_paged_prefill_matches_dense(model, chunks):
    tokens = np.random.default_rng(1).integers(0, 256, sum(chunks)).astype(np.int32)
    blocks = [7, 2, 11]  # shuffled, non-contiguous pages
    pool, outs, start = _pool(model.cfg), [], 0
    for n in chunks:
        logits, pool = _step(model, pool, tokens, blocks, start, start + n)
        outs.append(logits)
        start += n
    dense = _dense(model, jnp.asarray(tokens))
    np.testing.assert_allclose(np.concatenate(outs), dense, atol=2e-5, rtol=2e-5)


def test_reused_prefix_pages_give_the_same_logits(model):
    """A second sequence that maps the first one's full pages and prefills only its tail."""
    rng = np.random.default_rng(2)
    prefix = rng.integers(0, 256, 2 * PAGE).astype(np.int32)
    a = np.concatenate([prefix, rng.integers(0, 256, 3).astype(np.int32)])
    b = np.concatenate([prefix, rng.integers(0, 256, 6).astype(np.int32)])
    pool = _pool(model.cfg)
    _, pool = _step(model, pool, a, [3, 9, 4], 0, len(a))
    # b shares blocks 3 and 9 (the prefix) and computes only its own 6 tokens.
    logits_b, _ = _step(model, pool, b, [3, 9, 12], 2 * PAGE, len(b))
    dense_b = _dense(model, jnp.asarray(b))[2 * PAGE:]
    np.testing.assert_allclose(logits_b, dense_b, atol=2e-5, rtol=2e-5)


def test_config_errors():
    with pytest.raises(ValueError, match=r"num_q_heads=3 must be a multiple of num_kv_heads=2"):
        ModelConfig(num_q_heads=3)
    with pytest.raises(ValueError, match=r"head_dim=7 must be even"):
        ModelConfig(head_dim=7)
    with pytest.raises(ValueError, match=r"unknown model config keys \['layers'\]"):
        ModelConfig.from_dict({"layers": 3})
    for theta in (float("nan"), -1.0, 0.0, float("inf"), "1e4", True):  # NaN logits, silently, or a trace error
        with pytest.raises(ValueError, match=r"rope_theta=.* must be a finite number > 0"):
            ModelConfig(rope_theta=theta)
    with pytest.raises(ValueError, match=r"vocab_size=True must be a positive int"):
        ModelConfig(vocab_size=True)


def _edited(cfg, seed, edit):
    """A model of ``cfg`` and ``seed`` whose first MLP up kernel went through ``edit`` (in numpy)."""
    model = Transformer(cfg, seed=seed)
    state = nnx.state(model, nnx.Param)
    params = nnx.to_pure_dict(state)
    kernel = params["layers"][0]["up"]["kernel"]
    values = np.array(kernel)
    edit(values)
    params["layers"][0]["up"]["kernel"] = jnp.asarray(values, kernel.dtype)
    nnx.replace_by_pure_dict(state, params)
    nnx.update(model, state)
    return model


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_model_digest_names_the_weights_down_to_one_bit(dtype):
    # the digest is computed on device (fingerprints per parameter); it must still tell apart
    # weights that differ in one bit of one element, or in where two elements sit
    from kvjax.serving.model import model_digest

    cfg = ModelConfig(num_layers=2, d_model=32, num_q_heads=2, num_kv_heads=1, head_dim=16, mlp_dim=64, dtype=dtype)
    base = model_digest(_edited(cfg, 0, lambda v: None))
    assert base == model_digest(_edited(cfg, 0, lambda v: None))  # the same weights, another object

    def flip_low_bit(values):
        bits = values.reshape(-1).view(np.uint16 if values.dtype.itemsize == 2 else np.uint32)
        bits[values.size // 2] ^= 1

    def swap_two(values):
        flat = values.reshape(-1)
        flat[[0, 1]] = flat[[1, 0]]

    edits = {"flip": flip_low_bit, "swap": swap_two, "negate": lambda v: np.negative(v, out=v)}
    digests = {name: model_digest(_edited(cfg, 0, edit)) for name, edit in edits.items()}
    digests["seed"] = model_digest(_edited(cfg, 1, lambda v: None))
    digests["rope"] = model_digest(_edited(dataclasses.replace(cfg, rope_theta=500.0), 0, lambda v: None))
    assert len(set(digests.values()) | {base}) == len(digests) + 1, digests
