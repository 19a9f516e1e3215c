"""Stateful property test of the transfer engine against a plain model of host slots and disk.

Rounds of random offloads (some ``after=`` the fetch that reads their slots), fetches,
spills (some ``now``), restores (some of absent keys) and promotions are queued on a paused
engine, then the round is run (``resume``) or the engine closed with all of it queued. The
model decides, before the engine runs, what each job must deliver and which jobs complete:
per link, jobs run by priority then submission order; a background job short of budget
tokens (the budgets' clock is frozen) holds up its link; a DEMAND job never waits. Checked
after each round: every future resolved exactly once with a result (never raised), each
link's completion order, the bytes every fetch returned and every slot and disk block held,
``stats()`` against the results, disk pins held by queued restores only and released after,
failed or not, and "engine closed" for every job the close found queued. Within a round no
slot is both written and read, nor written twice (the tier index's rule), so what each job
moves does not depend on the order in which different links run. A synchronous engine runs
the same operations, each at submit.
"""

import collections
import dataclasses
import shutil
import tempfile
import threading

import numpy as np
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule
from tier_cases import int_keys, random_blocks, same_bits

from kvjax.tiers.disk_tier import DiskTier
from kvjax.tiers.host_pool import HostPool
from kvjax.tiers.transfer import Link, LinkBudget, Priority, TransferEngine, bucket_rows

BLOCK_SHAPE = (1, 2, 1, 2, 4)  # [num_layers, 2, num_kv_heads, page_size, head_dim]
BLOCK_NBYTES = 64  # float32
NUM_SLOTS = 8
POOL = random_blocks(6, BLOCK_SHAPE, "float32", seed=7)  # the device pool offloads gather from
KEYS = int_keys(6)
NS = b"N" * 16
WAIT_S = 20  # a hang fails instead of blocking forever
BUDGETED = (Link.HOST_TO_DEVICE, Link.HOST_TO_DISK, Link.DISK_TO_HOST)  # offloads after= arrive mid-run: no budget

slots_st = st.lists(st.integers(0, NUM_SLOTS - 1), min_size=1, max_size=3)
keys_st = st.lists(st.integers(0, len(KEYS) - 1), min_size=1, max_size=3, unique=True)
priority_st = st.sampled_from(list(Priority))
burst_st = st.none() | st.sampled_from([1, 2, 3, 5])  # blocks; None: the link has no budget


@dataclasses.dataclass(eq=False)
class ModelJob:
    kind: str  # "offload" | "offload_after" | "fetch" | "spill" | "restore"
    link: Link
    priority: Priority
    seq: int  # submission order within the round
    future: object
    slots: list
    keys: list = dataclasses.field(default_factory=list)  # key indices (disk links)
    block_ids: list = dataclasses.field(default_factory=list)  # offloads: pool rows
    after: "ModelJob | None" = None  # offload_after: the fetch it follows
    queued: bool = True  # False: resolved at submit (a spill ``now``, a rejected restore)


