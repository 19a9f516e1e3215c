"""Stop strings (OpenAI's and vLLM's ``stop``) and vLLM's ``min_tokens``: where a request ends,
the text it answers, the tokens it keeps, and the cache it leaves behind."""

import numpy as np
import pytest
from engine_cases import make_engine

from kvjax.serving.engine_events import FinishEvent
from kvjax.serving.request import Request
from kvjax.serving.stop_strings import StopStrings
from kvjax.text.tokenizer import ByteTokenizer, as_tokenizer

PROMPT = np.frombuffer(b"The quick brown fox jumps over the lazy dog; then", np.uint8).astype(np.int32)
NUM_NEW = 24
DECODE = ByteTokenizer().decode


def run_one(engine, **kwargs) -> FinishEvent:
    engine.add_request("r", tokens=PROMPT, **{"max_new_tokens": NUM_NEW, **kwargs})
    (finish,) = [event for event in engine.run(summary=False) if isinstance(event, FinishEvent)]
    engine.check_invariants()
    return finish


def where_it_stops(tokens, stops):
    """The spec, by brute force: the first token count whose text holds a stop string, and
    that text cut before the earliest one (None: no stop string ever shows)."""
    for count in range(1, len(tokens) + 1):
        text = DECODE(tokens[:count])
        starts = [text.find(stop) for stop in stops if stop in text]
        if starts:
            return count, text[: min(starts)]
    return None


@pytest.fixture(scope="module")
def unstopped():
    """The greedy output of PROMPT, run to its length: (tokens, text)."""
    with make_engine() as engine:
        finish = run_one(engine)
    assert finish.reason == "length" and len(finish.output_token_ids) == NUM_NEW
    return finish.output_token_ids.tolist(), finish.text


def test_a_stop_string_ends_the_request_where_it_completes_and_cuts_the_text(unstopped):
    tokens, text = unstopped
    start = len(text) // 3
    stop = text[start : start + 3]  # three characters: completed by a later token than the one that began it
    count, answer = where_it_stops(tokens, [stop])
    assert count < NUM_NEW
    with make_engine() as engine:
        finish = run_one(engine, stop=stop)
    assert (finish.status, finish.reason) == ("finished", "stop")
    assert finish.text == answer == text[: text.find(stop)]  # the stop string itself is left out
    assert finish.output_token_ids.tolist() == tokens[:count]  # every generated token is kept, as in vLLM


def test_a_request_ended_by_a_stop_string_leaves_the_cache_as_one_ended_by_length(unstopped):
    """Its committed pages stay cached and its blocks go back, exactly as for a request that
    ended at the same token for its length (or, the same path, a stop token)."""
    tokens, text = unstopped
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    count, _ = where_it_stops(tokens, [stop])
    states = []
    for kwargs in ({"stop": [stop]}, {"max_new_tokens": count}):
        with make_engine() as engine:
            finish = run_one(engine, **kwargs)
            allocator = engine.cache.allocator
            cached = engine.cache.match(np.concatenate([PROMPT, finish.output_token_ids]), None).hit_tokens
            states.append((finish.output_token_ids.tolist(), allocator.num_free, allocator.num_referenced,
                           engine.cache.num_sequences, allocator.free_queue().tolist(), cached))  # fmt: skip
    assert states[0] == states[1]
    assert states[0][2:4] == (0, 0)  # nothing held: the request's blocks were released
    assert states[0][5] > 0  # and its full pages are hits for the next request


def test_of_several_stop_strings_the_earliest_in_the_text_wins(unstopped):
    tokens, text = unstopped
    early, late = text[2:4], text[len(text) - 4 : len(text) - 2]
    stops = [late, early]  # the order given does not matter
    count, answer = where_it_stops(tokens, stops)
    with make_engine() as engine:
        finish = run_one(engine, stop=stops)
    assert finish.reason == "stop" and finish.text == answer
    assert finish.text == text[: min(text.find(early), text.find(late))]
    assert finish.output_token_ids.tolist() == tokens[:count]


def test_a_stop_string_that_never_shows_lets_the_request_run_to_its_length(unstopped):
    tokens, text = unstopped
    stop = "never in this output \u2603"
    assert stop not in text
    with make_engine() as engine:
        finish = run_one(engine, stop=(stop,))
    assert (finish.reason, finish.text, finish.output_token_ids.tolist()) == ("length", text, tokens)


def test_min_tokens_keeps_an_early_stop_string_from_ending_the_request(unstopped):
    tokens, text = unstopped
    stop = text[1:3]
    count, _ = where_it_stops(tokens, [stop])
    with make_engine() as engine:
        finish = run_one(engine, stop=stop, min_tokens=count + 1)
    assert len(finish.output_token_ids) > count  # not ended where it would have been


