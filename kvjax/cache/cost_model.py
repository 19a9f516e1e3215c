"""The one cost model of cached KV: seconds to recompute it, to fetch it back, to swap it.

Every decision that weighs recomputing KV against moving it uses this model, in seconds:

* fetch or recompute (``KVCache`` admissions and prefetches): a request whose prefix runs on
  past its device pages onto pages held only on host or disk fetches the leading pages whose
  fetch saves the most time (:meth:`CostModel.pages_to_fetch`);
* eviction value (the ``cost_aware`` policy): what a miss on a page would cost, its recompute
  or, when a host/disk copy survives, the cheaper of that and its fetch
  (:meth:`CostModel.miss_seconds`);
* preemption (the scheduler): swap a victim's pages to host and back, or recompute them
  (:meth:`CostModel.swap_seconds` against :meth:`CostModel.recompute_seconds`);
* fetch from another node or recompute (a cluster node, ``kvjax.cluster.remote_fetch``): the
  leading pages past the local hits that a peer holds, pulled into host memory and then
  fetched like host pages (:meth:`CostModel.remote_pages_to_fetch`).

Recomputing ``n`` tokens starting at position ``s`` costs

    n * recompute_seconds_per_token
    + recompute_seconds_per_token_position * (s*n + n*(n-1)/2)

(dense work per token, plus attention over every earlier position, so deep pages cost more
than shallow ones); fetching ``b`` blocks, ``d`` of which must first be read from disk, costs

    fetch_latency_seconds + b * block_bytes / host_bytes_per_second
    + (d > 0) * disk_latency_seconds + d * block_bytes / disk_bytes_per_second;

pulling ``b`` blocks from another node costs (the remote link's part; the pages then come up
from host as above)

    remote_latency_seconds + b * block_bytes / remote_bytes_per_second.

The two remote figures here are defaults for a node that has measured nothing yet (loopback
on this CPU machine: the side channel's round trip through the peer's engine loop took 20-35
ms to an idle peer, 50 ms leaves room for one in the middle of a step; then a pull at ~0.5
GiB/s); a node passes its link's measured figures to the methods instead.

Block bytes are not part of the model: they are the pool's (or its offload codec's), and the
cache passes them in.

The defaults were measured on CPU with the tiny model (``configs/tiny.toml``, 16 KiB pages)
by ``benchmarks/bench_fetch_vs_recompute.py --repeats 5`` on a shared 2-core machine (fits
of two runs, rounded): fetching from host pays off from one page (a 32-token prompt, where
the two are within 15% of each other; 2.2-2.9x at 128 tokens, 16-19x at 2048), from disk
from about three pages. Their ratio of attention to dense cost per position (4e-5) is the
one of a 7B-class model (4 * hidden / (2 * params per layer) with hidden 4096 and 2e8
parameters per layer). A deployment measures its own model and links and passes its own
``CostModel`` (``KVCacheConfig.cost_model``, or ``[cache.cost_model]`` in a preset).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping

import numpy as np

from kvjax.config.from_mapping import config_from_dict

__all__ = ["CostModel"]


@dataclasses.dataclass(frozen=True, slots=True)
class CostModel:
    """Seconds to recompute tokens or move blocks; see the module docstring for the formulas."""

    recompute_seconds_per_token: float = 2.5e-4
    recompute_seconds_per_token_position: float = 1.0e-8
    fetch_latency_seconds: float = 2.5e-3  # one host->device fetch: hand-offs, copy-in, scatter
    host_bytes_per_second: float = 9.0e7  # host <-> device
    disk_latency_seconds: float = 6.0e-3  # one restore (segment read and checksum), before any byte
    disk_bytes_per_second: float = 5.5e7
    remote_latency_seconds: float = 5.0e-2  # ask the peer (through its engine loop), its offer, the pull start
    remote_bytes_per_second: float = 5.0e8  # pulled from another node

    def __post_init__(self):
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < math.inf:
                raise ValueError(f"{field.name}={value!r} must be a finite number >= 0")  # inf: 0 * inf is NaN
        for name in ("host_bytes_per_second", "disk_bytes_per_second", "remote_bytes_per_second"):
            if getattr(self, name) == 0:
                raise ValueError(f"{name}=0 must be > 0 bytes per second")

    @classmethod
    def from_dict(cls, values: Mapping) -> CostModel:
        """Build from a mapping (a TOML table); unknown keys raise ValueError naming the known ones."""
        return config_from_dict(cls, values, "cost model")

    def recompute_seconds(self, first_token: int, num_tokens: int) -> float:
        """Seconds to recompute tokens ``first_token .. first_token + num_tokens - 1``."""
        positions = first_token * num_tokens + num_tokens * (num_tokens - 1) / 2
        return num_tokens * self.recompute_seconds_per_token + positions * self.recompute_seconds_per_token_position

    def fetch_seconds(self, num_blocks: int, num_disk_blocks: int, block_bytes: int) -> float:
        """Seconds to bring ``num_blocks`` blocks to the device, ``num_disk_blocks`` of them
        read from disk first (0 seconds for no blocks)."""
        if num_blocks == 0:
            return 0.0
        seconds = self.fetch_latency_seconds + num_blocks * block_bytes / self.host_bytes_per_second
        if num_disk_blocks:
            seconds += self.disk_latency_seconds + num_disk_blocks * block_bytes / self.disk_bytes_per_second
        return seconds

    def remote_seconds(self, num_blocks: int, block_bytes: int, *, latency_seconds: float | None = None,
                       bytes_per_second: float | None = None) -> float:  # fmt: skip
        """Seconds to pull ``num_blocks`` blocks from another node into host memory (0 for no
        blocks); ``latency_seconds`` / ``bytes_per_second``: the link's measured figures
        (None: this model's defaults)."""
        if num_blocks == 0:
            return 0.0
        latency = self.remote_latency_seconds if latency_seconds is None else latency_seconds
        rate = self.remote_bytes_per_second if bytes_per_second is None else bytes_per_second
        return latency + num_blocks * block_bytes / rate

    def remote_pages_to_fetch(self, first_page: int, page_size: int, num_pages: int, block_bytes: int, *,
                              latency_seconds: float | None = None,
                              bytes_per_second: float | None = None) -> int:  # fmt: skip
        """How many of the pages ``first_page, first_page + 1, ...`` (``num_pages`` of them,
        held by a peer) to pull rather than recompute: the ``k`` that saves the most seconds
        (recompute of the k pages minus their pull and their fetch up from host), 0 when no
        ``k`` saves anything. Link figures as in ``remote_seconds``."""
        if num_pages <= 0:
            return 0
        latency = self.remote_latency_seconds if latency_seconds is None else latency_seconds
        rate = self.remote_bytes_per_second if bytes_per_second is None else bytes_per_second
        if not rate > 0 or not latency >= 0:
            raise ValueError(f"link figures latency_seconds={latency!r} and bytes_per_second={rate!r} must be "
                             ">= 0 and > 0")  # fmt: skip
        saved = self.seconds_saved(first_page, page_size, np.zeros(num_pages, bool), block_bytes)
        k = np.arange(1, num_pages + 1, dtype=np.float64)
        saved = saved - (latency + k * block_bytes / rate)
        best = int(np.argmax(saved))
        return best + 1 if saved[best] > 0 else 0

    def swap_seconds(self, num_blocks: int, block_bytes: int) -> float:
        """Seconds to copy ``num_blocks`` blocks to host and later back (a preempted sequence)."""
        return 2 * num_blocks * block_bytes / self.host_bytes_per_second

    def miss_seconds(self, page: int, page_size: int, block_bytes: int, *, lower_copy: bool) -> float:
        """What a miss on page ``page`` (pages of ``page_size`` tokens from position 0) costs:
        its recompute or, when a host/disk copy survives (``lower_copy``), the cheaper of that
        and fetching it from host."""
        seconds = self.recompute_seconds(page * page_size, page_size)
        return min(seconds, self.fetch_seconds(1, 0, block_bytes)) if lower_copy else seconds

    def pages_to_fetch(self, first_page: int, page_size: int, on_disk: np.ndarray,
                       block_bytes: int) -> int:  # fmt: skip
        """How many of the lower-tier pages ``first_page, first_page + 1, ...`` to fetch.

        ``on_disk[i]``: page ``first_page + i`` must be read from disk (no host copy). Returns
        the ``k`` that saves the most seconds (recompute of the k pages minus their fetch),
        0 when no ``k`` saves anything.
        """
        if len(on_disk) == 0:
            return 0
        saved = self.seconds_saved(first_page, page_size, on_disk, block_bytes)
        best = int(np.argmax(saved))
        return best + 1 if saved[best] > 0 else 0

    def seconds_saved(self, first_page: int, page_size: int, on_disk: np.ndarray,
                      block_bytes: int) -> np.ndarray:  # fmt: skip
        """``saved[k - 1]``: seconds saved by fetching the first ``k`` pages instead of
        recomputing them (negative: fetching is slower), float64 ``[len(on_disk)]``."""
        k = np.arange(1, len(on_disk) + 1, dtype=np.float64)
        tokens = k * page_size
        start = first_page * page_size
        recompute = tokens * self.recompute_seconds_per_token + (
            start * tokens + tokens * (tokens - 1) / 2) * self.recompute_seconds_per_token_position
        disk = np.cumsum(np.asarray(on_disk, bool))
        fetch = self.fetch_latency_seconds + k * block_bytes / self.host_bytes_per_second
        fetch = fetch + (disk > 0) * self.disk_latency_seconds + disk * block_bytes / self.disk_bytes_per_second
        return recompute - fetch

    def break_even_tokens(self, page_size: int, block_bytes: int, *, from_disk: bool = False,
                          max_pages: int = 1 << 14) -> int | None:  # fmt: skip
        """Shortest prefix (tokens, whole pages from position 0) that is cheaper to fetch than
        to recompute, or None if none up to ``max_pages`` pages is."""
        saved = self.seconds_saved(0, page_size, np.full(max_pages, from_disk), block_bytes)
        wins = np.flatnonzero(saved > 0)
        return None if wins.size == 0 else int(wins[0] + 1) * page_size
