"""The completions protocol: every validation message, and streamed text that concatenates to
the final text whatever bytes the model produces."""

import asyncio
import dataclasses
import json
import logging

import pytest
from fastapi import FastAPI
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry
from starlette.datastructures import Headers

from kvjax.cache.block_keys import Namespace
from kvjax.cluster import http_front
from kvjax.cluster.http_front import ClientGone, IgnoredFields, limit_request_bodies, unless_client_leaves
from kvjax.cluster.openai_api import (
    NAMESPACE_HEADER,
    CompletionRequest,
    RequestError,
    TextStream,
    parse_completion_request,
    sse,
)
from kvjax.text.tokenizer import ByteTokenizer


def parse(body, headers=None):
    return parse_completion_request(json.dumps(body), headers)


def test_a_minimal_request_gets_the_defaults():
    assert parse({"model": "tiny", "prompt": "hi"}) == CompletionRequest("tiny", "hi", None)


def test_every_supported_field_is_read():
    request = parse({"model": "tiny", "prompt": ["hi"], "max_tokens": 5, "stream": True,
                     "stream_options": {"include_usage": True}, "temperature": 0.7, "top_k": 4, "seed": 3,
                     "user": "u1", "namespace": "tenant-a", "n": 1, "echo": False, "stop": None,
                     "top_p": 1})  # fmt: skip
    assert request == CompletionRequest("tiny", "hi", None, 5, True, True, 0.7, 4, 3, "tenant-a")
    assert parse({"model": "tiny", "prompt": [1, 2, 3]}).prompt_tokens == (1, 2, 3)


@pytest.mark.parametrize(
    "body, message",
    [
        ({"prompt": "x"}, r"model=None must be the served model's name"),
        ({"model": "tiny"}, r"prompt=None must be a string, a list of one string or a non-empty list of token ids"),
        ({"model": "tiny", "prompt": ["a", "b"]}, r"prompt=\['a', 'b'\] must be a string"),
        ({"model": "tiny", "prompt": []}, r"prompt=\[\] must be"),
        ({"model": "tiny", "prompt": "x", "max_tokens": 0}, r"max_tokens=0 must be an integer >= 1"),
        ({"model": "tiny", "prompt": "x", "max_tokens": "5"}, r"max_tokens='5' must be an integer >= 1"),
        ({"model": "tiny", "prompt": "x", "temperature": 3}, r"temperature=3 must be a number in \[0.0, 2.0\]"),
        ({"model": "tiny", "prompt": "x", "seed": 2**63},
         r"seed=9223372036854775808 must be an integer in \[-9223372036854775808, 9223372036854775807\]"),
        ({"model": "tiny", "prompt": "x", "stream": "yes"}, r"stream='yes' must be a bool"),
        ({"model": "tiny", "prompt": "x", "stream_options": {"include_usage": True}},
         r"stream_options is only allowed with stream=true"),
        ({"model": "tiny", "prompt": "x", "stream": True, "stream_options": {"usage": 1}},
         r"stream_options=\{'usage': 1\}; expected \{'include_usage': bool\}"),
        ({"model": "tiny", "prompt": "x", "n": 2}, r"n=2 is not supported; kvjax accepts only 1 or null$"),
        ({"model": "tiny", "prompt": "x", "stop": ["\n", ""]},
         r"stop=\['\\n', ''\] must be a non-empty string or a list of non-empty strings$"),
        ({"model": "tiny", "prompt": "x", "stop": ""}, r"stop='' must be a non-empty string or a list of"),
        ({"model": "tiny", "prompt": "x", "stop": [1]}, r"stop=\[1\] must be a non-empty string or a list of"),
        ({"model": "tiny", "prompt": "x", "stop": ["a", "b", "c", "d", "e"]},
         r"^stop has 5 strings; at most 4 are accepted \(OpenAI's limit\)$"),
        ({"model": "tiny", "prompt": "x", "min_tokens": 17}, r"^min_tokens=17 must be an integer in \[0, max_tokens=16\]$"),
        ({"model": "tiny", "prompt": "x", "max_tokens": 4, "min_tokens": -1},
         r"^min_tokens=-1 must be an integer in \[0, max_tokens=4\]$"),
        ({"model": "tiny", "prompt": "x", "min_tokens": True}, r"^min_tokens=True must be an integer"),
        ({"model": "tiny", "prompt": "x", "ignore_eos": 1}, r"^ignore_eos=1 must be a bool$"),
        ({"model": "tiny", "prompt": "x", "logprobs": 2}, r"logprobs=2 is not supported; kvjax accepts only null$"),
        # the type first: True == 1 and 0 == False, so these passed for the neutral value
        ({"model": "tiny", "prompt": "x", "n": True}, r"n=True must be an integer$"),
        ({"model": "tiny", "prompt": "x", "top_p": True}, r"top_p=True must be a number$"),
        ({"model": "tiny", "prompt": "x", "echo": 0}, r"echo=0 must be a bool$"),
        ({"model": "tiny", "prompt": "x", "stop": {}}, r"stop=\{\} must be a non-empty string or a list of non-empty "
                                                     "strings$"),
        ({"model": "tiny", "prompt": "x", "logprobs": []}, r"logprobs=\[\] must be an integer$"),
        ({"model": "tiny", "prompt": "x", "logit_bias": []}, r"logit_bias=\[\] must be an object$"),
        ({"model": "tiny", "prompt": "x", "user": {"a": 1}}, r"user=\{'a': 1\} must be a str$"),
        ({"model": "tiny", "prompt": "x", "top_k": -2}, r"top_k=-2 must be an integer >= -1 \(0 or -1: no limit\)$"),
        ({"model": "tiny", "prompt": "x", "namespace": 5}, r"namespace=5 must be a non-empty string"),
    ],
)
def test_bad_requests_name_the_field_and_what_was_expected(body, message):
    with pytest.raises(RequestError, match=message) as error:
        parse(body)
    assert error.value.status == 400
    assert error.value.body()["error"]["type"] == "invalid_request_error"


