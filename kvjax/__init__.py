"""kvjax: computed KV as a reusable asset for JAX/Flax serving loops."""

from kvjax.block_keys import Namespace
from kvjax.canonicalize import CanonicalizeConfig, canonicalize, template_fingerprint
from kvjax.engine import Engine
from kvjax.engine_config import EngineConfig
from kvjax.engine_events import FinishEvent, RunSummary, TokenEvent
from kvjax.engine_observer import CacheMetricsView
from kvjax.fetch_cost import FetchCostModel
from kvjax.kv_cache import KVCache, KVCacheConfig
from kvjax.metrics import Metrics
from kvjax.model import ModelConfig, Transformer, load_config, load_weights, save_weights
from kvjax.page_pool import PagePool, PoolConfig, build_batch
from kvjax.prefix_cache import PrefixCache
from kvjax.request import Request
from kvjax.sampling import SamplingParams
from kvjax.scheduler import Scheduler, SchedulerConfig
from kvjax.tokenizer import ByteTokenizer, as_tokenizer
from kvjax.workload import WorkloadSpec, build_workload, drive
from pallas_kernels.kv_format import KVFormat, QuantizedPages

__all__ = [
    "ByteTokenizer",
    "CacheMetricsView",
    "CanonicalizeConfig",
    "Engine",
    "EngineConfig",
    "FetchCostModel",
    "FinishEvent",
    "KVCache",
    "KVCacheConfig",
    "KVFormat",
    "Metrics",
    "ModelConfig",
    "Namespace",
    "PagePool",
    "PoolConfig",
    "PrefixCache",
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
    "load_config",
    "load_weights",
    "save_weights",
    "template_fingerprint",
]
