"""Generated trace shapes: Mooncake-format validity, determinism and the sharing each one promises."""

import io
import itertools
import math
from collections import Counter, defaultdict

import pytest

from kvjax.tools.replay_bounds import unlimited_replay
from kvjax.tools.trace import MOONCAKE_BLOCK_TOKENS, load_trace, parse_trace_lines
from kvjax.tools.trace_family import SHAPES, PromptHasher, generate, main, write_trace

N = 600  # requests per generated trace: enough for every shape's structure to show


@pytest.fixture(scope="module")
def traces():
    return {shape: generate(shape, num_requests=N, seed=3) for shape in SHAPES}


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_every_shape_writes_valid_mooncake_lines_that_read_back_equal(shape, traces, tmp_path):
    requests = traces[shape]
    assert len(requests) == N
    assert [r.timestamp_ms for r in requests] == sorted(r.timestamp_ms for r in requests)
    for request in requests:
        assert len(request.hash_ids) == math.ceil(request.input_length / MOONCAKE_BLOCK_TOKENS) > 0
        assert request.timestamp_ms == int(request.timestamp_ms) and request.output_length >= 1
    path = tmp_path / f"{shape}.jsonl"
    write_trace(requests, str(path))
    assert parse_trace_lines(path.read_text().splitlines(), source=str(path)) == requests
    assert load_trace(path) == requests


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_a_seed_gives_one_trace_and_another_seed_another(shape, traces):
    assert generate(shape, num_requests=N, seed=3) == traces[shape]
    assert generate(shape, num_requests=N, seed=4) != traces[shape]


def test_prompt_hasher_ids_name_the_whole_prefix():
    hasher = PromptHasher(block_tokens=4)
    system, document, other, question = (hasher.text() for _ in range(4))
    first = hasher.hash_ids([(system, 4), (document, 8), (question, 2)])
    assert len(first) == 4 and len(set(first)) == 4
    # Same system prompt and document: same full blocks; another question: another tail.
    assert hasher.hash_ids([(system, 4), (document, 8), (other, 2)])[:3] == first[:3]
    # The document behind a 2-token system prompt is cut differently: nothing after block 0... and
    # even block 0 differs, since it holds other tokens.
    assert not set(hasher.hash_ids([(system, 2), (document, 8)])) & set(first)
    # A partial last block differs from the full block that later extends it.
    grown = hasher.hash_ids([(system, 4), (document, 8), (question, 4)])
    assert grown[:3] == first[:3] and grown[3] != first[3]


