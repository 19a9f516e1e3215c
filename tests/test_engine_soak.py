"""Soak: thousands of requests with random arrivals, cancellations and memory pressure, every
invariant checked after every step.

The long runs replace the model step with ``FakeRunner``: a host model of the page pool in
which every slot holds a hash of (namespace, all tokens up to its position). A step first
writes its tokens' slots, then checks every slot each sequence attends to, so a hit mapped to
the wrong prefix or tenant, a swap that lost a page, or a recompute that skipped one fails the
step. Its "logits" are a function of that hash, so outputs are deterministic. A short soak on
the real model (tiers included) then checks the same path end to end against the dense
forward.
"""

import numpy as np
import pytest
from engine_cases import MODEL, PAGE, dense_greedy, make_engine, model
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvjax.cache.block_keys import as_namespace
from kvjax.cache.cost_model import CostModel
from kvjax.serving.engine import Engine
from kvjax.serving.engine_config import EngineConfig
from kvjax.serving.engine_events import FinishEvent
from kvjax.serving.preset import pool_config
from kvjax.serving.scheduler_config import SchedulerConfig
from kvjax.tiers.kv_cache import KVCache, KVCacheConfig

_MASK = (1 << 61) - 1


class FakeRunner:
    """``ModelRunner.run`` on a host model of the pool (see the module docstring)."""

    def __init__(self, engine: Engine):
        config = engine.pool.config
        self.page_size, self.scheduler = config.page_size, engine.scheduler
        self.slots = np.full((config.num_blocks, config.page_size), -1, np.int64)  # prefix hash per slot
        self.hashes: dict[str, list[int]] = {}  # request id -> prefix hash of each position so far
        self.compilations, self.steps = 0, 0

    def run(self, seqs, sampling, *, return_logits=False):
        wanted = [self._prefix_hashes(seq) for seq in seqs]
        for seq, hashes in zip(seqs, wanted):  # write every new token's slot first, as write_kv does
            positions = np.arange(seq.start, seq.seq_len)
            blocks = np.asarray(seq.block_table)[positions // self.page_size]
            self.slots[blocks, positions % self.page_size] = hashes[seq.start : seq.seq_len]
        for seq, hashes in zip(seqs, wanted):
            positions = np.arange(seq.seq_len)
            held = self.slots[np.asarray(seq.block_table)[positions // self.page_size], positions % self.page_size]
            bad = np.flatnonzero(held != hashes[: seq.seq_len])
            if bad.size:
                raise AssertionError(f"{seq.request_id}: KV at position {bad[0]} is not its own (step {self.steps})")
        self.steps += 1
        return np.array([hashes[seq.seq_len - 1] % MODEL.vocab_size for seq, hashes in zip(seqs, wanted)]), None

    def forget(self, request_id):
        self.hashes.pop(request_id, None)

    def _prefix_hashes(self, seq) -> np.ndarray:
        hashes = self.hashes.setdefault(seq.request_id, [])
        if not hashes:
            namespace = self.scheduler.get(seq.request_id).namespace
            hashes.append(int.from_bytes(as_namespace(namespace).digest()[:7], "little"))
        for token in seq.token_buffer[len(hashes) - 1 : seq.seq_len].tolist():
            hashes.append((hashes[-1] * 1_000_003 + token + 1) & _MASK)
        return np.asarray(hashes[1:], np.int64)



class FakeSwapStore:
    """The swap store on the fake pool: whole pages of slot hashes to host and back."""

    def __init__(self, runner: FakeRunner):
        self.runner, self.host = runner, {}

    def swap_out(self, pairs):
        for block, slot in pairs:
            self.host[slot] = self.runner.slots[block].copy()

    def swap_in(self, pairs):
        for slot, block in pairs:
            self.runner.slots[block] = self.host.pop(slot)


def _fake_engine(preemption: str, num_blocks: int = 40, page_size: int = 4) -> tuple[Engine, FakeRunner]:
    scheduler = SchedulerConfig(max_num_seqs=6, token_budget=24, max_prefill_chunk=12, preemption=preemption,
                                host_swap_blocks=24 if preemption != "recompute" else 0, max_waiting=40)  # fmt: skip
    pool = pool_config(MODEL, page_size, num_blocks)
    # A swap of 1 MiB blocks over 20 GB/s, in this pool's bytes: cheaper than recomputing 4 tokens.
    cost_model = CostModel(recompute_seconds_per_token=2e-4, recompute_seconds_per_token_position=0.0,
                           host_bytes_per_second=2e10 * pool.bytes_per_block / (1 << 20))  # fmt: skip
    cache = KVCache(KVCacheConfig(pool=pool, vocab_size=MODEL.vocab_size, cost_model=cost_model))
    engine = Engine(model(), cache, scheduler, EngineConfig(max_model_len=num_blocks * page_size))
    runner = FakeRunner(engine)
    engine.runner = runner
    engine.swap_store = FakeSwapStore(runner) if scheduler.host_swap_blocks else None
    return engine, runner


def _random_prompt(rng, prefixes):
    prefix = prefixes[rng.integers(len(prefixes))]
    tail = rng.integers(0, MODEL.vocab_size, rng.integers(1, 24))
    return np.concatenate([prefix[: rng.integers(0, len(prefix) + 1)], tail]).astype(np.int32)


@pytest.mark.parametrize("preemption, num_requests", [("auto", 1200), ("recompute", 800)])
def test_fake_model_soak_keeps_every_invariant(preemption, num_requests):
    rng = np.random.default_rng(0 if preemption == "auto" else 1)
    engine, runner = _fake_engine(preemption)
    prefixes = [rng.integers(0, MODEL.vocab_size, n) for n in (12, 30, 45)]
    outcomes, added = {"finished": 0, "cancelled": 0, "rejected": 0}, 0
    while added < num_requests or engine.has_unfinished:
        for _ in range(rng.poisson(0.45) if added < num_requests else 0):
            engine.add_request(f"r{added}", tokens=_random_prompt(rng, prefixes), max_new_tokens=int(rng.integers(1, 24)),
                               namespace=f"tenant{rng.integers(3)}")  # fmt: skip
            added += 1
        if rng.random() < 0.08 and engine.scheduler.has_unfinished:
            live = [r.request_id for r in engine.scheduler.waiting] + list(engine.scheduler.running)
            engine.cancel(live[rng.integers(len(live))])
        for event in engine.step():
            if isinstance(event, FinishEvent):
                outcomes[event.status] += 1
                runner.forget(event.request_id)
        engine.check_invariants()
    assert sum(outcomes.values()) == added
    stats, counters = engine.scheduler.stats, engine.metrics.to_json()["counters"]
    assert outcomes["finished"] > 0.7 * num_requests and outcomes["cancelled"] > 0.05 * num_requests
    assert stats.preempted_recompute + stats.preempted_swap > 20  # the pool really ran short
    if preemption == "auto":
        assert stats.preempted_swap > 0
    assert counters["preemptions"] == stats.preempted_recompute + stats.preempted_swap
    assert sum(counters["hit_tokens"].values()) > 0
    assert engine.cache.num_sequences == 0 and engine.cache.allocator.num_free + engine.cache.num_reclaimable == 40


class EngineMachine(RuleBasedStateMachine):
    """Random adds, cancels and steps on the fake model; invariants after each."""

    def __init__(self):
        super().__init__()
        self.engine, self.runner = _fake_engine("auto", num_blocks=16)
        self.count = 0

    @rule(length=st.integers(1, 40), max_new=st.integers(1, 12), tenant=st.sampled_from(["a", "b"]),
          shared=st.booleans())
    def add(self, length, max_new, tenant, shared):
        tokens = (np.arange(length) if shared else np.arange(length) * 7 + self.count) % MODEL.vocab_size
        self.engine.add_request(f"r{self.count}", tokens=tokens, max_new_tokens=max_new, namespace=tenant)
        self.count += 1

    @precondition(lambda self: self.engine.scheduler.has_unfinished)
    @rule(pick=st.integers(0, 100))
    def cancel(self, pick):
        live = [r.request_id for r in self.engine.scheduler.waiting] + list(self.engine.scheduler.running)
        assert self.engine.cancel(live[pick % len(live)])

    @rule(num_steps=st.integers(1, 5))
    def step(self, num_steps):
        for _ in range(num_steps):
            for event in self.engine.step():
                if isinstance(event, FinishEvent):
                    self.runner.forget(event.request_id)

    @invariant()
    def consistent(self):
        self.engine.check_invariants()


TestEngineMachine = EngineMachine.TestCase
TestEngineMachine.settings = settings(max_examples=25, stateful_step_count=30, deadline=None)


def test_real_model_soak_with_tiers_matches_dense(tmp_path):
    rng = np.random.default_rng(5)
    prefixes = [rng.integers(0, MODEL.vocab_size, n) for n in (3 * PAGE, 7 * PAGE)]
    block_bytes = 4096
    with make_engine(host_bytes=24 * block_bytes, disk_dir=str(tmp_path), disk_bytes=1 << 24) as engine:
        added, finishes = 0, {}
        while added < 50 or engine.has_unfinished:
            if added < 50 and rng.random() < 0.5:
                prompt = np.concatenate([prefixes[added % 2], rng.integers(0, 256, rng.integers(1, 40))])
                engine.add_request(f"r{added}", tokens=prompt.astype(np.int32), max_new_tokens=int(rng.integers(1, 10)),
                                   namespace=f"t{added % 3}")  # fmt: skip
                added += 1
            if rng.random() < 0.05 and engine.scheduler.num_running:
                engine.cancel(next(iter(engine.scheduler.running)))
            finishes.update((e.request_id, e) for e in engine.step() if isinstance(e, FinishEvent))
            engine.check_invariants()
    done = [f for f in finishes.values() if f.status == "finished"]
    assert len(finishes) == 50 and len(done) >= 40
    assert sum(f.num_hit_tokens for f in done) > 0
    for finish in done:
        assert finish.output_token_ids.tolist() == dense_greedy(finish.prompt_token_ids, len(finish.output_token_ids))
