"""kvjax: computed KV as a reusable asset for JAX/Flax serving loops."""

from kvjax.cache.block_keys import Namespace
from kvjax.cache.cost_model import CostModel
from kvjax.config.presets import load_preset
from kvjax.metrics.registry import Metrics
from kvjax.serving.engine import Engine
from kvjax.serving.engine_config import EngineConfig
from kvjax.serving.engine_events import FinishEvent, RunSummary, TokenEvent
from kvjax.serving.model import ModelConfig, Transformer, load_weights, save_weights
from kvjax.serving.request import Request
from kvjax.serving.sampling import SamplingParams
from kvjax.serving.scheduler import Scheduler, SchedulerConfig
from kvjax.text.canonicalize import (
    CanonicalizeConfig,
    canonicalize,
    template_fingerprint,
)
from kvjax.text.tokenizer import ByteTokenizer, as_tokenizer
from kvjax.tiers.kv_cache import KVCache, KVCacheConfig
from kvjax.tiers.page_pool import PagePool, PoolConfig, build_batch
from kvjax.tools.workload import WorkloadSpec, build_workload, drive
from pallas_kernels.kv_format import KVFormat, QuantizedPages

__all__ = [
    "ByteTokenizer",
    "CanonicalizeConfig",
    "Engine",
    "EngineConfig",
    "CostModel",
    "FinishEvent",
    "KVCache",
    "KVCacheConfig",
    "KVFormat",
    "Metrics",
    "ModelConfig",
    "Namespace",
    "PagePool",
    "PoolConfig",
    "QuantizedPages",
    "Request",
    "RunSummary",
    "SamplingParams",
    "Scheduler",
    "SchedulerConfig",
    "TokenEvent",
    "Transformer",
    "WorkloadSpec",
    "as_tokenizer",
    "build_batch",
    "build_workload",
    "canonicalize",
    "drive",
    "load_preset",
    "load_weights",
    "save_weights",
    "template_fingerprint",
]
