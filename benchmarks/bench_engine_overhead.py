"""Host overhead of one engine step at N running sequences, against the model step it feeds.

N requests (prompts of ``--prompt-len`` tokens sharing a system prompt) are admitted and
prefilled, then ``--steps`` steady decode steps are timed, phase by phase (wall clock,
microseconds per step):

- schedule: ``Scheduler.schedule()`` (admission, decode extension, plan);
- inputs: the bucketed int32 batch (``build_batch``) and token ids for the step;
- model: the jitted step, dispatch to the sampled tokens back on the host;
- on_step_done: commits, token appends, finishes;
- events + metrics: TokenEvents, TTFT/inter-token observations, gauges;
- host total: everything in ``Engine.step()`` except the model phase.

The same steps run a second time with the model replaced by a stub returning fixed tokens
(no device work), which shows the host overhead without a device competing for the CPU.

    .venv/bin/python benchmarks/bench_engine_overhead.py [--num-seqs 256] [--steps 30]
        [--prompt-len 48] [--preset tiny]
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvjax.serving.engine import Engine  # noqa: E402
from kvjax.serving.engine_config import EngineConfig  # noqa: E402
from kvjax.serving.preset import build_engine_parts  # noqa: E402
from kvjax.serving.scheduler_config import SchedulerConfig  # noqa: E402
from kvjax.tiers.kv_cache import KVCache, KVCacheConfig  # noqa: E402

PHASES = ("schedule", "inputs", "model", "on_step_done", "events + metrics")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--num-seqs", type=int, default=256)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--prompt-len", type=int, default=48)
    args = parser.parse_args()
    results = {label: _measure(args, stub) for label, stub in (("real model", False), ("stub model", True))}
    _print_table(results, args)


def _measure(args, stub: bool) -> dict[str, float]:
    """Microseconds per decode step by phase (median over the timed steps)."""
    engine = _engine(args)
    timers = _instrument(engine, stub)
    rng = np.random.default_rng(0)
    system = rng.integers(0, 256, args.prompt_len // 2)
    max_new = args.steps + 2 * args.prompt_len  # nobody finishes before the timed steps end
    for i in range(args.num_seqs):
        tail = rng.integers(0, 256, args.prompt_len - len(system))
        engine.add_request(f"r{i}", tokens=np.concatenate([system, tail]).astype(np.int32), max_new_tokens=max_new)
    running = engine.scheduler.running
    while len(running) < args.num_seqs or any(r.is_prefill for r in running.values()):
        engine.step()  # admission and prefill: not timed
    for samples in timers.values():
        samples.clear()
    totals = []
    for _ in range(args.steps):
        start = time.perf_counter()
        engine.step()
        totals.append(time.perf_counter() - start)
    medians = {phase: 1e6 * float(np.median(timers[phase])) for phase in ("schedule", "inputs", "model", "on_step_done")}
    medians["step"] = 1e6 * float(np.median(totals))
    medians["events + metrics"] = medians["step"] - sum(medians[p] for p in ("schedule", "inputs", "model", "on_step_done"))
    medians["host total"] = medians["step"] - medians["model"]
    return medians


def _engine(args) -> Engine:
    n = args.num_seqs
    # Room for prefill chunks beside n decodes, so admission finishes before the timed steps.
    scheduler = SchedulerConfig(max_num_seqs=n, token_budget=n + 256, max_prefill_chunk=256)
    max_len = 3 * args.prompt_len + args.steps
    blocks = n * (-(-max_len // 16) + 1)
    config = EngineConfig(max_model_len=max_len, token_buckets=(_pow2(n), _pow2(n + 256)))
    overrides = dict(scheduler_config=scheduler, config=config, tiers=False)
    engine = Engine.from_preset(args.preset, **overrides) if blocks <= 256 else _big_pool(args.preset, blocks, overrides)
    engine.warmup()
    return engine


def _big_pool(preset: str, num_blocks: int, overrides: dict) -> Engine:
    """The preset with a device pool of ``num_blocks`` blocks (256 sequences need more)."""
    parts = build_engine_parts(preset, **overrides)
    old = parts["cache"].config
    pool = dataclasses.replace(old.pool, num_blocks=num_blocks)
    parts["cache"] = KVCache(KVCacheConfig(pool=pool, vocab_size=old.vocab_size, policy=old.policy))
    return Engine(**parts)


def _instrument(engine: Engine, stub: bool) -> dict[str, list[float]]:
    """Wrap each phase's entry point with a timer (and the model with a stub if asked)."""
    timers = collections.defaultdict(list)

    def timed(name, fn):
        def wrapper(*a, **k):
            start = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                timers[name].append(time.perf_counter() - start)
        return wrapper

    runner = engine.runner
    inputs = runner._inputs
    runner._inputs = timed("inputs", inputs)
    if stub:
        runner._call = lambda batch, params: (np.ones(runner.max_num_seqs, np.int32), None)
    run = runner.run
    engine.scheduler.schedule = timed("schedule", engine.scheduler.schedule)
    engine.scheduler.on_step_done = timed("on_step_done", engine.scheduler.on_step_done)

    def model_only(*a, **k):  # the run minus the inputs it builds
        before = sum(timers["inputs"])
        start = time.perf_counter()
        result = run(*a, **k)
        timers["model"].append(time.perf_counter() - start - (sum(timers["inputs"]) - before))
        return result

    runner.run = model_only
    return timers


def _print_table(results: dict[str, dict[str, float]], args) -> None:
    labels = list(results)
    print(f"\n{args.num_seqs} running sequences decoding (preset {args.preset}); "
          f"median microseconds per step over {args.steps} steps")
    print(f"{'phase':<18}" + "".join(f"{label:>14}" for label in labels))
    print("-" * (18 + 14 * len(labels)))
    for phase in (*PHASES, "host total", "step"):
        print(f"{phase:<18}" + "".join(f"{results[label][phase]:>14,.0f}" for label in labels))
    real = results["real model"]
    print(f"\nhost overhead = {real['host total'] / real['step']:.1%} of a real step "
          f"({real['host total']:,.0f} us host vs {real['model']:,.0f} us model)")
    print("command: .venv/bin/python benchmarks/bench_engine_overhead.py " + " ".join(sys.argv[1:]))


def _pow2(n: int) -> int:
    return 1 << (n - 1).bit_length()


if __name__ == "__main__":
    main()