def test_unknown_fields_are_ignored_and_named_as_vllm_does():
    """They were refused with a 400: the official client and many tools send fields of their own."""
    plain = {"model": "tiny", "prompt": "hi", "max_tokens": 3, "temperature": 0.5, "seed": 7}
    extra = {**plain, "frobnicate": 1, "vendor_options": {"a": [1]}, "priority": 0, "length_penalty": 2.0}
    request = parse(extra)
    assert request.ignored_fields == ("frobnicate", "length_penalty", "priority", "vendor_options")
    assert dataclasses.replace(request, ignored_fields=()) == parse(plain)
    assert parse(plain).ignored_fields == ()


@pytest.mark.parametrize("field, value, message", [
    ("repetition_penalty", 1.2, r"^repetition_penalty=1.2 is not supported; kvjax accepts only 1 or null$"),
    ("min_p", 0.1, r"^min_p=0.1 is not supported"),
    ("use_beam_search", True, r"^use_beam_search=True is not supported; kvjax accepts only false or null$"),
    ("stop_token_ids", [5], r"^stop_token_ids=\[5\] is not supported; kvjax accepts only \[\] or null$"),
    ("include_stop_str_in_output", True, r"^include_stop_str_in_output=True is not supported"),
    ("skip_special_tokens", False, r"^skip_special_tokens=False is not supported; kvjax accepts only true or null$"),
    ("response_format", {"type": "json_object"},
     r"^response_format=\{'type': 'json_object'\} is not supported; kvjax accepts only "
     r"\{\"type\": \"text\"\} or null$"),
    ("guided_json", {"type": "object"},
     r"^guided_json=\{'type': 'object'\} is not supported; kvjax accepts only null$"),
    ("guided_choice", ["a", "b"], r"^guided_choice=\['a', 'b'\] is not supported"),
    ("truncate_prompt_tokens", 8, r"^truncate_prompt_tokens=8 is not supported; kvjax accepts only null$"),
    ("repetition_penalty", True, r"^repetition_penalty=True must be a number$"),  # True == 1, but no number
    ("logit_bias", {"50": 10}, r"^logit_bias=\{'50': 10\} is not supported; kvjax accepts only \{\} or null$"),
    ("suffix", "end", r"^suffix='end' is not supported; kvjax accepts only \"\" or null$"),
    ("echo", True, r"^echo=True is not supported; kvjax accepts only false or null$"),
])  # fmt: skip
def test_known_fields_whose_ignoring_would_change_the_text_are_refused(field, value, message):
    """vLLM honours these: ignored like unknown ones, a vLLM client's answer would silently differ."""
    with pytest.raises(RequestError, match=message) as error:
        parse({"model": "tiny", "prompt": "x", field: value})
    assert (error.value.status, error.value.param) == (400, field)


