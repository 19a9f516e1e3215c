"""A model-free engine for scheduler tests: the page pool holds each position's identity.

The KV of position ``p`` of a sequence in namespace ``ns`` is modelled as the bytes
``ns | tokens[0..p]`` (what a real model's KV depends on). ``FakeEngine.run`` executes a plan
the way a real engine must (swap-outs, swap-ins, then the step), checking every KV position a
sequence attends to against the truth, and derives each written position from the KV it read
(so a wrong read propagates, as it would in a model). A sampled token is a hash of the last
position's KV, so the whole output of a request is a function of its prompt alone and
``reference_output`` gives what an uncached, unpreempted run produces.
"""

from __future__ import annotations

import zlib

import numpy as np

from kvjax.cache.cost_model import CostModel
from kvjax.serving.scheduler import Scheduler
from kvjax.serving.step_plan import StepPlan
from kvjax.tiers.kv_cache import KVCache, KVCacheConfig
from kvjax.tiers.page_pool import PoolConfig

NEVER_FETCH = CostModel(fetch_latency_seconds=1e9)  # host pages are recomputed: the fake KV stays the truth


def kv_cache(num_blocks: int, page_size: int, *, vocab_size: int, clock, high: float = 0.9, low: float = 0.7,
             host_blocks: int = 0, cost_model: CostModel = NEVER_FETCH, transfer_factory=None,
             **config_kwargs) -> KVCache:
    """A KVCache whose pool is as small as the scheduler's tests need (1 layer, head_dim 1:
    ``8 * page_size`` bytes a block).

    With ``host_blocks`` every committed page gets a host copy (write-through), so eviction
    keeps it indexed off device; the cost model should never fetch it back (the fake engine
    models KV by position, not by the pool's bytes). ``transfer_factory``: the cache's; other
    keywords (a disk tier's, say) go to ``KVCacheConfig``.
    """
    pool = PoolConfig(num_blocks=num_blocks, num_layers=1, num_kv_heads=1, page_size=page_size, head_dim=1,
                      dtype="float32")  # fmt: skip
    config = KVCacheConfig(pool=pool, vocab_size=vocab_size, high_watermark=high, low_watermark=low,
                           host_bytes=host_blocks * pool.bytes_per_block, write_policy="write_through",
                           cost_model=cost_model, **config_kwargs)  # fmt: skip
    return KVCache(config, clock=clock, transfer_factory=transfer_factory)


class Clock:
    """A settable clock in seconds (``now``)."""

    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def position_kv(namespace, tokens) -> bytes:
    """The modelled KV of the last position of ``tokens``."""
    return repr(namespace).encode() + b"|" + np.asarray(tokens, np.int32).tobytes()


def sample(kv: bytes, vocab_size: int) -> int:
    return zlib.crc32(kv) % vocab_size


def reference_output(prompt, namespace, max_new_tokens, vocab_size, stop_token_ids=()) -> list[int]:
    """Tokens an uncached, unpreempted run generates for ``prompt``."""
    tokens, output = list(prompt), []
    while len(output) < max_new_tokens:
        token = sample(position_kv(namespace, tokens), vocab_size)
        output.append(token)
        tokens.append(token)
        if token in stop_token_ids:
            break
    return output


class FakeEngine:
    """Runs plans against a modelled pool of ``num_blocks`` pages and a host swap area."""

    def __init__(self, scheduler: Scheduler, vocab_size: int):
        self.scheduler = scheduler
        self.vocab_size = vocab_size
        page_size = scheduler.page_size
        self.pool = [[None] * page_size for _ in range(scheduler.cache.allocator.num_blocks)]
        self.host: dict[int, list] = {}

    def run(self, plan: StepPlan, requests=None) -> dict[str, int]:
        """Execute ``plan``; return the sampled tokens for ``on_step_done``. Asserts every KV read.

        ``requests`` maps ids to requests (default: the running ones); pass every request to
        run a plan whose requests were cancelled after ``schedule``, as a real engine would.
        """
        requests = self.scheduler.running if requests is None else requests
        for block, slot in plan.swap_out:
            self.host[slot] = list(self.pool[block])
        for slot, block in plan.swap_in:
            self.pool[block] = list(self.host[slot])
        tokens = {}
        for seq in plan.decodes + plan.prefills:
            request = requests[seq.request_id]
            last_kv = self._attend(request, seq)
            if seq.samples:
                tokens[seq.request_id] = sample(last_kv, self.vocab_size)
        return tokens

    def step(self) -> tuple[StepPlan, dict[str, str]]:
        """schedule + run + on_step_done; returns the plan and the finished requests."""
        plan = self.scheduler.schedule()
        return plan, self.scheduler.on_step_done(plan, self.run(plan))

    def _attend(self, request, seq) -> bytes:
        page_size, table, truth = self.scheduler.page_size, seq.block_table, request.token_ids
        for pos in range(seq.start):
            kv = self.pool[table[pos // page_size]][pos % page_size]
            expected = position_kv(request.namespace, truth[: pos + 1])
            assert kv == expected, f"{request.request_id}: wrong KV at position {pos}: {kv!r} != {expected!r}"
        previous = self.pool[table[(seq.start - 1) // page_size]][(seq.start - 1) % page_size] if seq.start else None
        for offset, pos in enumerate(seq.positions):
            token = np.asarray(seq.token_ids[offset : offset + 1], np.int32).tobytes()
            kv = position_kv(request.namespace, seq.token_ids[:1]) if previous is None else previous + token
            self.pool[table[pos // page_size]][pos % page_size] = kv
            previous = kv
        return previous
