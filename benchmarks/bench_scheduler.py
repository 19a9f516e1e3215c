"""Scheduler overhead per step: host CPU microseconds of schedule() + on_step_done().

Scenarios (page_size 16, 512-token prompts that share a 256-token system prompt):

- decode: N running sequences, all decoding, nothing waiting;
- decode + queue: the same with 1,000 requests waiting (max_num_seqs is full, so the queue
  costs only its per-step rank refresh), with and without that refresh;
- churn: N running with 16-256 new tokens each, so some finish every step and waiting
  requests are admitted and prefilled in chunks (a serving steady state);
- baseline: only the DeviceIndex calls a decode step needs (extend every sequence by one
  token, commit on page crossings), i.e. the floor under the scheduler's own bookkeeping.

Times are thread CPU time (time the OS gives other processes does not count), per step;
sampled-token dicts are built outside the timed region (that is the engine's work).

    .venv/bin/python benchmarks/bench_scheduler.py [--num-seqs 256] [--waiting 1000] [--steps 300]
        [--repeats 3] [--policy lru] [--against TREE]

The eviction policy matters where sequences finish and blocks become evictable (churn): the
default ``reuse`` does more per node than ``lru``.

Against another tree (the pre-restructure ``PrefixCache`` at commit 35b1355, which ran lru):

    git worktree add /tmp/before 35b1355
    .venv/bin/python benchmarks/bench_scheduler.py --against /tmp/before --policy lru [--repeats 15]

loads that tree's kvjax and benchmark into this process beside this one and steps both, set up
from the same seed, in alternating blocks of 15 steps (the first 2 of each turn untimed): same
heap, hash seed, threads and machine load, so a few percent resolve. Separate processes of one
tree range 545 to 1,000 us per churn step on this 2-core machine, so pairs of whole runs
resolve little. Figures on a quiet machine (ratio this / before: the median of 15 repeats
in each of three runs; in brackets the range of their 45 repeats):

    | scenario                                  | this / before             |
    | decode, 256 running                       | 0.991-1.008 (0.74-1.12)   | (1.010-1.015 before
                                                                              KVCache.extend's change)
    | decode, 256 + 1,000 waiting (refresh 4)   | 0.945-0.972 (0.82-1.04)   |
    | churn, 256 + 1,000 waiting                | 0.963-0.979 (0.91-1.08)   |

Same steps, same scheduling decisions (the tokens per step match). The earlier churn gap lay in
``KVCache.admit``'s tier bookkeeping and in building a ``MatchResult`` for every queued
request; the scheduler now ranks and admits by a ``Lookup``'s counts, and ``KVCache.extend``
tries free blocks first. Machine instructions per step, which load does not change, agree: run
churn for N and for 3N timed steps under callgrind and divide the difference of the totals by
2N (setup and warm-up cancel out):

    OPENBLAS_NUM_THREADS=1 valgrind --tool=callgrind --callgrind-out-file=OUT python -c "import sys;
        sys.path[:0] = ['.', 'benchmarks']; import numpy as np, bench_scheduler as b;
        b.run_churn(np.random.default_rng(0), 256, 1000, N, policy='lru')"

(``policy=`` dropped for the old tree; ``callgrind_annotate OUT`` gives the totals; one
OpenBLAS thread, else its idle worker's spinning is counted too). N = 50: 2,543,953
instructions per churn step before, 2,377,096 now (0.934), the same tokens per step.
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_host_path import python_speed_us  # noqa: E402

from kvjax.cache.device_index import DeviceIndex  # noqa: E402
from kvjax.cache.policies import DEFAULT_POLICY  # noqa: E402
from kvjax.serving.request import Request  # noqa: E402
from kvjax.serving.scheduler import Scheduler, SchedulerConfig  # noqa: E402
from kvjax.tiers.kv_cache import KVCache, KVCacheConfig  # noqa: E402
from kvjax.tiers.page_pool import PoolConfig  # noqa: E402

VOCAB = 32_000
PAGE_SIZE = 16
PROMPT_LEN = 512
SYSTEM_LEN = 256


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-seqs", type=int, default=256)
    parser.add_argument("--waiting", type=int, default=1000)
    parser.add_argument("--steps", type=int, default=300, help="timed steps per scenario")
    parser.add_argument("--repeats", type=int, default=3, help="passes per scenario; the pass with "
                        "the least total CPU time is reported (the others met a busier machine)")  # fmt: skip
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--against", metavar="TREE", help="another kvjax checkout: step both in one process, "
                        "alternating, and print their ratio per scenario (see the docstring)")  # fmt: skip
    parser.add_argument("--policy", default=DEFAULT_POLICY, help="the cache's eviction policy (default: %(default)s; "
                        "lru to compare with a cache that ran lru)")  # fmt: skip
    args = parser.parse_args()
    if args.against:
        compare_trees(args.against, args)
        return
    rng, policy = np.random.default_rng(args.seed), args.policy
    n, w, steps = args.num_seqs, args.waiting, args.steps
    scenarios = [
        (f"decode, {n} running", lambda: run_decode(rng, n, 0, 4, steps, policy)),
        (f"decode, {n} running + {w} waiting (refresh 4/step)", lambda: run_decode(rng, n, w, 4, steps, policy)),
        (f"decode, {n} running + {w} waiting (refresh 0)", lambda: run_decode(rng, n, w, 0, steps, policy)),
        (f"churn, {n} running + {w} waiting", lambda: run_churn(rng, n, w, steps, policy)),
        (f"baseline: DeviceIndex calls of a {n}-decode step", lambda: run_baseline(rng, n, steps)),
    ]
    passes = [[run() for _, run in scenarios] for _ in range(args.repeats)]  # scenarios interleaved
    rows = [(name, min((p[i] for p in passes), key=lambda r: (r[0] + r[1]).sum()))
            for i, (name, _) in enumerate(scenarios)]  # fmt: skip
    print(f"page_size={PAGE_SIZE}, policy {policy}, prompts of {PROMPT_LEN} tokens ({SYSTEM_LEN} shared), "
          f"{steps} timed steps per row, thread CPU time, best of {args.repeats} passes\n")  # fmt: skip
    print("| scenario | us/step mean | p50 | p99 | schedule() us | on_step_done() us | tokens/step | us per running seq |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for name, (schedule_us, done_us, tokens, running) in rows:
        total = schedule_us + done_us
        print(f"| {name} | {total.mean():.0f} | {np.percentile(total, 50):.0f} | {np.percentile(total, 99):.0f} "
              f"| {schedule_us.mean():.0f} | {done_us.mean():.0f} | {tokens:.0f} | {total.mean() / running:.2f} |")  # fmt: skip
    print(f"\nmachine speed: sum(range(1000)) takes {python_speed_us():.1f} us of CPU here "
          "(scale the figures above by your machine's own figure to compare)")  # fmt: skip
    print(f"command: {' '.join(sys.argv)}")


def make_scheduler(num_seqs: int, waiting: int, refresh: int, policy: str = DEFAULT_POLICY) -> Scheduler:
    num_blocks = (num_seqs + 64) * (PROMPT_LEN + 1024) // PAGE_SIZE
    pool = PoolConfig(num_blocks=num_blocks, num_layers=1, num_kv_heads=1, page_size=PAGE_SIZE, head_dim=1,
                      dtype="float32")  # fmt: skip
    cache = KVCache(KVCacheConfig(pool=pool, vocab_size=VOCAB, policy=policy), move_bytes=False)  # bookkeeping, no pool array
    config = SchedulerConfig(max_num_seqs=num_seqs, token_budget=max(2048, num_seqs), max_prefill_chunk=512,
                             rank_refresh_per_step=refresh, max_waiting=waiting + num_seqs + 1)  # fmt: skip
    return Scheduler(cache, config)


def make_requests(rng, prefix: str, count: int, system: np.ndarray, max_new: np.ndarray) -> list[Request]:
    prompts = rng.integers(0, VOCAB, (count, PROMPT_LEN - SYSTEM_LEN), dtype=np.int32)
    return [Request(f"{prefix}{i}", np.concatenate((system, prompts[i])), int(max_new[i])) for i in range(count)]


def step(scheduler: Scheduler, rng) -> tuple[float, float, int]:
    """One timed step; returns (schedule us, on_step_done us, scheduled tokens)."""
    start = time.thread_time_ns()
    plan = scheduler.schedule()
    middle = time.thread_time_ns()
    sampling = [seq.request_id for seq in plan.decodes + plan.prefills if seq.samples]
    tokens = dict(zip(sampling, rng.integers(1, VOCAB, len(sampling)).tolist()))
    resume = time.thread_time_ns()
    scheduler.on_step_done(plan, tokens)
    end = time.thread_time_ns()
    return (middle - start) / 1e3, (end - resume) / 1e3, plan.num_tokens


def run_decode(rng, num_seqs: int, waiting: int, refresh: int, steps: int, policy: str = DEFAULT_POLICY):
    return timed(setup_decode(_THIS, rng, num_seqs, waiting, refresh, policy), rng, steps)


def run_churn(rng, num_seqs: int, waiting: int, steps: int, policy: str = DEFAULT_POLICY):
    return timed(setup_churn(_THIS, rng, num_seqs, waiting, policy), rng, steps)


# The setups take the benchmark module of a tree (``bench``): this one, or another checkout's
# loaded by ``--against`` (which needs only its make_scheduler, make_requests, step, VOCAB and
# SYSTEM_LEN).


def setup_decode(bench, rng, num_seqs: int, waiting: int, refresh: int, policy: str):
    """``num_seqs`` sequences past their prefill, decoding; ``waiting`` requests queued behind."""
    system = rng.integers(0, bench.VOCAB, bench.SYSTEM_LEN, dtype=np.int32)
    scheduler = _make_scheduler(bench, num_seqs, waiting, refresh, policy)
    for request in bench.make_requests(rng, "run", num_seqs, system, np.full(num_seqs, 100_000)):
        scheduler.add(request)
    while any(request.is_prefill for request in scheduler.running.values()) or scheduler.num_waiting:
        bench.step(scheduler, rng)  # prefill everything first: the timed steps are pure decode
    for request in bench.make_requests(rng, "wait", waiting, system, np.full(waiting, 64)):
        scheduler.add(request)
    return scheduler


def setup_churn(bench, rng, num_seqs: int, waiting: int, policy: str):
    """``num_seqs`` running with 16-256 new tokens each and ``waiting`` queued, after 200 steps
    into the steady state."""
    system = rng.integers(0, bench.VOCAB, bench.SYSTEM_LEN, dtype=np.int32)
    scheduler = _make_scheduler(bench, num_seqs, waiting, 4, policy)
    total = num_seqs + waiting
    for request in bench.make_requests(rng, "r", total, system, rng.integers(16, 257, total)):
        scheduler.add(request)
    for _ in range(200):
        bench.step(scheduler, rng)
    return scheduler


def _make_scheduler(bench, num_seqs: int, waiting: int, refresh: int, policy: str):
    if "policy" in inspect.signature(bench.make_scheduler).parameters:
        return bench.make_scheduler(num_seqs, waiting, refresh, policy)
    return bench.make_scheduler(num_seqs, waiting, refresh)  # a tree with one policy (lru)


def timed(scheduler: Scheduler, rng, steps: int):
    results = np.array([step(scheduler, rng) for _ in range(steps)])
    return results[:, 0], results[:, 1], results[:, 2].mean(), max(scheduler.num_running, 1)


def run_baseline(rng, num_seqs: int, steps: int):
    """The cache work of a decode step without the scheduler: extend by 1, commit on page crossings."""
    cache = DeviceIndex((num_seqs + 64) * (PROMPT_LEN + 1024) // PAGE_SIZE, PAGE_SIZE, vocab_size=VOCAB)
    tokens = [rng.integers(0, VOCAB, PROMPT_LEN + steps + 1, dtype=np.int32) for _ in range(num_seqs)]
    handles = [cache.admit(t[:PROMPT_LEN], None) for t in tokens]
    for handle, t in zip(handles, tokens):
        cache.commit(handle, t[:PROMPT_LEN])
    lengths = [PROMPT_LEN] * num_seqs
    per_step = []
    for _ in range(steps):
        start = time.thread_time_ns()
        for i, handle in enumerate(handles):
            cache.extend(handle, 1)
            lengths[i] += 1
            if lengths[i] % PAGE_SIZE == 0:
                cache.commit(handle, tokens[i][: lengths[i]])
        per_step.append((time.thread_time_ns() - start) / 1e3)
    return np.array(per_step), np.zeros(steps), num_seqs, num_seqs


# --- one process, two trees ---------------------------------------------------------------

_TREE_PACKAGES = ("kvjax", "pallas_kernels", "bench_scheduler", "bench_host_path")
_BLOCK_STEPS = 15  # steps a tree runs before the other takes its turn (the first 2 untimed)


def _tree_modules() -> dict:
    return {name: module for name, module in sys.modules.items() if name.split(".")[0] in _TREE_PACKAGES}


class _Tree:
    """A tree's benchmark module and the modules it imported; ``activate`` puts them in
    ``sys.modules`` (a function-level import then finds its own tree's module) and returns
    the benchmark module."""

    def __init__(self, bench, modules: dict):
        self.bench, self.modules = bench, modules

    def activate(self):
        for name in _tree_modules():
            del sys.modules[name]
        sys.modules.update(self.modules)
        return self.bench


def load_tree(root: str) -> _Tree:
    """The benchmark of the checkout at ``root`` (its own kvjax and pallas_kernels), loaded
    beside this one."""
    if not (Path(root) / "benchmarks" / "bench_scheduler.py").is_file():
        raise SystemExit(f"--against {root!r}: expected a kvjax checkout with benchmarks/bench_scheduler.py")
    own = _tree_modules()
    for name in own:
        del sys.modules[name]
    sys.path[:0] = [root, str(Path(root) / "benchmarks")]
    try:
        bench = importlib.import_module("bench_scheduler")
        return _Tree(bench, _tree_modules())
    finally:
        del sys.path[:2]
        for name in _tree_modules():
            del sys.modules[name]
        sys.modules.update(own)


def compare_trees(other_root: str, args) -> None:
    """Both trees stepped in one process, in alternating blocks of ``_BLOCK_STEPS`` steps (same
    heap, hash seed, threads and machine load): per scenario, the p50 step of each and their
    ratio, one per repeat (each repeat sets both up afresh from the same seed)."""
    this = _Tree(_THIS, _tree_modules())
    other = load_tree(other_root)
    n, w, policy = args.num_seqs, args.waiting, args.policy
    scenarios = [
        (f"decode, {n} running", lambda b, rng: setup_decode(b, rng, n, 0, 4, policy)),
        (f"decode, {n} running + {w} waiting (refresh 4/step)", lambda b, rng: setup_decode(b, rng, n, w, 4, policy)),
        (f"churn, {n} running + {w} waiting", lambda b, rng: setup_churn(b, rng, n, w, policy)),
    ]
    print(f"this tree against {other_root}, one process, blocks of {_BLOCK_STEPS} steps alternating, "
          f"{args.steps} timed steps each per repeat, thread CPU time; policy {policy} here "
          "(a tree without policies runs lru)\n")  # fmt: skip
    print("| scenario | this p50 us/step | other p50 us/step | ratio this/other, median (range) | tokens/step this / other |")
    print("|---|---:|---:|---:|---:|")
    for name, setup in scenarios:
        ratios, medians, tokens = [], {this: [], other: []}, {this: [], other: []}
        for _ in range(args.repeats):
            states = {}
            for tree in (this, other):
                rng = np.random.default_rng(args.seed)
                states[tree] = (setup(tree.activate(), rng), rng)
            samples = {this: [], other: []}
            for block in range(max(1, args.steps // (_BLOCK_STEPS - 2))):
                for tree in (this, other) if block % 2 == 0 else (other, this):
                    scheduler, rng = states[tree]
                    bench = tree.activate()
                    for j in range(_BLOCK_STEPS):
                        schedule_us, done_us, num_tokens = bench.step(scheduler, rng)
                        if j >= 2:  # the first steps of a turn refill caches the other tree used
                            samples[tree].append(schedule_us + done_us)
                            tokens[tree].append(num_tokens)
            for tree in (this, other):
                medians[tree].append(float(np.median(samples[tree])))
            ratios.append(medians[this][-1] / medians[other][-1])
            del states
        print(f"| {name} | {min(medians[this]):.0f} | {min(medians[other]):.0f} | {statistics.median(ratios):.3f} "
              f"({min(ratios):.3f}-{max(ratios):.3f}) | {np.mean(tokens[this]):.1f} / {np.mean(tokens[other]):.1f} |")  # fmt: skip
    this.activate()  # this tree's modules back in place
    print(f"command: {' '.join(sys.argv)}")


_THIS = sys.modules[__name__]

if __name__ == "__main__":
    main()
