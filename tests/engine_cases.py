"""Shared builders for the engine tests: one small model and one pool shape for every test, so
the jitted step compiles once per token bucket for the whole session, and a dense greedy
reference (the uncached yardstick).

Every engine built here uses: 2 layers, d_model 64, 4 query / 2 KV heads of 16, float32; a
64-block pool of 8-token pages (512 tokens); at most 4 sequences and 64 tokens per step;
token buckets (16, 64); sequences up to 384 tokens.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from kvjax.cache.cost_model import CostModel
from kvjax.serving.engine import Engine
from kvjax.serving.engine_config import EngineConfig
from kvjax.serving.model import ModelConfig, Transformer
from kvjax.serving.preset import pool_config
from kvjax.serving.scheduler_config import SchedulerConfig
from kvjax.tiers.kv_cache import KVCache, KVCacheConfig

MODEL = ModelConfig(num_layers=2, d_model=64, num_q_heads=4, num_kv_heads=2, head_dim=16, mlp_dim=128)
PAGE, BLOCKS, MAX_LEN = 8, 64, 384
BUCKETS = (16, 64)
SCHEDULER = SchedulerConfig(max_num_seqs=4, token_budget=64, max_prefill_chunk=32)
ATOL = 1e-4  # float32 logits, paged vs dense (different summation order)
FETCH_ALWAYS = CostModel(recompute_seconds_per_token=1.0)  # recomputing is never cheaper: every lower-tier hit is fetched


@functools.lru_cache(maxsize=None)
def model(seed: int = 0) -> Transformer:
    return Transformer(MODEL, seed=seed)


def make_engine(*, scheduler: SchedulerConfig = SCHEDULER, host_bytes: int = 0, disk_dir=None,
                disk_bytes: int = 0, seed: int = 0, kv_quant: str | None = None, kv_scale: str = "token",
                offload_quant: str | None = None, accept_lossy: bool = True, transfer_factory=None,
                num_blocks: int = BLOCKS, cost_model: CostModel = FETCH_ALWAYS, **engine_kwargs) -> Engine:  # fmt: skip
    """An engine over a KVCache (device only unless ``host_bytes``), on the shared shapes;
    ``kv_quant`` / ``kv_scale`` pick the pool's page format, ``offload_quant`` / ``accept_lossy``
    lossy compression of offloaded pages, ``transfer_factory`` the cache's transfer engine."""
    pool = pool_config(MODEL, PAGE, num_blocks, kv_quant=kv_quant, kv_scale=kv_scale)
    config = KVCacheConfig(pool=pool, host_bytes=host_bytes, disk_dir=disk_dir, offload_quant=offload_quant,
                           accept_lossy=accept_lossy,
                           disk_bytes=disk_bytes, vocab_size=MODEL.vocab_size, cost_model=cost_model)  # fmt: skip
    cache = KVCache(config, transfer_factory=transfer_factory)
    engine_config = engine_kwargs.pop("config", EngineConfig(max_model_len=MAX_LEN, token_buckets=BUCKETS))
    return Engine(model(seed), cache, scheduler, engine_config, **engine_kwargs)


@functools.partial(jax.jit, static_argnums=0)
def _dense_logits(graphdef, state, tokens):
    return nnx.merge(graphdef, state).forward_dense(tokens)


def dense_logits(tokens, seed: int = 0) -> np.ndarray:
    """Uncached logits ``f32[len(tokens), vocab]`` (padded to MAX_LEN: causal, one compile)."""
    padded = np.zeros(MAX_LEN, np.int32)
    padded[: len(tokens)] = tokens
    graphdef, state = nnx.split(model(seed))
    return np.asarray(_dense_logits(graphdef, state, jnp.asarray(padded)))[: len(tokens)]


def dense_greedy(prompt, num_new: int, seed: int = 0) -> list[int]:
    """Greedy continuation of ``prompt`` with the dense forward."""
    tokens = [int(t) for t in prompt]
    for _ in range(num_new):
        tokens.append(int(np.argmax(dense_logits(tokens, seed)[-1])))
    return tokens[len(prompt):]


def random_prompts(rng: np.random.Generator, shared: int, tails: list[int]) -> list[np.ndarray]:
    """Prompts of one shared ``shared``-token prefix followed by random tails."""
    prefix = rng.integers(0, MODEL.vocab_size, shared)
    return [np.concatenate([prefix, rng.integers(0, MODEL.vocab_size, n)]).astype(np.int32) for n in tails]


def write_preset(path, *, num_blocks: int = BLOCKS, max_model_len: int = MAX_LEN, host_blocks: int = 0) -> str:
    """Writes a preset of the shared shapes (so the step compiles once for every test that
    uses it, unless ``num_blocks`` or ``max_model_len`` change) to ``path``, with a host tier
    of ``host_blocks``; returns the path."""
    model_keys = "\n".join(f"{name} = {getattr(MODEL, name)!r}" for name in MODEL.__dataclass_fields__)
    scheduler = "\n".join(f"{name} = {getattr(SCHEDULER, name)!r}"
                          for name in ("max_num_seqs", "token_budget", "max_prefill_chunk"))
    path.write_text(f"[model]\n{model_keys}\n[cache]\npage_size = {PAGE}\nnum_blocks = {num_blocks}\n"
                    f"[scheduler]\n{scheduler}\n[engine]\nmax_model_len = {max_model_len}\n"
                    f"token_buckets = {list(BUCKETS)}\n".replace("'", '"'))
    if host_blocks:
        block_bytes = pool_config(MODEL, PAGE, num_blocks).bytes_per_block
        with open(path, "a") as preset:
            preset.write(f"[tiers]\nhost_bytes = {host_blocks * block_bytes}\n")
    return str(path)
