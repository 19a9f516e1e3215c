"""A small decoder-only transformer (Flax NNX) whose attention runs on the kvjax page pool.

RoPE, GQA, RMSNorm and a SwiGLU MLP. Weights are random unless loaded (:func:`load_weights`;
the ``tiny`` preset ships trained ones); nothing is downloaded.
Two forward passes share every weight:

* :meth:`Transformer.__call__` runs a ragged batch (prefill chunks and decodes mixed) on the
  page pool: each layer writes the new tokens' K/V into their slots with
  :func:`pallas_kernels.write_kv` and attends with :func:`pallas_kernels.paged_attention`;
* :meth:`Transformer.forward_dense` runs one whole sequence with plain causal attention and no
  cache: the yardstick the cached path must match.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import pallas_kernels
from kvjax.config.from_mapping import config_from_dict

__all__ = ["ModelConfig", "Transformer", "BatchInputs", "load_weights", "model_digest", "save_weights"]


@dataclasses.dataclass(frozen=True, slots=True)
class ModelConfig:
    vocab_size: int = 256
    num_layers: int = 2
    d_model: int = 128
    num_q_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 32
    mlp_dim: int = 256
    rope_theta: float = 10000.0
    dtype: str = "float32"

    def __post_init__(self):
        for name in ("vocab_size", "num_layers", "d_model", "num_q_heads", "num_kv_heads",
                     "head_dim", "mlp_dim"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r} must be a positive int")
        theta = self.rope_theta  # NaN, 0 or a negative base gives NaN logits, silently
        if isinstance(theta, bool) or not isinstance(theta, (int, float)) or not 0.0 < theta < math.inf:
            raise ValueError(f"rope_theta={theta!r} must be a finite number > 0 (RoPE's base, e.g. 10000.0)")
        if self.num_q_heads % self.num_kv_heads:
            raise ValueError(
                f"num_q_heads={self.num_q_heads} must be a multiple of "
                f"num_kv_heads={self.num_kv_heads}")
        if self.head_dim % 2:
            raise ValueError(f"head_dim={self.head_dim} must be even for RoPE")
        if self.dtype not in ("float32", "bfloat16", "float16"):
            raise ValueError(f"dtype={self.dtype!r} must be float32, bfloat16 or float16")

    @classmethod
    def from_dict(cls, values: dict) -> "ModelConfig":
        return config_from_dict(cls, values, "model config")

    @property
    def jnp_dtype(self):
        return jnp.dtype(self.dtype)


def save_weights(model: "Transformer", path: str | Path, *, dtype: str | None = None) -> None:
    """Writes the model's parameters to ``path``, which must not exist.

    ``path`` ending in ``.npz``: one compressed numpy file (the shipped weights' format), its
    arrays stored in ``dtype`` (default: the model's; "float16" halves a float32 model).
    Otherwise: an orbax checkpoint directory (``dtype`` must then be None).
    """
    path = Path(path).resolve()
    if path.exists():
        raise ValueError(f"weights path {str(path)!r} already exists; expected a new path")
    params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    if path.suffix == ".npz":
        arrays = {name: np.asarray(leaf, dtype or leaf.dtype) for name, leaf in _named_leaves(params)}
        with path.open("xb") as f:
            np.savez_compressed(f, **arrays)
        return
    if dtype is not None:
        raise ValueError(f"dtype={dtype!r} applies to .npz files only; {str(path)!r} is an orbax directory")
    import orbax.checkpoint as ocp  # the serving path never needs it

    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(path, params)
        checkpointer.wait_until_finished()


def model_digest(model: "Transformer") -> str:
    """SHA-256 (hex) of the model's config (RoPE's base and the dtype shape KV as much as the
    weights do) and, per parameter, its name, dtype, shape and a 64-bit fingerprint of its
    values: two models share it only when they compute the same KV (a cache's ``model_id``).

    The fingerprints are computed where the parameters live (one jitted pass over them, on the
    accelerator for a served model) and only 8 bytes per parameter come to the host: reading
    every weight into host memory to hash it there took a device-to-host copy of the whole
    model at each start (and failed outright on parameters sharded over several hosts). A
    fingerprint is two sums over the parameter's 32-bit words of bijective mixes of the word
    and its position (``_fingerprint``): two parameters that differ in exactly one word always
    differ, and another change goes unseen with a chance of about 2**-64. An identity check,
    not a defence against crafted weights."""
    named = _named_leaves(nnx.to_pure_dict(nnx.state(model, nnx.Param)))
    digest = hashlib.sha256(json.dumps(dataclasses.asdict(model.cfg), sort_keys=True).encode())
    fingerprints = jax.device_get([_fingerprint(leaf) for _, leaf in named])
    for (name, leaf), (low, high) in zip(named, fingerprints):
        digest.update(f"{name}:{np.dtype(leaf.dtype)}:{tuple(leaf.shape)}:{int(low):08x}{int(high):08x};".encode())
    return digest.hexdigest()


_WORD_TYPES = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32}


def _words(leaf: jax.Array) -> jax.Array:
    """The leaf's bits as a flat u32 array (one word per element of 1, 2 or 4 bytes; two per
    element of 8)."""
    leaf = jnp.asarray(leaf)
    if leaf.dtype == jnp.bool_:
        leaf = leaf.astype(jnp.uint8)
    size = jnp.dtype(leaf.dtype).itemsize
    if size in _WORD_TYPES:
        return jax.lax.bitcast_convert_type(leaf, _WORD_TYPES[size]).astype(jnp.uint32).reshape(-1)
    return jax.lax.bitcast_convert_type(leaf, jnp.uint32).reshape(-1)  # 8 bytes: a trailing axis of 2 words


def _fmix32(x: jax.Array) -> jax.Array:
    """MurmurHash3's 32-bit finalizer: a bijection of u32 that spreads every input bit."""
    x = x ^ (x >> 16)
    x = x * jnp.uint32(0x85EBCA6B)
    x = x ^ (x >> 13)
    x = x * jnp.uint32(0xC2B2AE35)
    return x ^ (x >> 16)


@jax.jit
def _fingerprint(leaf: jax.Array) -> jax.Array:
    """u32[2]: the sums of ``h`` and of ``h * (2 * position + 1)``, where ``h = fmix32(word +
    position * odd)`` (each bijective in the word at a given position). One compilation per
    shape and dtype: a model's layers share theirs."""
    words = _words(leaf)
    position = jax.lax.iota(jnp.uint32, words.shape[0])
    mixed = _fmix32(words + position * jnp.uint32(0x9E3779B1))
    return jnp.stack([jnp.sum(mixed, dtype=jnp.uint32),
                      jnp.sum(mixed * (position * jnp.uint32(2) + jnp.uint32(1)), dtype=jnp.uint32)])


def load_weights(cfg: ModelConfig, path: str | Path) -> "Transformer":
    """A :class:`Transformer` of ``cfg`` with the parameters :func:`save_weights` wrote to
    ``path`` (an ``.npz`` file or an orbax directory), cast to ``cfg.dtype``.

    Raises ValueError when ``path`` is missing or its arrays do not fit ``cfg`` (naming the
    first parameter that differs); nothing is read from an orbax checkpoint that does not fit.
    """
    path = Path(path).resolve()
    model = Transformer(cfg)
    state = nnx.state(model, nnx.Param)
    target = nnx.to_pure_dict(state)
    if path.suffix == ".npz":
        if not path.is_file():
            raise ValueError(f"weights file {str(path)!r} does not exist")
        with np.load(path) as stored:
            _check_fits(cfg, path, target, {name: stored[name].shape for name in stored.files})
            leaves = [jnp.asarray(stored[name], leaf.dtype) for name, leaf in _named_leaves(target)]
        restored = jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(target), leaves)
    else:
        restored = _restore_orbax(cfg, path, target)
    nnx.replace_by_pure_dict(state, restored)
    nnx.update(model, state)
    return model


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class BatchInputs:
    """One ragged step's device inputs, in bucketed shapes (see :mod:`kvjax.tiers.page_pool`)."""

    tokens: jax.Array  # i32[num_tokens]
    positions: jax.Array  # i32[num_tokens], position of each token in its sequence
    slot_mapping: jax.Array  # i32[num_tokens], -1 for padding
    block_tables: jax.Array  # i32[max_num_seqs, pages_per_seq]
    seq_lens: jax.Array  # i32[max_num_seqs], including this step's tokens
    cu_q_lens: jax.Array  # i32[max_num_seqs + 1]
    num_seqs: jax.Array  # i32[1]


