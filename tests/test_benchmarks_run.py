"""The host-side benchmarks still run against the current API, at toy sizes.

Benchmarks are not imported by anything else, so a rename in the library breaks them
silently; each runs here in a subprocess with the smallest sizes its flags allow, and its
table must hold numbers in every row. Figures are not checked (speed is measured in
``benchmarks/``, never asserted in tests).
"""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TRACE = ROOT.parent / "shared" / "data" / "mooncake_synthetic_trace.jsonl"

NUMBER = r"[\d,.]+"


def run_bench(*args: str) -> str:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    return done.stdout


def table_rows(text: str, first_cell: str) -> list[list[str]]:
    """Markdown table rows whose first cell starts with ``first_cell``, as cells."""
    rows = [line.strip("|").split("|") for line in text.splitlines() if line.startswith(f"| {first_cell}")]
    return [[cell.strip() for cell in row] for row in rows]


def test_scheduler_bench_times_every_scenario():
    out = run_bench("benchmarks/bench_scheduler.py", "--num-seqs", "8", "--waiting", "8", "--steps", "5",
                    "--repeats", "1")  # fmt: skip
    rows = table_rows(out, "decode") + table_rows(out, "churn") + table_rows(out, "baseline")
    assert len(rows) == 5, out
    assert all(re.fullmatch(NUMBER, cell) for row in rows for cell in row[1:]), rows


def test_scheduler_bench_against_another_tree_steps_both_alike():
    """``--against`` loads a second copy of a tree beside this one (here: this tree again):
    both make the same scheduling decisions, so their tokens per step agree."""
    out = run_bench("benchmarks/bench_scheduler.py", "--against", str(ROOT), "--num-seqs", "8", "--waiting", "8",
                    "--steps", "13", "--repeats", "1")  # fmt: skip
    rows = table_rows(out, "decode") + table_rows(out, "churn")
    assert len(rows) == 3, out
    for row in rows:
        assert all(re.fullmatch(NUMBER, cell) for cell in row[1:3]), row
        this, other = row[4].split(" / ")
        assert this == other, row


def test_scheduler_bench_against_a_path_that_is_no_tree_says_so():
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "benchmarks/bench_scheduler.py", "--against", "/nonexistent"], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=300)  # fmt: skip
    assert done.returncode != 0
    assert "--against '/nonexistent': expected a kvjax checkout" in done.stderr.strip().splitlines()[-1]


def test_engine_overhead_bench_splits_a_step_into_phases():
    out = run_bench("benchmarks/bench_engine_overhead.py", "--num-seqs", "4", "--steps", "2")
    for phase in ("schedule", "inputs", "model", "on_step_done", "events + metrics", "host total"):
        assert re.search(rf"^{re.escape(phase)}\s+{NUMBER}\s+{NUMBER}$", out, re.M), (phase, out)


@pytest.mark.skipif(not TRACE.exists(), reason="the shared trace is not beside this checkout")
def test_host_path_bench_times_kvjax_and_the_dict_trie():
    out = run_bench("benchmarks/bench_host_path.py", "--trace", str(TRACE), "--limit", "20", "--repeats", "1")
    for name in ("kvjax KVCache, no tiers", "kvjax DeviceIndex", "dict-of-children trie"):
        [row] = table_rows(out, name)
        assert all(re.fullmatch(rf"{NUMBER}%?", cell) for cell in row[1:]), row


def test_tiers_bench_moves_without_compiling_while_timed():
    out = run_bench("benchmarks/bench_tiers.py", "--host-only", "--quick", "--num-layers", "1", "--head-dim", "16",
                    "--move-blocks", "4", "--pool-blocks", "8", "--latency-trials", "200")  # fmt: skip
    assert "TransferEngine.offload" in out and "TransferEngine.fetch" in out, out
    assert re.search(r"XLA compilations: \d+ in set-up and warm-up, 0 in the timed part", out), out
    for link in ("device->host TransferEngine.offload", "host->device TransferEngine.fetch"):  # paired figure too
        assert re.search(rf"{link}: \d+% / \d+% of .*; paired \d+%\)", out), out


def test_policies_bench_splits_a_trace_into_per_node_streams():
    """``--streams 3``: each cell sums three caches' hits; at a capacity that holds every
    stream whole, every policy hits what unlimited capacity does."""
    out = run_bench("benchmarks/bench_policies.py", "--quick", "--no-trace", "--shapes", "chat", "--num-requests", "60",
                    "--streams", "3", "--capacities", "4", "100000")  # fmt: skip
    assert "chat (seed 0), 3 streams (capacity per stream)" in out, out
    unlimited = re.search(r"unlimited capacity hits ([\d.]+)%", out).group(1)
    [whole] = [line.split() for line in out.splitlines() if line.startswith("  100000")]
    assert whole[1] == f"{unlimited}%" and whole[5] == whole[7] == whole[9] == f"{unlimited}%", whole
    assert re.search(r"^verdict: reuse >= lru: (yes|NO)", out, re.M), out