def test_the_neutral_values_of_vllms_fields_are_accepted():
    neutral = {"use_beam_search": False, "min_p": 0.0, "repetition_penalty": 1.0, "stop_token_ids": [],
               "bad_words": [], "include_stop_str_in_output": False, "skip_special_tokens": True,
               "add_special_tokens": True, "return_tokens_as_token_ids": False, "response_format": {"type": "text"},
               "guided_json": None, "cache_salt": None, "truncate_prompt_tokens": None}  # fmt: skip
    assert parse({"model": "tiny", "prompt": "hi", **neutral}) == CompletionRequest("tiny", "hi", None)


def test_ignored_fields_are_counted_and_named_at_most_once_per_interval(caplog, monkeypatch):
    registry = CollectorRegistry()
    ignored = IgnoredFields(registry, "kvjax_test", log_every_s=10.0)
    now = [100.0]
    monkeypatch.setattr(http_front.time, "monotonic", lambda: now[0])
    with caplog.at_level(logging.WARNING, logger="kvjax.cluster.http_front"):
        ignored.note(("a", "b"))
        ignored.note(())  # a request without any: nothing
        ignored.note(("c",))  # within the interval: counted, not logged
        now[0] += 10.0
        ignored.note(("d",))
    assert registry.get_sample_value("kvjax_test_ignored_request_fields_total") == 4
    assert [record.getMessage() for record in caplog.records] == [
        "The following fields were present in the request but ignored: ['a', 'b']",
        "The following fields were present in the request but ignored: ['d'] (1 more requests carried ignored "
        "fields since the last such line)"]


@pytest.mark.parametrize("limit", [0, -1, 1.5, True, "8"])
def test_a_body_limit_that_is_not_a_positive_integer_is_refused(limit):
    with pytest.raises(ValueError, match=r"max_body_bytes=.* must be a positive integer \(bytes\)"):
        limit_request_bodies(FastAPI(), limit)


def test_null_is_a_field_not_given_as_in_openai():
    """A client that serializes its unset fields as null got "n=None is not supported"."""
    fields = ["max_tokens", "stream", "stream_options", "temperature", "top_k", "seed", "user", "namespace",
              "remote_fetch", "n", "best_of", "echo", "top_p", "frequency_penalty", "presence_penalty", "logprobs",
              "suffix", "stop", "logit_bias", "repetition_penalty", "guided_json", "cache_salt",
              "use_beam_search"]  # fmt: skip
    assert parse({"model": "tiny", "prompt": "hi", **dict.fromkeys(fields)}) == CompletionRequest("tiny", "hi", None)
    streamed = parse({"model": "tiny", "prompt": "hi", "stream": True, "stream_options": {"include_usage": None}})
    assert streamed.stream and not streamed.include_usage


def test_the_neutral_values_of_what_kvjax_does_not_implement_are_accepted():
    body = {"model": "tiny", "prompt": "hi", "n": 1, "best_of": 1, "echo": False, "top_p": 1.0,
            "frequency_penalty": 0.0, "presence_penalty": 0, "suffix": "", "stop": [], "logit_bias": {}}  # fmt: skip
    assert parse(body) == CompletionRequest("tiny", "hi", None)


def test_stop_strings_come_as_a_string_or_a_list_as_in_openai():
    """A string was refused and a list accepted only empty: ``stop: "\\n\\n"`` could not be sent."""
    assert parse({"model": "tiny", "prompt": "x", "stop": "\n\n"}).stop == ("\n\n",)
    assert parse({"model": "tiny", "prompt": "x", "stop": ["a", "bc", "d", "e"]}).stop == ("a", "bc", "d", "e")
    assert parse({"model": "tiny", "prompt": "x", "stop": []}).stop == ()


def test_vllm_min_tokens_and_ignore_eos_are_read():
    request = parse({"model": "tiny", "prompt": "x", "max_tokens": 8, "min_tokens": 8, "ignore_eos": True})
    assert request.min_tokens == 8 and request == CompletionRequest("tiny", "x", None, 8, min_tokens=8)


