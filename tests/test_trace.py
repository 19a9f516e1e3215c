"""Mooncake-format trace loading: parsing, ordering, block token counts and every error."""

import json

import pytest

from kvjax.tools.replay import replay_report
from kvjax.tools.trace import TraceRequest, load_trace, parse_trace_lines

_MISSING = object()  # a field value meaning "leave the field out"


def _line(**fields):
    record = {"timestamp": 0, "input_length": 1000, "output_length": 10, "hash_ids": [7, 8]}
    record.update(fields)
    return json.dumps({k: v for k, v in record.items() if v is not _MISSING})


def test_a_line_becomes_a_request_with_its_fields():
    (request,) = parse_trace_lines([_line(timestamp=12.5, output_length=3)])
    assert request == TraceRequest(12.5, 1000, 3, (7, 8))


def test_blocks_hold_block_tokens_except_a_partial_last_one():
    request = TraceRequest(0.0, 1000, 1, (1, 2))
    assert request.block_tokens() == [512, 488]
    assert TraceRequest(0.0, 1024, 1, (1, 2)).block_tokens() == [512, 512]
    assert TraceRequest(0.0, 9, 1, (1, 2, 3)).block_tokens(4) == [4, 4, 1]
    assert TraceRequest(0.0, 0, 1, ()).block_tokens() == []


@pytest.mark.parametrize("request_, block", [(TraceRequest(0.0, 1500, 1, (1, 2, 3)), 1024),  # a last block of -548
                                              (TraceRequest(0.0, 1500, 1, (1, 2, 3)), 256),  # one of 988
                                              (TraceRequest(0.0, 1500, 1, ()), 512),  # 1500 tokens in no block
                                              (TraceRequest(0.0, -5, 1, ()), 512)])  # fmt: skip
def test_block_tokens_refuses_an_id_count_the_block_size_does_not_give(request_, block):
    with pytest.raises(ValueError, match=rf"has {len(request_.hash_ids)} hash ids but "
                                         rf"input_length={request_.input_length} at block_tokens={block} needs"):
        request_.block_tokens(block)


def test_a_replay_at_another_block_size_than_the_trace_raises_instead_of_skewing_token_hits():
    # Loaded at 512 tokens a block, replayed at 1024: the last blocks would hold -548 tokens,
    # and the two shared blocks 2048 hit tokens of a 1500-token prompt.
    requests = [TraceRequest(0.0, 1500, 1, (1, 2, 3)), TraceRequest(1.0, 1500, 1, (1, 2, 4))]
    with pytest.raises(ValueError, match=r"has 3 hash ids but input_length=1500 at block_tokens=1024"):
        replay_report(requests, 8, block_tokens=1024)


def test_load_sorts_by_timestamp_keeping_file_order_for_ties(tmp_path):
    lines = [_line(timestamp=5, hash_ids=[1]), _line(timestamp=0, hash_ids=[2]),
             _line(timestamp=5, hash_ids=[3]), _line(timestamp=1, hash_ids=[4])]  # fmt: skip
    lines = [line.replace('"input_length": 1000', '"input_length": 100') for line in lines]
    path = tmp_path / "trace.jsonl"
    path.write_text("\n".join(lines) + "\n\n")  # a trailing blank line is fine
    requests = load_trace(path)
    assert [r.hash_ids for r in requests] == [(2,), (4,), (1,), (3,)]


def test_blank_lines_are_skipped_and_extra_fields_ignored():
    lines = ["", _line(session="abc"), "   "]
    assert len(parse_trace_lines(lines)) == 1


def test_block_tokens_other_than_512_set_the_expected_id_count():
    (request,) = parse_trace_lines([_line(input_length=9, hash_ids=[1, 2, 3])], block_tokens=4)
    assert request.block_tokens(4) == [4, 4, 1]


@pytest.mark.parametrize(
    "line, message",
    [
        ("{not json", r"t\.jsonl:1: not valid JSON"),
        ("[1, 2]", r"t\.jsonl:1: expected a JSON object, got list"),
        ("[" * 100_000 + "]" * 100_000, r"t\.jsonl:1: not valid JSON \(nested too deeply\)"),  # was a RecursionError
        ('{"timestamp": ' + "9" * 5000 + "}", r"t\.jsonl:1: not valid JSON \(Exceeds the limit"),  # named no line
        (_line(timestamp=_MISSING), r"t\.jsonl:1: missing field 'timestamp'"),
        (_line(hash_ids=_MISSING), r"missing field 'hash_ids'"),
        (_line(timestamp="0"), r"field 'timestamp'='0' must be a non-negative int or float"),
        (_line(timestamp=-1), r"field 'timestamp'=-1 must be a non-negative"),
        (_line(timestamp=float("nan")), r"field 'timestamp'=nan must be a non-negative"),
        (_line(timestamp=10**400), r"field 'timestamp'=1000000000000000000000000000000000000\.\.\. must be a non-neg"),
        (_line(input_length=10.0), r"field 'input_length'=10.0 must be a non-negative int"),
        (_line(output_length=True), r"field 'output_length'=True must be a non-negative int"),
        (_line(output_length=-3), r"field 'output_length'=-3 must be a non-negative int"),
        (_line(hash_ids=7), r"field 'hash_ids'=7 must be a list"),
        (_line(hash_ids=[1, -2]), r"field 'hash_ids'\[1\]=-2 must be a non-negative int"),
        (_line(hash_ids=[1, 2.0]), r"field 'hash_ids'\[1\]=2.0 must be a non-negative int"),
        (_line(hash_ids=[1, 2, 3]), r"has 3 ids but input_length=1000 needs ceil\(1000/512\)=2"),
        (_line(input_length=0), r"has 2 ids but input_length=0 needs ceil\(0/512\)=0"),
    ],
)
def test_bad_lines_name_the_line_and_the_field(line, message):
    with pytest.raises(ValueError, match=message):
        parse_trace_lines([line], source="t.jsonl")


def test_the_id_count_is_exact_for_lengths_past_a_floats_precision():
    # 2**53 + 1 tokens in blocks of 2**52 need 3 ids; a float quotient said 2.
    length, block = 2**53 + 1, 2**52
    with pytest.raises(ValueError, match=r"has 2 ids but input_length=9007199254740993 needs .*=3"):
        parse_trace_lines([_line(input_length=length, hash_ids=[1, 2])], block_tokens=block)
    (request,) = parse_trace_lines([_line(input_length=length, hash_ids=[1, 2, 3])], block_tokens=block)
    assert request.block_tokens(block) == [block, block, 1]


def test_errors_count_lines_from_one_including_blank_ones(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text(_line() + "\n\n" + _line(hash_ids=[1]) + "\n")
    with pytest.raises(ValueError, match=r"bad\.jsonl:3: field 'hash_ids' has 1 ids"):
        load_trace(path)


def test_block_tokens_must_be_positive(tmp_path):
    with pytest.raises(ValueError, match=r"block_tokens=0 must be >= 1"):
        load_trace(tmp_path / "unused.jsonl", block_tokens=0)


def test_a_missing_file_raises_os_error(tmp_path):
    with pytest.raises(FileNotFoundError):
        load_trace(tmp_path / "absent.jsonl")
