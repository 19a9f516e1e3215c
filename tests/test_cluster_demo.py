"""The cluster demo's pieces against the session's real cluster (two nodes, a prefix router):
a small workload through the router gives the text one uncached node gives, with hits; the
table; and bad arguments as one-line errors. (The whole demo starts its own processes and
takes ~40 s: run by hand, ``python -m kvjax cluster-demo --nodes 2``.)"""

import uuid

import pytest

from kvjax.__main__ import main
from kvjax.tools.cluster_demo import ClusterDemoResult, format_table, run_workload
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
    assert "TTFT p50" in table and "n2: cached prompt tokens" in table


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
        (["--arrival-ms", "-5"], "error: arrival_ms=-5.0 must be >= 0 (milliseconds between sessions)"),
    ],
)
def test_bad_arguments_are_one_line_errors(argv, message, capsys):
    assert main(["cluster-demo", *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1
