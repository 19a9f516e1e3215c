"""Configuration of the tiered KV cache: the device pool, host and disk capacities, policies."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping

from kvjax.cache.cost_model import CostModel
from kvjax.cache.policies import DEFAULT_POLICY, POLICIES
from kvjax.tiers.block_codec import make_codec
from kvjax.tiers.page_pool import PoolConfig
from pallas_kernels.kv_format import parse_quant

__all__ = ["DEFAULT_POLICY", "WRITE_POLICIES", "KVCacheConfig"]


WRITE_POLICIES = ("write_through", "write_back", "selective")
"""When a device page gets a host copy:

* ``write_through``: when it is committed (the copy runs in the background);
* ``write_back``: when it is evicted from the device (the gather is issued before the block
  is reused, the copy completes in the background);
* ``selective``: like write_through, but only once the page has been hit
  ``selective_min_hits`` times (hot prefixes), so one-off prompts never use the link.
"""


@dataclasses.dataclass(frozen=True, slots=True)
class KVCacheConfig:
    """What a ``KVCache`` holds and how it moves pages between tiers.

    ``host_bytes`` / ``disk_bytes``: capacities in bytes of block payload (host) and bytes on
    disk (disk, checkpoint files included); 0 host bytes means no lower tiers. A disk tier
    needs a host tier (disk blocks are staged through host memory). Watermarks are fractions
    of the device pool (see ``BlockAllocator``) and, for host memory, of ``host_bytes``: above
    the high one, host pages without a disk copy are spilled down to the low one.

    ``offload_quant`` (None, "int8", "fp8_e4m3", "fp8_e5m2"; float pools only): quantize a
    block when it leaves the device, with ``offload_scale`` ("token" or "page") scales, so the
    same host and disk bytes hold 2-4x the blocks; lossy, so off by default. Pages whose KV
    went through it are marked lossy in the trie; ``accept_lossy=False`` makes admissions
    stop their match before the first lossy page (recomputing it) unless ``admit`` says
    otherwise. A quantized pool's blocks always travel bit-exact (``kvjax.tiers.block_codec``).

    ``model_id``: names the model whose KV the cache holds (e.g. a digest of its weights); the
    disk tier records it in every segment and skips segments of another id when it reopens a
    directory, which it cannot tell apart otherwise when the shapes match ("": unnamed).

    ``transfer_buckets``: batch sizes (blocks) every move between device and host is padded
    to, so its device-side gather/scatter compiles once per bucket (``KVCache.warmup``);
    larger moves go in batches of the largest.
    """

    pool: PoolConfig
    host_bytes: int = 0
    disk_dir: str | None = None
    disk_bytes: int = 0
    policy: str = DEFAULT_POLICY
    write_policy: str = "write_back"
    selective_min_hits: int = 2
    high_watermark: float = 0.9
    low_watermark: float = 0.7
    vocab_size: int | None = None
    cost_model: CostModel = CostModel()
    disk_segment_bytes: int = 64 << 20
    offload_quant: str | None = None
    offload_scale: str = "token"
    accept_lossy: bool = True
    transfer_buckets: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64)
    model_id: str = ""

    def __post_init__(self):
        if not isinstance(self.pool, PoolConfig):
            raise ValueError(f"pool={self.pool!r} must be a PoolConfig")
        if not isinstance(self.write_policy, str) or self.write_policy not in WRITE_POLICIES:
            raise ValueError(f"unknown write_policy {self.write_policy!r}; valid: {list(WRITE_POLICIES)}")
        if not isinstance(self.policy, str) or self.policy not in POLICIES:
            raise ValueError(f"unknown eviction policy {self.policy!r}; valid policies: {sorted(POLICIES)}")
        for name in ("host_bytes", "disk_bytes", "disk_segment_bytes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name}={value!r} must be an int >= 0 (bytes)")
        if self.disk_dir is not None and not isinstance(self.disk_dir, (str, os.PathLike)):
            raise ValueError(f"disk_dir={self.disk_dir!r} must be a directory path (str) or None")
        if self.vocab_size is not None and (isinstance(self.vocab_size, bool) or not isinstance(self.vocab_size, int)
                                            or not 0 < self.vocab_size <= 2**31):  # fmt: skip
            raise ValueError(f"vocab_size={self.vocab_size!r} must be None or an int in [1, 2**31] (ids are int32)")
        if self.disk_dir is not None and (self.host_bytes == 0 or self.disk_bytes == 0):
            raise ValueError(f"a disk tier (disk_dir={self.disk_dir!r}) needs host_bytes > 0 and "
                             f"disk_bytes > 0; got host_bytes={self.host_bytes}, disk_bytes={self.disk_bytes}")
        if isinstance(self.selective_min_hits, bool) or not isinstance(self.selective_min_hits, int) \
                or self.selective_min_hits < 1:  # fmt: skip
            raise ValueError(f"selective_min_hits={self.selective_min_hits!r} must be an int >= 1")
        for name in ("low_watermark", "high_watermark"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ValueError(f"{name}={value!r} must be a number in [0, 1] (a fraction)")
        if not 0.0 <= self.low_watermark <= self.high_watermark <= 1.0:
            raise ValueError(f"watermarks must satisfy 0 <= low_watermark={self.low_watermark} "
                             f"<= high_watermark={self.high_watermark} <= 1")
        if not isinstance(self.cost_model, CostModel):
            raise ValueError(f"cost_model={self.cost_model!r} must be a CostModel")
        codec = make_codec(self.pool, self.offload_quant, self.offload_scale)  # raises naming a bad value
        if 0 < self.host_bytes < codec.block_nbytes:  # a host tier of no slots: pages fall straight through it
            raise ValueError(f"host_bytes={self.host_bytes} holds no block (one takes {codec.block_nbytes} bytes "
                             "here); use 0 for no host tier, or at least one block's bytes")
        if self.disk_dir is not None and self.disk_bytes < codec.block_nbytes:  # every spill was refused, silently
            raise ValueError(f"disk_bytes={self.disk_bytes} holds no block (one takes {codec.block_nbytes} bytes "
                             "here, its segment's files aside); disk_bytes is in bytes: use at least one block's, "
                             "or no disk_dir for no disk tier")
        object.__setattr__(self, "offload_quant", parse_quant(self.offload_quant, "offload_quant"))
        if self.offload_quant is not None and not self.tiered:
            raise ValueError(f"offload_quant={self.offload_quant!r} compresses pages leaving the device "
                             f"and needs a host tier; got host_bytes={self.host_bytes}")  # fmt: skip
        if not isinstance(self.model_id, str):
            raise ValueError(f"model_id={self.model_id!r} must be a str naming the model (\"\": unnamed)")
        if not isinstance(self.accept_lossy, bool):
            raise ValueError(f"accept_lossy={self.accept_lossy!r} must be a bool")
        buckets = tuple(self.transfer_buckets) if isinstance(self.transfer_buckets, (list, tuple)) else None
        if not buckets or any(isinstance(b, bool) or not isinstance(b, int) or b < 1 for b in buckets) \
                or list(buckets) != sorted(set(buckets)):  # fmt: skip
            raise ValueError(f"transfer_buckets={self.transfer_buckets!r} must be ascending ints >= 1 (blocks)")
        object.__setattr__(self, "transfer_buckets", buckets)

    @classmethod
    def from_dict(cls, values: Mapping) -> KVCacheConfig:
        """Builds a config from a mapping (e.g. a TOML table); ``pool`` and ``cost_model`` may
        be nested mappings. Unknown keys are an error."""
        known = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(set(values) - set(known))
        if unknown:
            raise ValueError(f"unknown KV cache config keys {unknown}; expected some of {known}")
        values = dict(values)
        if isinstance(values.get("pool"), Mapping):
            values["pool"] = PoolConfig.from_dict(values["pool"])
        if isinstance(values.get("cost_model"), Mapping):
            values["cost_model"] = CostModel.from_dict(values["cost_model"])
        return cls(**values)

    @property
    def tiered(self) -> bool:
        """Whether pages have anywhere to go below the device."""
        return self.host_bytes > 0