def test_chat_turns_resend_the_whole_previous_prompt(traces):
    requests = traces["chat"]
    full_prefixes = {r.hash_ids[: r.input_length // MOONCAKE_BLOCK_TOKENS] for r in requests}
    later_turns = [r for r in requests if any(r.hash_ids[:k] in full_prefixes for k in range(4, len(r.hash_ids)))]
    assert len(later_turns) > N // 3  # mean 5 turns: most requests continue a conversation
    firsts = Counter(r.hash_ids[0] for r in requests)
    assert firsts.most_common(1)[0][1] > N // 10  # the most popular system prompt (Zipf)


def test_agent_steps_grow_one_context(traces):
    requests = traces["agent"]
    by_first: dict[int, list] = defaultdict(list)
    for request in requests:
        by_first[request.hash_ids[0]].append(request)
    assert len(by_first) <= 12  # one agent prompt per kind of agent
    steps = sum(1 for r in requests if unlimited_prefix(requests, r) >= len(r.hash_ids) // 2)
    assert steps > N // 2  # most steps reuse at least half of their prompt


def unlimited_prefix(requests, request):
    """Leading blocks of ``request`` that some earlier request had (a slow reference)."""
    best = 0
    for earlier in requests:
        if earlier is request:
            break
        run = 0
        for mine, theirs in zip(request.hash_ids, earlier.hash_ids):
            if mine != theirs:
                break
            run += 1
        best = max(best, run)
    return best


def test_fewshot_queries_share_a_template_and_nothing_after_it(traces):
    requests = traces["fewshot"]
    firsts = Counter(r.hash_ids[0] for r in requests)  # a template's first block (most are longer)
    assert sum(count for count in firsts.values() if count > 1) > 0.8 * N
    assert firsts.most_common(1)[0][1] > N // 100
    # The query never repeats: a request's last block is its own.
    assert len({r.hash_ids[-1] for r in requests}) == N


def test_rag_shares_the_system_prompt_and_follow_ups_share_whole_retrievals(traces):
    requests = traces["rag"]
    assert len({r.hash_ids[:2] for r in requests}) == 1  # a 1,200-token system prompt: 2 full blocks
    retrievals = Counter(r.hash_ids[:-1] for r in requests if len(r.hash_ids) > 3)
    assert sum(count - 1 for count in retrievals.values()) > N // 10  # follow-ups (30% by default)


def test_scan_one_offs_are_never_seen_again(traces):
    requests = traces["scan"]
    first_counts = Counter(r.hash_ids[0] for r in requests)
    one_offs = sum(1 for r in requests if first_counts[r.hash_ids[0]] == 1)
    assert 0.35 * N < one_offs < 0.65 * N  # half the requests are scans
    assert len([h for h, c in first_counts.items() if c > 1]) <= 80  # the hot set


def test_chat_scan_mixes_one_off_documents_into_chats(traces):
    requests = traces["chat_scan"]
    long_one_offs = [r for r in requests if len(r.hash_ids) >= 8 and
                     sum(1 for q in requests if q.hash_ids[0] == r.hash_ids[0]) == 1]  # fmt: skip
    assert 0.05 * N < len(long_one_offs) < 0.25 * N  # 15% scans by default


def test_bursty_topics_are_hot_for_a_while_and_then_never_again():
    requests = generate("bursty", num_requests=2000, seed=3)
    times: dict[int, list[float]] = defaultdict(list)
    for request in requests:
        times[request.hash_ids[0]].append(request.timestamp_ms)
    topics = [t for t in times.values() if len(t) > 1]
    assert len(topics) >= 10
    assert all(t[-1] - t[0] <= 600_000 for t in topics)  # a burst lasts 10 minutes at most
    assert all(b - a < 120_000 for t in topics for a, b in itertools.pairwise(t))  # and never comes back
    ended = sum(1 for t in topics if t[-1] < 0.8 * requests[-1].timestamp_ms)
    assert ended > len(topics) // 2  # most topics are over long before the trace ends


def test_longtail_users_come_back_to_their_own_context(traces):
    requests = traces["longtail"]
    contexts = Counter(r.hash_ids[1:3] for r in requests if len(r.hash_ids) > 3)
    assert contexts.most_common(1)[0][1] >= 5  # a popular user
    assert sum(1 for c in contexts.values() if c == 1) > len(contexts) // 3  # a long tail


def test_mixed_tenants_never_share_a_block(traces):
    # mixed(seed=3) is chat, agent, rag and scan (seeds 48..51) at 40/30/20/10% of the requests.
    parts = [SHAPES[shape](num_requests=round(N * share), seed=48 + index)
             for index, (shape, share) in enumerate((("chat", 0.4), ("agent", 0.3), ("rag", 0.2), ("scan", 0.1)))]  # fmt: skip
    mixed = traces["mixed"]
    assert sorted(len(r.hash_ids) for r in mixed) == sorted(len(r.hash_ids) for part in parts for r in part)
    # Hits add up exactly: no block of one tenant is ever a hit for another.
    assert unlimited_replay(mixed).hit_blocks == sum(unlimited_replay(part).hit_blocks for part in parts)
    ids = [{h for r in part for h in r.hash_ids} for part in parts]
    assert sum(map(len, ids)) == len({h for r in mixed for h in r.hash_ids})


def test_unknown_shape_and_negative_size_raise():
    with pytest.raises(ValueError, match=r"unknown trace shape 'zipf'; valid shapes: \['agent', "):
        generate("zipf")
    with pytest.raises(ValueError, match=r"num_requests=-1 must be >= 0"):
        generate("chat", num_requests=-1)
    with pytest.raises(ValueError, match=r"block_tokens=0 must be >= 1"):
        PromptHasher(block_tokens=0)


@pytest.mark.parametrize("shape", ["chat", "fewshot", "mixed"])
def test_a_negative_or_fractional_seed_or_size_raises_naming_it(shape, tmp_path, capsys):
    # numpy's "expected non-negative integer" named no parameter; 2.5 requests was a TypeError
    for kwargs, name in (({"seed": -1}, r"seed=-1"), ({"num_requests": 2.5}, r"num_requests=2\.5"),
                         ({"seed": 1.5}, r"seed=1\.5")):  # fmt: skip
        with pytest.raises(ValueError, match=rf"{name} must be >= 0 \(an int\)"):
            generate(shape, **{"num_requests": 5, **kwargs})
    assert main([shape, str(tmp_path / "x.jsonl"), "--seed", "-1"]) == 2
    assert capsys.readouterr().err == "python -m kvjax.tools.trace_family: error: seed=-1 must be >= 0 (an int)\n"


def test_command_line_writes_a_trace_file(tmp_path, capsys):
    path = tmp_path / "rag.jsonl"
    assert main(["rag", str(path), "--num-requests", "50", "--seed", "7"]) == 0
    assert load_trace(path) == generate("rag", num_requests=50, seed=7)
    assert "wrote 50 rag requests" in capsys.readouterr().out
    assert io.StringIO(path.read_text()).readline().startswith('{"timestamp": ')


def test_command_line_errors_are_one_line(tmp_path, capsys):
    # they were tracebacks
    assert main(["chat", str(tmp_path / "x.jsonl"), "--num-requests", "-1"]) == 2
    assert capsys.readouterr().err == ("python -m kvjax.tools.trace_family: error: num_requests=-1 must be >= 0 (an int)\n")
    assert main(["chat", str(tmp_path / "missing" / "x.jsonl"), "--num-requests", "1"]) == 1
    assert "error: No such file or directory: " in capsys.readouterr().err


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_every_shape_gives_exactly_the_requests_asked_for(shape):
    # 0 raised an IndexError in five shapes; mixed rounded each tenant's share apart (11 gave 10)
    assert generate(shape, num_requests=0) == []
    for count in (1, 11, 31):
        assert len(generate(shape, num_requests=count)) == count