def _rope(x, positions, theta: float):
    """Rotary embedding on ``x  # [tokens, heads, head_dim]`` (split-half convention)."""
    half = x.shape[-1] // 2
    freqs = theta ** (-jnp.arange(half, dtype=jnp.float32) / half)
    angles = positions.astype(jnp.float32)[:, None] * freqs[None, :]  # [tokens, half]
    sin, cos = jnp.sin(angles)[:, None, :], jnp.cos(angles)[:, None, :]
    x1, x2 = x[..., :half].astype(jnp.float32), x[..., half:].astype(jnp.float32)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x.dtype)


class _Block(nnx.Module):
    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        d, dt = cfg.d_model, cfg.jnp_dtype
        lin = lambda i, o: nnx.Linear(i, o, use_bias=False, dtype=dt, param_dtype=dt, rngs=rngs)
        self.cfg = cfg
        self.attn_norm = nnx.RMSNorm(d, dtype=dt, param_dtype=dt, rngs=rngs)
        self.q_proj = lin(d, cfg.num_q_heads * cfg.head_dim)
        self.k_proj = lin(d, cfg.num_kv_heads * cfg.head_dim)
        self.v_proj = lin(d, cfg.num_kv_heads * cfg.head_dim)
        self.o_proj = lin(cfg.num_q_heads * cfg.head_dim, d)
        self.mlp_norm = nnx.RMSNorm(d, dtype=dt, param_dtype=dt, rngs=rngs)
        self.gate = lin(d, cfg.mlp_dim)
        self.up = lin(d, cfg.mlp_dim)
        self.down = lin(cfg.mlp_dim, d)

    def qkv(self, x, positions):
        c = self.cfg
        h = self.attn_norm(x)
        q = self.q_proj(h).reshape(-1, c.num_q_heads, c.head_dim)
        k = self.k_proj(h).reshape(-1, c.num_kv_heads, c.head_dim)
        v = self.v_proj(h).reshape(-1, c.num_kv_heads, c.head_dim)
        return _rope(q, positions, c.rope_theta), _rope(k, positions, c.rope_theta), v

    def finish(self, x, attn):
        x = x + self.o_proj(attn.reshape(attn.shape[0], -1))
        h = self.mlp_norm(x)
        return x + self.down(jax.nn.silu(self.gate(h)) * self.up(h))