@pytest.mark.parametrize("stop, message", [
    ("", r"^stop=\('',\) must be a non-empty str or a sequence of non-empty strs; '' is not a non-empty str$"),
    (["\n", ""], r"^stop=\('\\n', ''\) must be .*; '' is not a non-empty str$"),
    ([1], r"^stop=\(1,\) must be .*; 1 is not a non-empty str$"),
    (["a", None], r"^stop=\('a', None\) must be .*; None is not a non-empty str$"),
    (b"\n", r"^stop=b'\\n' must be a non-empty str or a sequence of non-empty strs \(stop strings\)$"),
    (5, r"^stop=5 must be a non-empty str or a sequence of non-empty strs \(stop strings\)$"),
    ({"a"}, r"^stop=\{'a'\} must be a non-empty str"),  # a set has no order to read
])  # fmt: skip
def test_bad_stop_strings_are_refused_by_name_and_queue_nothing(stop, message):
    with make_engine() as engine:
        with pytest.raises(ValueError, match=message):
            engine.add_request("r", tokens=PROMPT, stop=stop)
        assert not engine.has_unfinished


@pytest.mark.parametrize("min_tokens, message", [
    (-1, r"^min_tokens=-1 must be an int in \[0, max_new_tokens=16\]$"),
    (17, r"^min_tokens=17 must be an int in \[0, max_new_tokens=16\]$"),
    (True, r"^min_tokens=True must be an int"),
])  # fmt: skip
def test_a_bad_min_tokens_is_refused_by_name(min_tokens, message):
    with make_engine() as engine:
        with pytest.raises(ValueError, match=message):
            engine.add_request("r", tokens=PROMPT, stop="x", min_tokens=min_tokens)
        assert not engine.has_unfinished


def test_stop_strings_need_a_tokenizer_that_decodes():
    no_decode = as_tokenizer(lambda text: list(text.encode()), vocab_size=256)
    with make_engine(tokenizer=no_decode) as engine:
        with pytest.raises(ValueError, match=r"^stop=\('\\n',\) needs a tokenizer that decodes \(stop strings are "
                                             r"searched in the decoded output\); this one cannot: TypeError: "):
            engine.add_request("r", tokens=PROMPT, stop="\n")
        assert not engine.has_unfinished
        engine.add_request("r", tokens=PROMPT, max_new_tokens=2)  # without stop strings it serves
        assert engine.finish().num_finished == 1


# --- the rule where a token is appended (Request.append_token), without a model ----------------


def request(stop=(), *, min_tokens=0, max_new_tokens=10, stop_token_ids=(), decode=DECODE) -> Request:
    stop_when = StopStrings(stop, decode, min_tokens) if stop else None
    return Request("r", np.asarray([1], np.int32), max_new_tokens, stop_token_ids=stop_token_ids,
                   stop_when=stop_when, min_tokens=min_tokens)  # fmt: skip


def append(request: Request, text: str) -> list[bool]:
    return [request.append_token(byte) for byte in text.encode()]


def test_a_stop_string_ends_at_the_token_that_completes_it_and_cuts_at_its_start():
    req = request(["lo w"])
    assert append(req, "hello w") == [False] * 6 + [True]
    assert req.finish_reason == "stop" and req.stop_when.cut == 3
    assert req.stop_when.answer(DECODE(req.output_token_ids)) == "hel"


def test_the_earliest_stop_string_in_the_text_wins_over_the_first_completed():
    req = request(["abcd", "bc", "d"])
    assert append(req, "xabc") == [False, False, False, True]  # "bc" completes first
    assert req.stop_when.cut == 2
    req = request(["bc", "abc"])
    assert append(req, "xabc") == [False, False, False, True]  # both complete at once: "abc" starts first
    assert req.stop_when.cut == 1


def test_a_token_that_completes_a_stop_string_at_the_last_allowed_token_ends_as_stop():
    req = request(["ab"], max_new_tokens=2)
    assert append(req, "ab") == [False, True] and req.finish_reason == "stop"
    req = request(["ab"], max_new_tokens=2)
    assert append(req, "ac") == [False, True] and req.finish_reason == "length" and req.stop_when.cut is None


def test_min_tokens_holds_off_stop_tokens_and_stop_strings_written_before_it():
    req = request(stop_token_ids=[ord("a")], min_tokens=3)
    assert append(req, "aaa") == [False, False, True] and req.finish_reason == "stop"
    # "ab" ends within the first min_tokens - 1 tokens: ordinary text; a later one counts
    req = request(["ab"], min_tokens=3)
    assert append(req, "abxab") == [False, False, False, False, True]
    assert req.stop_when.cut == 3
    # one that ends in the text of the min_tokens-th token counts, from where it starts
    req = request(["ab"], min_tokens=3)
    assert append(req, "xab") == [False, False, True] and req.stop_when.cut == 1


def test_a_decode_that_fails_mid_request_stops_the_checks_not_the_engine(caplog):
    calls = []

    def decode(ids):
        calls.append(len(ids))
        if len(ids) >= 2:
            raise RuntimeError("tokenizer service down")
        return DECODE(ids)

    req = request(["zz"], max_new_tokens=4, decode=decode)
    assert append(req, "zzzz") == [False, False, False, True]  # an exception here would leave the step half-recorded
    assert req.finish_reason == "length" and calls == [1, 2]  # no retry at every token
    assert "its stop strings are no longer checked" in caplog.text


def test_a_request_refuses_a_stop_when_that_is_not_callable():
    with pytest.raises(ValueError, match=r"^stop_when='\\n' must be None or a callable \(Request -> bool\)$"):
        Request("r", np.asarray([1], np.int32), 4, stop_when="\n")
