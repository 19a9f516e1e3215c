"""The cluster demo's pieces against the session's real cluster (two nodes, a prefix router):
a small workload through the router gives the text one uncached node gives, with hits; the
table; and bad arguments as one-line errors. (The whole demo starts its own processes and
takes ~40 s: run by hand, ``python -m kvjax cluster-demo --nodes 2``.)"""

import uuid

import pytest

from kvjax.__main__ import main
from kvjax.cluster.processes import ServiceProcess
from kvjax.tools.cluster_demo import ClusterDemoResult, format_table, run_cluster_demo, run_workload
from kvjax.tools.cluster_demo_client import Completion
from kvjax.tools.workload import WorkloadSpec, build_workload

SMALL = WorkloadSpec(system_prompts=1, questions_per_system_prompt=3, conversations=1, turns_per_conversation=2,
                     few_shot_templates=0, system_prompt_chars=200, max_new_tokens=4)  # fmt: skip


def test_a_workload_through_the_router_gives_one_uncached_nodes_text(cluster):
    sessions = build_workload(SMALL)
    run = uuid.uuid4().hex  # namespaces no other test used
    routed = run_workload(cluster.router.url, sessions, 0.05, lambda session, rid: f"{run}:{session.namespace}")
    alone = run_workload(cluster.nodes["n1"].url, sessions, 0.05, lambda session, rid: f"{run}-uncached:{rid}")
    assert routed.keys() == alone.keys() and len(routed) == 5
    assert all(routed[rid].text == alone[rid].text for rid in routed)
    assert {c.node for c in routed.values()} <= {"n1", "n2"} and {c.node for c in alone.values()} == {"n1"}
    assert sum(c.cached_tokens for c in routed.values()) > 0  # the second turn, the shared system prompt
    assert sum(c.cached_tokens for c in alone.values()) == 0
    result = ClusterDemoResult({"prefix": routed, "round_robin": routed, "one uncached node": alone}, ["n1", "n2"])
    assert result.identical
    table = format_table(result)
    assert "prefix: same text as one uncached node: yes (5 requests)" in table
    assert "TTFT p50" in table and "n2: cached prompt tokens" in table and "n2:   fetched from others" in table


def test_fetches_are_counted_with_their_waits():
    plain, fetched = Completion("n1", "a", 32, 0, 0.2), Completion("n2", "a", 32, 16, 0.1, 16, 0.05, "ok")
    result = ClusterDemoResult({"round_robin": {"r1": plain, "r2": fetched}, "one uncached node": {"r1": plain,
                                                                                               "r2": plain}},
                               ["n1", "n2"])  # fmt: skip
    table = format_table(result)
    assert [line.split()[-2] for line in table.splitlines() if line.startswith("tokens fetched")] == ["16"]
    assert "1 (1 ok)" in table and "fetch wait p50" in table and "50 ms" in table


def test_a_differing_text_is_named():
    same, other = Completion("n1", "abc", 10, 0, 0.1), Completion("n1", "abd", 10, 0, 0.1)
    result = ClusterDemoResult({"prefix": {"r1": same, "r2": other}, "round_robin": {"r1": same},
                                "one uncached node": {"r1": same, "r2": same}}, ["n1"])  # fmt: skip
    assert result.differing("prefix") == ["r2"] and result.differing("round_robin") == ["r2"]
    assert not result.identical
    assert "prefix: same text as one uncached node: NO: 1 differ, e.g. ['r2']" in format_table(result)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--nodes", "0"], "kvjax cluster-demo: error: nodes=0 must be an int >= 1"),
        (["--arrival-ms", "-5"], "error: arrival_ms=-5.0 must be in [0, 3600000] (milliseconds between sessions"),
        (["--router", "fastest"], "error: strategies=['fastest']; expected some of ['prefix', 'least_loaded', "),
        (["--preset", "nosuch"], "error: preset 'nosuch' is not a shipped preset"),  # before any process starts
    ],
)
def test_bad_arguments_are_one_line_errors(argv, message, capsys):
    assert main(["cluster-demo", *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("bad", ["100", None, True])
def test_an_arrival_ms_that_is_no_number_is_named(bad):
    # a str or None raised a bare TypeError from the range check; True passed for 1 ms
    with pytest.raises(ValueError, match=rf"arrival_ms={bad!r} must be in \[0, 3600000\]"):
        run_cluster_demo(arrival_ms=bad)


def test_a_process_that_exits_before_it_is_ready_says_so_with_its_last_log_line(tmp_path):
    node = ServiceProcess(["node", "--node-id", "x", "--port", "0", "--preset", "nosuch"], tmp_path / "x.log")
    with pytest.raises(RuntimeError) as error:
        node.wait_ready(timeout_s=120)
    message = str(error.value)
    assert "--preset nosuch` exited with code 1 before it was ready; its log ends:" in message  # not "within 120s"
    assert message.strip().splitlines()[-1] == "node: preset 'nosuch' is not a shipped preset; expected one of " \
        "['tiny'] or the path of a .toml file"  # one line, not a traceback