def test_top_k_minus_one_means_no_limit_as_in_vllm():
    assert parse({"model": "tiny", "prompt": "x", "top_k": -1}).top_k == 0


@pytest.mark.parametrize("raw, message", [(b"{", "not valid JSON"), (b"[1]", "must be a JSON object, got list"),
                                          (b"\xff", "not valid JSON"),
                                          (b"[" * 100_000, "nests JSON too deeply"),
                                          # past Python's digit limit: a plain ValueError, a 500
                                          (b'{"model": "tiny", "max_tokens": ' + b"1" * 5000 + b"}",
                                           "not valid JSON: Exceeds the limit")])  # fmt: skip
def test_a_body_that_is_not_a_json_object_is_refused(raw, message):
    with pytest.raises(RequestError, match=message):
        parse_completion_request(raw)


def test_the_namespace_may_come_in_a_header_and_must_agree_with_the_body():
    assert parse({"model": "tiny", "prompt": "x"}, {NAMESPACE_HEADER: "tenant-b"}).namespace == "tenant-b"
    assert parse({"model": "tiny", "prompt": "x", "namespace": "a"}, {NAMESPACE_HEADER: "a"}).namespace == "a"
    with pytest.raises(RequestError, match="namespace='a' in the body but 'b' in the x-kvjax-namespace header"):
        parse({"model": "tiny", "prompt": "x", "namespace": "a"}, {NAMESPACE_HEADER: "b"})
    with pytest.raises(RequestError, match=r"namespace='\\ud800' must be valid Unicode text") as error:
        parse_completion_request(b'{"model": "tiny", "prompt": "x", "namespace": "\\ud800"}')  # blamed the prompt
    assert error.value.body()["error"]["param"] == "namespace"


def test_cache_salt_is_the_salt_of_the_namespace_the_requests_blocks_are_keyed_under():
    """vLLM's cache_salt was refused with a 400; vLLM clients that isolate users send it."""
    salted = parse({"model": "tiny", "prompt": "x", "namespace": "tenant-a", "cache_salt": "user-7"})
    assert salted.cache_salt == "user-7" and salted.namespace == "tenant-a"
    assert salted.block_namespace == Namespace("tenant-a", salt="user-7")
    assert parse({"model": "tiny", "prompt": "x", "cache_salt": "\u00e9"}).block_namespace == Namespace(salt="\u00e9")
    in_header = parse({"model": "tiny", "prompt": "x", "cache_salt": "s"}, {NAMESPACE_HEADER: "tenant-b"})
    assert in_header.block_namespace == Namespace("tenant-b", salt="s")
    for unsalted in ({}, {"cache_salt": None}):  # null: no salt, the blocks unsalted requests share
        assert parse({"model": "tiny", "prompt": "x", "namespace": "tenant-a", **unsalted}).block_namespace == \
            Namespace("tenant-a")  # fmt: skip
    assert parse({"model": "tiny", "prompt": "x"}).block_namespace == Namespace()
    digests = {parse({"model": "tiny", "prompt": "x", **extra}).block_namespace.digest()
               for extra in ({}, {"cache_salt": "s"}, {"cache_salt": "t"}, {"namespace": "s"})}  # fmt: skip
    assert len(digests) == 4


@pytest.mark.parametrize("raw, message", [
    ('""', r"^cache_salt='' must be a non-empty string$"),  # as vLLM refuses it
    ("7", r"^cache_salt=7 must be a non-empty string$"),
    ("true", r"^cache_salt=True must be a non-empty string$"),
    ('["s"]', r"^cache_salt=\['s'\] must be a non-empty string$"),
    ('{"s": 1}', r"^cache_salt=\{'s': 1\} must be a non-empty string$"),
    ('"\\ud800"', r"^cache_salt='\\ud800' must be valid Unicode text \(it holds a lone surrogate\)$"),
])  # fmt: skip
def test_a_cache_salt_that_is_no_text_is_a_400_naming_it(raw, message):
    with pytest.raises(RequestError, match=message) as error:
        parse_completion_request(f'{{"model": "tiny", "prompt": "x", "cache_salt": {raw}}}')
    assert (error.value.status, error.value.param) == (400, "cache_salt")