class TransferMachine(RuleBasedStateMachine):
    @initialize(synchronous=st.sampled_from([False, False, True]), direct=st.booleans(),
                buckets=st.sampled_from([(), (1, 2, 4)]), bursts=st.tuples(burst_st, burst_st, burst_st))
    def setup(self, synchronous, direct, buckets, bursts):
        self.synchronous, self.direct, self.buckets = synchronous, direct, buckets
        self.budgets = {link: LinkBudget(1e-3, burst * BLOCK_NBYTES)
                        for link, burst in zip(BUDGETED, bursts) if burst is not None}  # fmt: skip
        self.directory = tempfile.mkdtemp(prefix="kvjax-transfer-machine-")
        self.host = HostPool(BLOCK_SHAPE, "float32", NUM_SLOTS)
        self.disk = DiskTier(self.directory, BLOCK_SHAPE, "float32", 1 << 20, segment_bytes=2 * BLOCK_NBYTES,
                             use_ocdbt=False)  # fmt: skip
        start = random_blocks(NUM_SLOTS + 3, BLOCK_SHAPE, "float32", seed=8)
        self.host.write(np.arange(NUM_SLOTS), start[:NUM_SLOTS])
        self.disk.put(KEYS[:3], start[NUM_SLOTS:], NS)
        self.slot_bits = list(start[:NUM_SLOTS])  # None: unknown (a failed write)
        self.disk_bits = dict(enumerate(start[NUM_SLOTS:]))  # key index -> block
        self.engine = None
        self.start_engine()

    def teardown(self):
        if getattr(self, "engine", None) is not None:
            self.engine.close()
            self.disk.close()
            shutil.rmtree(self.directory, ignore_errors=True)

    def start_engine(self):
        if self.engine is not None:
            self.engine.close()
        self.engine = TransferEngine(self.host, self.disk, budgets=self.budgets, clock=lambda: 0.0,
                                     buckets=self.buckets, synchronous=self.synchronous,
                                     paused=not self.synchronous, direct_cpu_reads=self.direct)  # fmt: skip
        self.stats = {link: collections.Counter() for link in Link}  # what the delivered results add up to
        self.submitted = 0  # jobs submitted to this engine
        self.start_round()

    def start_round(self):
        self.round: list[ModelJob] = []
        self.readers = collections.Counter()  # slot -> jobs of the round reading it
        self.written: set[int] = set()  # slots a job of the round writes
        self.finished = {link: [] for link in Link}  # jobs in the order their futures resolved
        self.finished_lock = threading.Lock()

    # --- submitting ----------------------------------------------------------------------

    def submit(self, job: ModelJob) -> None:
        job.seq = len(self.round)
        self.submitted += 1
        self.round.append(job)
        job.future.add_done_callback(lambda _, job=job: self.record_finished(job))
        if job.queued and not self.synchronous:
            assert not job.future.done(), f"{job.kind} ran on a paused engine"
        if self.synchronous or not job.queued:
            self.check_resolved_at_submit(job)

    def record_finished(self, job):
        with self.finished_lock:
            self.finished[job.link].append(job)

    def readable(self, slots):
        """The distinct slots of ``slots`` a job may read this round (known bits, not written)."""
        return [s for s in dict.fromkeys(slots) if s not in self.written and self.slot_bits[s] is not None]

    def writable(self, slots):
        return [s for s in dict.fromkeys(slots) if s not in self.written and not self.readers[s]]

    @rule(block_ids=st.lists(st.integers(0, len(POOL) - 1), min_size=3, max_size=3), slots=slots_st,
          priority=priority_st)  # fmt: skip
    def offload(self, block_ids, slots, priority):
        slots = self.writable(slots)
        if not slots:
            return
        block_ids = block_ids[: len(slots)]
        future = self.engine.offload(POOL, block_ids, slots, priority=priority)
        self.written.update(slots)
        self.submit(ModelJob("offload", Link.DEVICE_TO_HOST, priority, 0, future, slots, block_ids=block_ids))

    @precondition(lambda self: not self.synchronous)
    @rule(data=st.data(), block_ids=st.lists(st.integers(0, len(POOL) - 1), min_size=3, max_size=3),
          priority=priority_st)  # fmt: skip
    def offload_after_its_read(self, data, block_ids, priority):
        """Overwrite slots that one queued fetch (and nothing else) reads: only after it read them."""
        fetches = [job for job in self.round if job.kind == "fetch"]
        candidates = [(job, [s for s in dict.fromkeys(job.slots) if self.readers[s] == 1 and s not in self.written])
                      for job in fetches]  # fmt: skip
        candidates = [(job, slots) for job, slots in candidates if slots]
        if not candidates:
            return
        fetch, free = data.draw(st.sampled_from(candidates))
        slots = data.draw(st.lists(st.sampled_from(free), min_size=1, max_size=len(free), unique=True))
        block_ids = block_ids[: len(slots)]
        future = self.engine.offload(POOL, block_ids, slots, priority=priority, after=[fetch.future])
        self.written.update(slots)
        self.submit(ModelJob("offload_after", Link.DEVICE_TO_HOST, priority, 0, future, slots, block_ids=block_ids,
                             after=fetch))  # fmt: skip

    @rule(slots=slots_st, priority=priority_st)
    def fetch(self, slots, priority):
        slots = self.readable(slots)
        if not slots:
            return
        future = self.engine.fetch(slots, priority=priority)
        self.readers.update(slots)
        self.submit(ModelJob("fetch", Link.HOST_TO_DEVICE, priority, 0, future, slots))

    @rule(keys=keys_st, slots=slots_st, priority=priority_st, now=st.sampled_from([False, False, True]))
    def spill(self, keys, slots, priority, now):
        slots = self.readable(slots)[: len(keys)]
        if not slots:
            return
        keys = keys[: len(slots)]
        future = self.engine.spill([KEYS[k] for k in keys], [NS] * len(keys), slots, priority=priority, now=now)
        self.readers.update(slots)
        self.submit(ModelJob("spill", Link.HOST_TO_DISK, priority, 0, future, slots, keys=keys, queued=not now))

    @rule(keys=keys_st, slots=slots_st, priority=priority_st, absent=st.sampled_from([False, False, False, True]))
    def restore(self, keys, slots, priority, absent):
        if not absent:  # keys the disk holds (an absent one is refused)
            keys = list(dict.fromkeys(sorted(self.disk_bits)[k % len(self.disk_bits)] for k in keys))
        slots = self.writable(slots)[: len(keys)]
        if not slots:
            return
        keys = keys[: len(slots)]
        held = all(k in self.disk_bits for k in keys)  # else refused at submit, nothing pinned
        future = self.engine.restore([KEYS[k] for k in keys], NS, slots, priority=priority)
        if held:
            self.written.update(slots)
        self.submit(ModelJob("restore", Link.DISK_TO_HOST, priority, 0, future, slots, keys=keys, queued=held))

    @precondition(lambda self: self.round)
    @rule(data=st.data(), priority=priority_st)
    def promote(self, data, priority):
        jobs = data.draw(st.lists(st.sampled_from(self.round), max_size=4, unique=True))
        raised = [job for job in jobs if job.queued and job.priority > priority and not self.synchronous]
        assert self.engine.promote([job.future for job in jobs], priority) == len(raised)
        for job in raised:
            job.priority = priority

    # --- running a round -----------------------------------------------------------------

    @precondition(lambda self: not self.synchronous and len(self.round) >= 3)
    @rule()
    def run(self):
        """Resume: the jobs the model says complete do, in order; the rest (behind a budget)
        stay queued until the close fails them."""
        self.check_pins()
        completing = self.completing()
        self.engine.resume()
        for job in completing:
            job.future.result(WAIT_S)  # may run it on this thread (next in line on an idle link)
        stuck = [job for job in self.round if job.queued and job not in completing]
        assert not any(job.future.done() for job in stuck), [job.kind for job in stuck if job.future.done()]
        self.engine.close()
        self.settle(completing)
        for link in Link:  # completion order: by priority, then submission (offloads after= arrive mid-run)
            expected = [job for job in completing if job.link is link and job.kind != "offload_after"]
            assert [job for job in self.finished[link] if job in expected] == expected
        self.start_engine()

    @precondition(lambda self: self.submitted >= 3)
    @rule()
    def close(self):
        """Close with the round queued: every queued job fails "engine closed", pins go with
        it, a late submit fails too."""
        self.check_pins()
        self.engine.close()
        self.settle([])
        late = [self.engine.fetch([0]), self.engine.spill(KEYS[:1], [NS], [0]),
                self.engine.offload(POOL, [0], [0], after=[self.engine.fetch([1])])]  # fmt: skip
        assert all(future.result(0).error == "engine closed" for future in late)
        assert not any(worker.is_alive() for worker in self.engine._workers)
        self.engine = None
        self.start_engine()

    def completing(self) -> list[ModelJob]:
        """The queued jobs that complete once resumed, per link in the order they run."""
        completing = []
        for link in Link:
            burst = self.budgets[link].burst_bytes if link in self.budgets else None
            tokens = burst
            for job in sorted((j for j in self.round if j.link is link and j.queued and j.kind != "offload_after"),
                              key=lambda j: (j.priority, j.seq)):  # fmt: skip
                nbytes = len(job.slots) * BLOCK_NBYTES
                if burst is not None:
                    if job.priority is not Priority.DEMAND and tokens < min(nbytes, burst):
                        break  # short of tokens: the link waits for a refill that never comes
                    tokens -= nbytes
                completing.append(job)
        return completing + [job for job in self.round if job.kind == "offload_after" and job.after in completing]

    def settle(self, completing: list[ModelJob]) -> None:
        """Check every queued job's result (completed or failed by the close) and fold the
        completed ones into the model, then stats and pins."""
        before = list(self.slot_bits)
        for job in completing:
            self.check_completed(job, before)
        for job in self.round:
            if job.queued and job not in completing:
                result = job.future.result(0)
                assert not result.ok and result.error == "engine closed" and result.done_keys == ()
                if job.kind.startswith("offload") or job.kind == "restore":
                    for slot in job.slots:  # a direct offload wrote its slot at submit: unknown now
                        self.slot_bits[slot] = None
                self.count(job, result)
        self.check_stats_and_tiers()
        assert not self.disk._locks, "a restore left its disk segments pinned"
        resolved = collections.Counter(job for jobs in self.finished.values() for job in jobs)
        assert all(resolved[job] == 1 for job in self.round), "a future resolved twice or never"

    def check_resolved_at_submit(self, job: ModelJob) -> None:
        assert job.future.done()
        if job.kind == "restore" and not job.queued:
            result = job.future.result(0)
            assert not result.ok and result.error == "not all keys are on disk"
            self.count(job, result)
        else:
            self.check_completed(job, list(self.slot_bits))
        if self.synchronous:
            self.check_stats_and_tiers()
            self.start_round()  # each job ran at submit: nothing is in flight

    def check_completed(self, job: ModelJob, before: list) -> None:
        """``job`` ran: its result is what the model says; its writes go into the model."""
        result = job.future.result(0)
        assert result.ok and result.error is None and result.num_blocks == len(job.slots), (job.kind, result)
        if job.kind.startswith("offload"):
            for slot, block in zip(job.slots, job.block_ids):
                self.slot_bits[slot] = POOL[block]
        elif job.kind == "fetch":
            rows = bucket_rows(len(job.slots), self.buckets) if self.buckets else len(job.slots)
            expected = np.zeros((rows, *BLOCK_SHAPE), np.float32)
            expected[: len(job.slots)] = [before[slot] for slot in job.slots]
            assert same_bits(result.blocks, expected)
        elif job.kind == "spill":
            assert result.done_keys == tuple(KEYS[k] for k in job.keys)
            for key, slot in zip(job.keys, job.slots):
                self.disk_bits.setdefault(key, before[slot])  # a key held already keeps its block
        else:
            assert result.done_keys == tuple(KEYS[k] for k in job.keys)
            for key, slot in zip(job.keys, job.slots):
                self.slot_bits[slot] = self.disk_bits[key]
        self.count(job, result)

    def count(self, job: ModelJob, result) -> None:
        counters = self.stats[job.link]
        counters["jobs"] += 1
        counters["failed"] += not result.ok
        moved = len(result.done_keys) if job.link in (Link.HOST_TO_DISK, Link.DISK_TO_HOST) else len(job.slots)
        counters["bytes"] += moved * BLOCK_NBYTES * (result.ok or job.link in (Link.HOST_TO_DISK, Link.DISK_TO_HOST))

    def check_stats_and_tiers(self) -> None:
        stats = self.engine.stats()
        for link in Link:
            expected = {"jobs": 0, "failed": 0, "bytes": 0, **self.stats[link], "queued": 0}
            assert stats[link.value] == expected, link
        known = [slot for slot in range(NUM_SLOTS) if self.slot_bits[slot] is not None]
        if known:
            assert same_bits(self.host.read(np.array(known)), np.stack([self.slot_bits[s] for s in known]))
        assert {k for k in range(len(KEYS)) if self.disk.contains(KEYS[k], NS)} == set(self.disk_bits)
        if self.disk_bits:
            read = self.disk.get([KEYS[k] for k in self.disk_bits], NS)
            assert read.hits.all() and same_bits(read.blocks, np.stack(list(self.disk_bits.values())))

    @invariant()
    def check_pins(self):
        """Each restore queued pins its keys' segments; nothing else holds a pin."""
        if getattr(self, "engine", None) is None:
            return
        pinned = collections.Counter(k for job in self.round if job.kind == "restore" and job.queued
                                     and not job.future.done() for k in job.keys)  # fmt: skip
        held = {KEYS.index(key): len(names) for (_, key), names in self.disk._locks.items()}
        assert held == dict(pinned)


TestTransferMachine = TransferMachine.TestCase
TestTransferMachine.settings = settings(max_examples=40, stateful_step_count=25, deadline=None)
