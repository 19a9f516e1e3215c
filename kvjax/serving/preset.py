"""Building an engine's parts from a preset (``kvjax.config.presets``: a shipped name such as
``"tiny"``, or the path of a TOML file).

A top-level ``weights = "<file>"`` names the preset's trained weights (an ``.npz`` beside the
TOML file); without it the model's weights are random. Sections: ``[model]``
(``ModelConfig``), ``[cache]`` (``page_size``, ``num_blocks``, the eviction ``policy``, the
device pool's watermarks and its page format ``kv_quant`` / ``kv_scale``), ``[scheduler]``
(``SchedulerConfig``),
``[tiers]`` (``host_bytes``, ``disk_dir`` ("" = none), ``disk_bytes``, ``write_policy``, and
lossy compression of a float pool's offloaded pages: ``offload_quant``, ``offload_scale``,
``accept_lossy``) and
``[engine]`` (``EngineConfig``). Every section but ``[model]`` and ``[cache]`` is optional.
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Mapping
from typing import Any

from kvjax.config.presets import load_preset
from kvjax.metrics.registry import Metrics
from kvjax.serving.engine_config import EngineConfig
from kvjax.serving.model import ModelConfig, Transformer, load_weights, model_digest
from kvjax.serving.scheduler_config import SchedulerConfig
from kvjax.tiers.kv_cache import KVCache, KVCacheConfig
from kvjax.tiers.page_pool import PoolConfig

__all__ = ["RANDOM_WEIGHTS", "build_cache_config", "build_engine_parts", "pool_config"]

RANDOM_WEIGHTS = "random"  # ``weights=`` value: random weights even when the preset ships some

_CACHE_KEYS = ("page_size", "num_blocks", "policy", "high_watermark", "low_watermark", "kv_quant",
               "kv_scale")
_POOL_KEYS = ("page_size", "num_blocks", "kv_quant", "kv_scale")
_TIER_KEYS = ("host_bytes", "disk_dir", "disk_bytes", "write_policy", "offload_quant", "offload_scale",
              "accept_lossy")


def build_engine_parts(preset: str = "tiny", *, weights: str | None = None, seed: int | None = None,
                       tiers: bool = True, cache_options: dict | None = None,
                       **engine_kwargs: Any) -> dict[str, Any]:  # fmt: skip
    """``Engine(**parts)`` arguments for ``preset``.

    ``weights``: None (default) for the preset's own weights (random when it ships none),
    ``"random"`` for random weights from ``seed``, or the path of weights written by
    ``kvjax.serving.model.save_weights`` (an ``.npz`` file or an orbax directory). ``seed`` also
    seeds sampling. ``tiers=False`` leaves out the host and disk tiers. ``cache_options``
    override keys of the preset's ``[cache]`` section (e.g. ``{"kv_quant": "int8"}``). Other keyword arguments go to ``Engine``
    unchanged (they win over the preset: ``scheduler_config=``, ``config=``, ``metrics=``,
    ``clock=``, ...).
    """
    sections = load_preset(preset)
    for required in ("model", "cache"):
        if required not in sections:
            raise ValueError(f"preset {preset!r} has no [{required}] section")
    if cache_options is not None and not isinstance(cache_options, Mapping):
        raise ValueError(f"cache_options={cache_options!r} must be a mapping of [cache] keys, e.g. "
                         "{'kv_quant': 'int8'}")
    _apply_cache_options(sections, cache_options or {}, tiers)
    model_cfg = ModelConfig.from_dict(sections["model"])
    engine_cfg = EngineConfig.from_dict(sections.get("engine", {}))
    if seed is not None:
        engine_cfg = dataclasses.replace(engine_cfg, seed=seed)
    if weights is None:
        weights = sections.get("weights", RANDOM_WEIGHTS)
        if weights != RANDOM_WEIGHTS and not os.path.exists(weights):  # a preset copied without its weights
            raise ValueError(f"preset {os.fspath(preset)!r} names weights {os.path.basename(weights)!r}, expected "
                             f"beside it at {weights!r}, which does not exist; copy that file there, or pass "
                             f"weights={RANDOM_WEIGHTS!r} (demo: --random-weights)")
    if weights == RANDOM_WEIGHTS:
        model = Transformer(model_cfg, seed=engine_cfg.seed)
    elif isinstance(weights, (str, os.PathLike)):
        model = load_weights(model_cfg, weights)
    else:
        raise ValueError(f"weights={weights!r} must be None (the preset's), {RANDOM_WEIGHTS!r} or a path")
    engine_kwargs.setdefault("metrics", Metrics(clock=engine_kwargs.get("clock", time.monotonic)))
    cache_config = build_cache_config(model_cfg, sections["cache"], sections.get("tiers", {}) if tiers else {})
    # the KV's model: a disk directory or a peer whose blocks another model computed is never read as this one's
    cache_config = dataclasses.replace(cache_config, model_id=model_digest(model))
    cache = KVCache(cache_config, impl=engine_cfg.impl, clock=engine_kwargs.get("clock", time.monotonic))
    parts = {"model": model, "cache": cache, "config": engine_cfg,
             "scheduler_config": SchedulerConfig.from_dict(sections.get("scheduler", {}))}
    parts.update(engine_kwargs)
    return parts


def build_cache_config(model_cfg: ModelConfig, cache_section: dict, tier_section: dict) -> KVCacheConfig:
    """The ``KVCacheConfig`` of a preset's ``[cache]`` and ``[tiers]`` sections (no tiers when
    ``host_bytes`` is 0 or absent; no disk tier when ``disk_dir`` is "" or absent)."""
    unknown = sorted(set(cache_section) - set(_CACHE_KEYS)) + sorted(set(tier_section) - set(_TIER_KEYS))
    if unknown:
        raise ValueError(f"unknown [cache]/[tiers] keys {unknown}; expected some of "
                         f"{list(_CACHE_KEYS)} / {list(_TIER_KEYS)}")  # fmt: skip
    missing = [key for key in ("page_size", "num_blocks") if key not in cache_section]
    if missing:
        raise ValueError(f"the [cache] section lacks {missing}; it needs page_size and num_blocks")
    if tier_section.get("disk_dir") and not tier_section.get("host_bytes"):  # was dropped without a word
        raise ValueError(f"[tiers] disk_dir={tier_section['disk_dir']!r} needs host_bytes > 0 (the disk tier "
                         "sits below the host tier)")  # fmt: skip
    options = {k: v for k, v in cache_section.items() if k not in _POOL_KEYS}
    options.update({k: v for k, v in tier_section.items() if k != "disk_dir"})
    if not options.get("host_bytes"):
        options.pop("disk_bytes", None)
    elif tier_section.get("disk_dir"):
        options["disk_dir"] = tier_section["disk_dir"]
    pool = pool_config(model_cfg, cache_section["page_size"], cache_section["num_blocks"],
                       kv_quant=cache_section.get("kv_quant"),
                       kv_scale=cache_section.get("kv_scale", "token"))
    return KVCacheConfig(pool=pool, vocab_size=model_cfg.vocab_size, **options)


def pool_config(model_cfg: ModelConfig, page_size: int, num_blocks: int, *,
                kv_quant: str | None = None, kv_scale: str = "token") -> PoolConfig:
    """The page pool that holds ``model_cfg``'s KV in ``num_blocks`` pages of ``page_size``,
    stored in ``model_cfg.dtype`` or quantized (``kv_quant``, ``kv_scale``)."""
    return PoolConfig(num_blocks, model_cfg.num_layers, model_cfg.num_kv_heads, page_size,
                      model_cfg.head_dim, model_cfg.dtype, kv_quant=kv_quant,
                      kv_scale=kv_scale)  # fmt: skip


def _apply_cache_options(sections: dict, cache_options: Mapping, tiers: bool) -> None:
    """Overrides the preset's sections with ``cache_options``: its [tiers] keys (``host_bytes``,
    ``disk_dir``, ``disk_bytes``, ...) in ``sections["tiers"]``, every other key in
    ``sections["cache"]`` (where an unknown one is refused)."""
    tier_options = {key: value for key, value in cache_options.items() if key in _TIER_KEYS}
    if tier_options and not tiers:
        raise ValueError(f"cache_options {sorted(tier_options)} configure the host and disk tiers, "
                         "which tiers=False leaves out")
    tier_section = {**sections.get("tiers", {}), **tier_options}
    if tier_options.get("disk_dir") and not tier_section.get("host_bytes"):
        raise ValueError(f"cache_options disk_dir={tier_options['disk_dir']!r} needs host_bytes > 0 (the disk "
                         "tier sits below the host tier); pass host_bytes too")
    sections["cache"] = {**sections["cache"], **{k: v for k, v in cache_options.items() if k not in tier_options}}
    sections["tiers"] = tier_section