def test_a_namespace_header_sent_twice_is_refused():
    """The first of them was read: a gateway that appends the tenant it authenticated to a
    header the client sent let the client choose the tenant."""
    headers = Headers(raw=[(b"x-kvjax-namespace", b"victim"), (b"x-kvjax-namespace", b"tenant-a")])
    with pytest.raises(RequestError, match=r"the x-kvjax-namespace header comes 2 times \(\['victim', 'tenant-a'\]\)"):
        parse({"model": "tiny", "prompt": "x"}, headers)
    assert parse({"model": "tiny", "prompt": "x"}, Headers(raw=[(b"x-kvjax-namespace", b"a")])).namespace == "a"


def test_a_namespace_header_outside_ascii_is_refused_naming_the_body_field():
    header = "tenant-\u00e9".encode().decode("latin-1")  # UTF-8 bytes, as the HTTP server hands them over
    with pytest.raises(RequestError, match=r"the x-kvjax-namespace header holds non-ASCII bytes \('tenant-Ã©' read "
                       r"as Latin-1\); header values must be ASCII: send such a namespace in the body's namespace "
                       "field") as error:  # fmt: skip
        parse({"model": "tiny", "prompt": "x"}, {NAMESPACE_HEADER: header})
    assert error.value.status == 400 and error.value.param == "namespace"
    assert parse({"model": "tiny", "prompt": "x", "namespace": "tenant-\u00e9"}).namespace == "tenant-\u00e9"


def test_sse_frames():
    assert sse("[DONE]") == b"data: [DONE]\n\n"
    assert sse({"a": 1}) == b'data: {"a":1}\n\n'


UTF8_PIECES = st.sampled_from([b"a", b"\n", "é".encode(), "€".encode(), "😀".encode(), b"\x80", b"\xc3",
                                b"\xe2\x82", b"\xf0\x9f", b"\xf8", b"\xed\xa0", b"\xff"])  # fmt: skip


@settings(max_examples=400, deadline=None)
@given(st.lists(st.one_of(st.integers(0, 255).map(lambda b: bytes([b])), UTF8_PIECES), max_size=30))
def test_streamed_deltas_concatenate_to_the_final_text(pieces):
    byte_ids = list(b"".join(pieces))
    decode = ByteTokenizer().decode
    stream = TextStream(decode)
    deltas = [stream.push(token) for token in byte_ids]
    held = len(decode(byte_ids)) - len(stream.sent)
    deltas.append(stream.finish(decode(byte_ids)))
    assert "".join(deltas) == decode(byte_ids)
    assert held <= 1  # at most one character waits for the end


def test_streaming_waits_for_the_rest_of_a_character_only():
    stream = TextStream(ByteTokenizer().decode)
    euro = list("€".encode())
    assert [stream.push(t) for t in [ord("a"), *euro[:2]]] == ["a", "", ""]
    assert stream.push(euro[2]) == "€"
    assert [stream.push(t) for t in [0xF8, 0xF8, ord("b")]] == ["", "\ufffd", "\ufffdb"]  # invalid bytes do not stall


PIECES = ["Hel", "lo", " wor", "ld", "\n", "\n\n", "", "a"]  # token id -> its text, for a fake decoder


def piece_decode(ids) -> str:
    return "".join(PIECES[i] for i in ids)


def test_a_stream_holds_back_what_may_begin_a_stop_string_and_never_sends_what_is_cut():
    stream = TextStream(piece_decode, ("lo w",))
    # "l" might begin "lo w", then "lo" too; " wor" completes it, begun in an earlier delta
    assert [stream.push(t) for t in [0, 1, 2]] == ["He", "l", ""]
    assert stream.finish("Hel") == "" and stream.sent == "Hel"


def test_a_stream_sends_held_back_text_once_the_stop_string_does_not_follow():
    stream = TextStream(piece_decode, ("\n\n", "world!"))
    assert [stream.push(t) for t in [0, 1, 2, 3]] == ["Hel", "lo", " ", ""]  # "wor", then "world", wait
    assert stream.push(4) == "world"  # "world\n" is not "world!"; the "\n" may begin "\n\n"
    assert stream.push(7) == "\na"  # "\na" does not
    assert stream.finish("Hello world\na") == ""


