"""Building an engine's parts from a preset (``configs/<preset>.toml``).

Sections: ``[model]`` (``ModelConfig``), ``[cache]`` (``page_size``, ``num_blocks``, the
eviction ``policy`` and the device pool's watermarks), ``[scheduler]`` (``SchedulerConfig``),
``[tiers]`` (``host_bytes``, ``disk_dir`` ("" = none), ``disk_bytes``, ``write_policy``) and
``[engine]`` (``EngineConfig``). Every section but ``[model]`` and ``[cache]`` is optional.
"""

from __future__ import annotations

from typing import Any

from kvjax.engine_config import EngineConfig
from kvjax.model import ModelConfig, Transformer, load_config, load_weights
from kvjax.page_pool import PoolConfig
from kvjax.prefix_cache import PrefixCache
from kvjax.scheduler_config import SchedulerConfig

__all__ = ["build_cache", "build_engine_parts", "pool_config"]

_CACHE_KEYS = ("page_size", "num_blocks", "policy", "high_watermark", "low_watermark")
_TIER_KEYS = ("host_bytes", "disk_dir", "disk_bytes", "write_policy")


def build_engine_parts(preset: str = "tiny", *, weights: str | None = None, seed: int | None = None,
                       tiers: bool = True, **engine_kwargs: Any) -> dict[str, Any]:  # fmt: skip
    """``Engine(**parts)`` arguments for ``preset``.

    ``weights``: an orbax checkpoint directory written by ``kvjax.model.save_weights`` (random
    weights from ``seed`` otherwise; ``seed`` also seeds sampling). ``tiers=False`` leaves out
    the host and disk tiers. Other keyword arguments go to ``Engine`` unchanged (they win
    over the preset: ``scheduler_config=``, ``config=``, ``metrics=``, ...).
    """
    sections = load_config(preset)
    for required in ("model", "cache"):
        if required not in sections:
            raise ValueError(f"preset {preset!r} has no [{required}] section")
    model_cfg = ModelConfig.from_dict(sections["model"])
    engine_cfg = EngineConfig.from_dict(sections.get("engine", {}))
    if seed is not None:
        engine_cfg = EngineConfig.from_dict({**_fields(engine_cfg), "seed": seed})
    model = load_weights(model_cfg, weights) if weights else Transformer(model_cfg, seed=engine_cfg.seed)
    parts = {
        "model": model,
        "cache": build_cache(model_cfg, sections["cache"], sections.get("tiers", {}) if tiers else {}),
        "scheduler_config": SchedulerConfig.from_dict(sections.get("scheduler", {})),
        "config": engine_cfg,
    }
    parts.update(engine_kwargs)
    return parts


def build_cache(model_cfg: ModelConfig, cache_section: dict, tier_section: dict):
    """The cache of a preset: a ``KVCache`` with tiers when ``host_bytes > 0`` and the tiered
    cache is installed, else a device-only ``PrefixCache``."""
    unknown = sorted(set(cache_section) - set(_CACHE_KEYS)) + sorted(set(tier_section) - set(_TIER_KEYS))
    if unknown:
        raise ValueError(f"unknown [cache]/[tiers] keys {unknown}; expected some of "
                         f"{list(_CACHE_KEYS)} / {list(_TIER_KEYS)}")  # fmt: skip
    page_size, num_blocks = cache_section["page_size"], cache_section["num_blocks"]
    watermarks = {k: cache_section[k] for k in ("high_watermark", "low_watermark") if k in cache_section}
    policy = cache_section.get("policy", "lru")
    return PrefixCache(num_blocks, page_size, policy=policy, vocab_size=model_cfg.vocab_size, **watermarks)


def pool_config(model_cfg: ModelConfig, page_size: int, num_blocks: int) -> PoolConfig:
    """The page pool that holds ``model_cfg``'s KV in ``num_blocks`` pages of ``page_size``."""
    return PoolConfig(num_blocks, model_cfg.num_layers, model_cfg.num_kv_heads, page_size,
                      model_cfg.head_dim, model_cfg.dtype)  # fmt: skip


def _fields(config) -> dict:
    return {name: getattr(config, name) for name in config.__dataclass_fields__}