class Transformer(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, seed: int = 0):
        rngs = nnx.Rngs(seed)
        self.cfg = cfg
        self.embed = nnx.Embed(cfg.vocab_size, cfg.d_model, dtype=cfg.jnp_dtype,
                               param_dtype=cfg.jnp_dtype, rngs=rngs)
        self.layers = nnx.List([_Block(cfg, rngs) for _ in range(cfg.num_layers)])
        self.final_norm = nnx.RMSNorm(cfg.d_model, dtype=cfg.jnp_dtype,
                                      param_dtype=cfg.jnp_dtype, rngs=rngs)

    def __call__(self, batch: BatchInputs, kv_pages, *, impl: str | None = None, **attention_tuning):
        """Paged forward: returns ``(logits  # f32[num_tokens, vocab], kv_pages)``.

        ``attention_tuning`` goes to :func:`pallas_kernels.paged_attention` unchanged (block
        sizes of the chosen implementation)."""
        x = self.embed(batch.tokens)
        for layer, block in enumerate(self.layers):
            q, k, v = block.qkv(x, batch.positions)
            kv_pages = pallas_kernels.write_kv(kv_pages, k, v, batch.slot_mapping, layer=layer,
                                               impl=impl)
            attn = pallas_kernels.paged_attention(
                q, kv_pages, batch.block_tables, batch.seq_lens, batch.cu_q_lens,
                batch.num_seqs, layer=layer, impl=impl, **attention_tuning)
            x = block.finish(x, attn)
        return self._logits(x), kv_pages

    def forward_dense(self, tokens):
        """Uncached causal forward of one sequence ``i32[seq_len]`` -> ``f32[seq_len, vocab]``."""
        c = self.cfg
        positions = jnp.arange(tokens.shape[0], dtype=jnp.int32)
        x = self.embed(tokens)
        group = c.num_q_heads // c.num_kv_heads
        causal = jnp.tril(jnp.ones((tokens.shape[0], tokens.shape[0]), bool))
        for block in self.layers:
            q, k, v = block.qkv(x, positions)
            k, v = jnp.repeat(k, group, axis=1), jnp.repeat(v, group, axis=1)
            logits = jnp.einsum("qhd,khd->hqk", q.astype(jnp.float32), k.astype(jnp.float32))
            logits = jnp.where(causal[None], logits / jnp.sqrt(c.head_dim), -jnp.inf)
            probs = jax.nn.softmax(logits, axis=-1)
            attn = jnp.einsum("hqk,khd->qhd", probs, v.astype(jnp.float32)).astype(x.dtype)
            x = block.finish(x, attn)
        return self._logits(x)

    def _logits(self, x):
        return self.embed.attend(self.final_norm(x)).astype(jnp.float32)


# --- weights files ---------------------------------------------------------------------------


def _restore_orbax(cfg: ModelConfig, path: Path, target: dict) -> dict:
    import orbax.checkpoint as ocp

    if not path.is_dir():
        raise ValueError(f"checkpoint directory {str(path)!r} does not exist")
    with ocp.StandardCheckpointer() as checkpointer:
        # Checked before restoring: a restore that fails part-way leaves orbax's reads
        # pending on a closed event loop ("RuntimeError: Event loop is closed" at exit).
        stored = checkpointer.metadata(path).item_metadata.tree
        _check_fits(cfg, path, target, {name: tuple(meta.shape) for name, meta in _named_leaves(stored)})
        abstract = jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), target)
        return checkpointer.restore(path, abstract)


def _named_leaves(tree) -> list[tuple[str, object]]:
    """``("layers/0/q_proj/kernel", leaf)`` pairs in the tree's leaf order."""
    flat, _ = jax.tree_util.tree_flatten_with_path(tree, is_leaf=lambda x: not isinstance(x, dict))
    return [("/".join(str(getattr(key, "key", key)) for key in keys), leaf) for keys, leaf in flat]


def _check_fits(cfg: ModelConfig, path: Path, target: dict, stored: dict[str, tuple]) -> None:
    expected = {name: tuple(leaf.shape) for name, leaf in _named_leaves(target)}
    for name in sorted(expected.keys() | stored.keys()):
        if expected.get(name) != stored.get(name):
            raise ValueError(
                f"weights {str(path)!r} do not fit the model config {cfg}: parameter {name!r} is "
                f"{stored.get(name, 'missing')} there, the config needs {expected.get(name, 'none')}")