def test_a_stop_string_spanning_several_tokens_cuts_the_stream_where_the_answer_ends():
    stream = TextStream(ByteTokenizer().decode, ("\u20ac\u20ac",))  # 6 byte tokens
    text = "a \u20ac b \u20ac\u20ac c"
    deltas = [stream.push(t) for t in text.encode()[: text.index("\u20ac\u20ac") + 6]]
    assert "".join(deltas) == "a \u20ac b " and deltas[-1] == ""
    assert stream.finish("a \u20ac b ") == ""


def reference_answer(decode, ids, stops, min_tokens):
    """The engine's rule by brute force: (answer, tokens generated, whether a stop string ended
    it) for a request whose tokens would be ``ids``: it ends at the first token whose text
    holds a stop string ending past the text of its first ``min_tokens - 1`` tokens, cut where
    the earliest such starts."""
    floor = len(decode(ids[: min_tokens - 1]).removesuffix("\ufffd")) if min_tokens > 1 else 0
    for count in range(max(min_tokens, 1), len(ids) + 1):
        text = decode(ids[:count])
        starts = [i for stop in stops for i in range(len(text)) if text.startswith(stop, i) and i + len(stop) > floor]
        if starts:
            return text[: min(starts)], count, True
    return decode(ids), len(ids), False


def check_stream(decode, ids, stops, min_tokens, *, prompt_cut=False):
    answer, count, stopped = reference_answer(decode, ids, stops, min_tokens)
    stream = TextStream(decode, tuple(stops), min_tokens)
    for token in ids[:count]:  # the engine generates no token after the one that ends the request
        stream.push(token)
        assert answer.startswith(stream.sent)  # no delta ever holds text the answer cuts away
    if prompt_cut and stopped:  # and it cut no earlier: the whole answer is out before the FinishEvent
        assert stream.sent == answer
    stream.finish(answer)
    assert stream.sent == answer


@settings(max_examples=500, deadline=None)
@given(st.lists(st.integers(0, len(PIECES) - 1), max_size=20),
       st.lists(st.text("lo \nwra", min_size=1, max_size=4), min_size=1, max_size=4), st.integers(0, 6))
def test_streamed_deltas_with_stop_strings_concatenate_to_the_cut_answer(ids, stops, min_tokens):
    check_stream(piece_decode, ids, stops, min(min_tokens, len(ids)), prompt_cut=True)


@settings(max_examples=400, deadline=None)
@given(st.lists(st.one_of(st.integers(0, 255).map(lambda b: bytes([b])), UTF8_PIECES), max_size=20),
       st.lists(st.sampled_from(["a", "\n", "\u00e9", "a\n", "\n\u00e9", "\u20aca", "\ufffd", "\ufffda", "\u00e9\u00e9"]),
                min_size=1, max_size=4), st.integers(0, 6))  # fmt: skip
def test_byte_streams_with_stop_strings_concatenate_to_the_cut_answer(pieces, stops, min_tokens):
    ids = list(b"".join(pieces))
    check_stream(ByteTokenizer().decode, ids, stops, min(min_tokens, len(ids)))


def test_a_wait_ends_when_its_client_leaves_and_runs_its_clean_up():
    """What the node and the router wrap a request's wait in: uvicorn never cancels a handler
    whose client left, so the ASGI disconnect message has to be watched for."""

    async def scenario(disconnect_first):
        left, cleaned_up = asyncio.Event(), []

        async def receive():
            await left.wait()
            return {"type": "http.disconnect"}

        async def work():
            try:
                await asyncio.sleep(0 if not disconnect_first else 3600)
                return "answer"
            finally:
                cleaned_up.append(True)

        if disconnect_first:
            left.set()
        try:
            return await unless_client_leaves(receive, work()), cleaned_up
        except ClientGone:
            return "gone", cleaned_up

    assert asyncio.run(scenario(False)) == ("answer", [True])
    assert asyncio.run(scenario(True)) == ("gone", [True])


@pytest.mark.parametrize("seed, engine_seed", [(3, 3), (-1, 2**32 - 1), (2**40 + 5, 5), (-(2**63), 0)])
def test_a_64_bit_seed_is_accepted_as_vllm_does_and_taken_modulo_2_32(seed, engine_seed):
    # a client drawing 64-bit seeds (vLLM takes any int64) got a 400
    assert parse_completion_request({"model": "tiny", "prompt": "x", "seed": seed}).seed == engine_seed
