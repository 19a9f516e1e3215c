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


def run_refused(*args: str) -> str:
    """The stderr of a benchmark run that must stop at its argument check: exit 2, no traceback."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    return done.stderr


def every_policy_hits_unlimited(out: str, row: str) -> None:
    """In the policy table row starting with ``row``, offline and the three ``--quick`` policies
    hit what unlimited capacity does (the header's figure)."""
    unlimited = re.search(r"unlimited capacity hits ([\d.]+)%", out).group(1)
    [cells] = [line.split() for line in out.splitlines() if line.startswith(row)]
    assert cells[1] == f"{unlimited}%" and cells[5] == cells[7] == cells[9] == f"{unlimited}%", cells


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


def test_fetch_vs_recompute_bench_times_every_source_and_fits_the_cost_model():
    # it crashed on its first cached run (an API it called was gone) and nothing ran it
    out = run_bench("benchmarks/bench_fetch_vs_recompute.py", "--lengths", "32,64", "--repeats", "1")
    assert [row[:2] for row in table_rows(out, "32 ") + table_rows(out, "64 ")] == [["32", "1"], ["64", "3"]], out
    assert "fitted: CostModel(" in out and "break-even (host):" in out, out


def test_pool_layout_bench_refuses_a_pool_its_decode_table_cannot_split():
    assert "--num-blocks 20: expected a multiple of 8" in run_refused("benchmarks/bench_pool_layout.py",
                                                                      "--num-blocks", "20")  # fmt: skip


def test_pool_layout_bench_compares_copy_implementations():
    # --impls read the pool after the write table had donated it (the GPU check runs it)
    out = run_bench("benchmarks/bench_pool_layout.py", "--num-blocks", "16", "--layers", "2", "--heads", "2",
                    "--head-dim", "32", "--n", "1,8", "--repeats", "2", "--impls", "xla,pallas_gpu")  # fmt: skip
    for impl in ("xla", "pallas_gpu"):
        assert re.search(rf"impl={impl}, n=8: gather {NUMBER} / {NUMBER} ms, scatter {NUMBER} / {NUMBER} ms", out), out


def test_policies_bench_splits_a_trace_into_per_node_streams():
    """``--streams 3``: each cell sums three caches' hits; at a capacity that holds every
    stream whole, every policy hits what unlimited capacity does."""
    out = run_bench("benchmarks/bench_policies.py", "--quick", "--no-trace", "--shapes", "chat", "--num-requests", "60",
                    "--streams", "3", "--capacities", "4", "100000")  # fmt: skip
    assert "chat (seed 0), 3 streams (capacity per stream)" in out, out
    every_policy_hits_unlimited(out, "  100000")
    assert re.search(r"^verdict: reuse >= lru: (yes|NO)", out, re.M), out


def test_policies_bench_scaled_reuse_columns_span_lru_and_the_default():
    """``--reuse-offset-scales 0 1``: ``reuse x0`` ranks by last access alone, so it hits what
    ``lru`` hits in every row; ``reuse x1`` is the default policy, so it hits what ``reuse``
    does; each column replays a fresh policy (one shared instance would differ from both)."""
    out = run_bench("benchmarks/bench_policies.py", "--quick", "--no-trace", "--shapes", "chat", "--num-requests", "300",
                    "--capacities", "20", "60", "--reuse-offset-scales", "0", "1")  # fmt: skip
    header = next(line for line in out.splitlines() if line.startswith("capacity"))
    columns = header.split("|")[1].split()
    assert columns == ["reuse*", "lru", "segmented", "reuse", "x0", "reuse", "x1"], header
    rows = [line.split("|")[1].split() for line in out.splitlines() if re.match(r" +(20|60) ", line)]
    assert len(rows) == 2, out
    for cells in rows:  # hit% (share) per policy: reuse*, lru, segmented, reuse x0, reuse x1
        rates = cells[0::2]
        assert rates[3] == rates[1] and rates[4] == rates[0], cells
    assert any(row[0::2][0] != row[0::2][1] for row in rows), rows  # the default differs from lru here


def test_policies_bench_counts_after_the_warm_up_fraction():
    """``--warmup-fraction 0.5``: the first half of each trace warms every cache and yardstick
    and is not counted; fractions outside [0, 1) are refused in one line."""
    out = run_bench("benchmarks/bench_policies.py", "--quick", "--no-trace", "--shapes", "chat", "--num-requests", "60",
                    "--capacities", "8", "100000", "--warmup-fraction", "0.5")  # fmt: skip
    assert "chat (seed 0): 30 requests counted after 30 warm-up requests" in out, out
    every_policy_hits_unlimited(out, "  100000")
    stderr = run_refused("benchmarks/bench_policies.py", "--no-trace", "--warmup-fraction", "1")
    assert "--warmup-fraction 1: expected a share of the requests in [0, 1)" in stderr, stderr


def test_policies_bench_refuses_a_bad_offset_scale_in_one_line():
    stderr = run_refused("benchmarks/bench_policies.py", "--no-trace", "--reuse-offset-scales", "-1")
    assert "--reuse-offset-scales -1: offset_scale=-1.0 must be a finite number >= 0" in stderr, stderr


def test_cluster_replay_bench_resamples_the_trace_and_summarizes_the_copies():
    """``--resample 2``: the trace and two copies each missing a random 10% of it, then the
    copies' mean and range, which must be those of the copies' own rows."""
    out = run_bench("benchmarks/bench_cluster_replay.py", "--shape", "chat", "--shape-requests", "200", "--nodes", "2",
                    "--device-blocks", "40", "--resample", "2", "--drop-fraction", "0.1")  # fmt: skip
    rows = table_rows(out, "2 | 40")
    assert [row[2] for row in rows] == ["the trace", "1", "2", "mean of copies", "range of copies"], out
    assert rows[0][3] == "200" and all(150 <= int(row[3]) < 200 for row in rows[1:3]), rows
    local = [float(row[4]) for row in rows[1:3]]
    assert float(rows[3][4]) == pytest.approx(sum(local) / 2, abs=0.006), rows
    assert rows[4][4] == f"{min(local):+.2f} to {max(local):+.2f}", rows


@pytest.mark.parametrize("flags, complaint", [
    (["--resample", "0"], "--resample 0: expected a number of copies >= 1"),
    (["--resample", "2", "--drop-fraction", "1"], "--drop-fraction 1: expected a fraction"),
    (["--resample", "2", "--share-slack-rel", "0.1"], "give one of them"),
    (["--policy-share-s", "2", "--no-policy-sharing"], "not allowed with argument"),
    (["--policy-share-s", "0"], "--policy-share-s 0: expected a positive finite number"),
])  # fmt: skip
def test_cluster_replay_bench_refuses_bad_flags_in_one_line(flags, complaint):
    stderr = run_refused("benchmarks/bench_cluster_replay.py", "--shape", "chat", *flags)
    assert complaint in stderr, stderr
