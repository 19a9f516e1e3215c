"""Tokenizers: byte-level round trip, special ids, the adapter's id checks and its type errors."""

import doctest
import re

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import kvjax.text.tokenizer
from kvjax.text.tokenizer import (
    BYTE_VOCAB,
    ByteTokenizer,
    Tokenizer,
    TokenizerAdapter,
    as_tokenizer,
)
from kvjax.text.tokens import token_bytes, validate_tokens


def test_docstring_examples_hold():
    assert doctest.testmod(kvjax.text.tokenizer).failed == 0


@settings(max_examples=100, deadline=None)
@given(st.text())
def test_byte_tokenizer_round_trips_any_text(text):
    tok = ByteTokenizer()
    ids = tok.encode(text)
    assert ids.dtype == np.int32
    assert ids.tolist() == list(text.encode("utf-8"))
    assert tok.decode(ids) == text


def test_bos_and_eos_wrap_the_bytes_and_decode_drops_them_unless_asked():
    tok = ByteTokenizer(special_tokens=("<pad>", "<bos>", "<eos>"), add_bos=True, add_eos=True)
    assert tok.vocab_size == BYTE_VOCAB + 3
    assert (tok.bos_id, tok.eos_id, tok.token_id("<pad>")) == (257, 258, 256)
    ids = tok.encode("ab")
    assert ids.tolist() == [257, 97, 98, 258]
    assert tok.decode(ids) == "ab"
    assert tok.decode([256, 97, 258], skip_special_tokens=False) == "<pad>a<eos>"


def test_decode_replaces_broken_utf8_and_does_not_glue_bytes_across_a_special_id():
    tok = ByteTokenizer()
    e_acute = list("é".encode())  # two bytes
    assert tok.decode(e_acute[:1]) == "\ufffd"
    # A special id between the two bytes of one character: each half is its own fragment.
    assert tok.decode([e_acute[0], tok.eos_id, e_acute[1]]) == "\ufffd\ufffd"


def test_lone_surrogates_encode_and_decode_as_replacement_characters():
    tok = ByteTokenizer()
    ids = tok.encode("a\ud800b")
    assert len(ids) == 5
    assert tok.decode(ids) == "a\ufffd\ufffd\ufffdb"


def test_no_special_tokens_means_no_bos_or_eos():
    tok = ByteTokenizer(special_tokens=())
    assert (tok.vocab_size, tok.bos_id, tok.eos_id) == (256, None, None)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"special_tokens": ("<a>", "<a>")}, "duplicate"),
        ({"special_tokens": ("<a>", "")}, "non-empty names"),
        ({"special_tokens": "<bos>"}, "non-empty names"),
        ({"special_tokens": ("<eos>",), "add_bos": True}, r"add_bos=True needs '<bos>'"),
        ({"special_tokens": ("<bos>",), "add_eos": True}, r"add_eos=True needs '<eos>'"),
    ],
)
def test_bad_byte_tokenizer_configs_are_rejected(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ByteTokenizer(**kwargs)


def test_byte_tokenizer_errors_name_the_bad_value():
    tok = ByteTokenizer()
    with pytest.raises(ValueError, match=r"token id 258 at index 1 is out of range.*vocab_size=258"):
        tok.decode([97, 258])
    with pytest.raises(ValueError, match=r"token id -1 at index 0"):
        tok.decode([-1])
    with pytest.raises(ValueError, match=r"unknown special token '<sep>'; expected one of"):
        tok.token_id("<sep>")
    with pytest.raises(TypeError, match="text must be a str, got bytes"):
        tok.encode(b"abc")


def test_a_plain_callable_encodes_with_checked_ids_and_cannot_decode():
    def word_lengths(text):
        return [len(word) for word in text.split()]

    tok = as_tokenizer(word_lengths, vocab_size=10)
    assert isinstance(tok, Tokenizer)
    assert tok.vocab_size == 10
    encoded = tok.encode("a bb ccc")
    assert encoded.dtype == np.dtype("<i4") and encoded.tolist() == [1, 2, 3]
    with pytest.raises(ValueError, match=r"word_lengths encode\(\) output: token id 12 at index 1"):
        tok.encode("a twelve-chars b")
    with pytest.raises(TypeError, match="word_lengths was given no decode function"):
        tok.decode([1])


class _CharTokenizer:
    """A foreign tokenizer: one id per character, states its vocabulary."""

    vocab_size = 128

    def encode(self, text):
        return [ord(c) for c in text]

    def decode(self, ids):
        return "".join(chr(i) for i in ids)


def test_an_object_with_encode_and_decode_is_adapted_with_its_vocab_size():
    tok = as_tokenizer(_CharTokenizer())
    assert isinstance(tok, TokenizerAdapter) and tok.vocab_size == 128
    assert tok.decode(tok.encode("hi!")) == "hi!"
    with pytest.raises(ValueError, match=r"_CharTokenizer encode\(\) output: token id 233 at index 2"):
        tok.encode("caé")
    with pytest.raises(ValueError, match=r"token id 128 at index 0"):
        tok.decode([128])


def test_an_explicit_vocab_size_overrides_the_stated_one():
    tok = as_tokenizer(_CharTokenizer(), vocab_size=100)
    with pytest.raises(ValueError, match=r"token id 104 at index 0 .*vocab_size=100"):
        tok.encode("hi")
    narrowed = as_tokenizer(ByteTokenizer(), vocab_size=200)
    with pytest.raises(ValueError, match=r"token id 228 at index 1 .*vocab_size=200"):
        narrowed.encode("a\u4e2d")  # UTF-8 of U+4E2D starts with byte 0xE4 = 228
    assert narrowed.decode(narrowed.encode("ok")) == "ok"


def test_byte_tokenizer_is_returned_as_is():
    tok = ByteTokenizer()
    assert as_tokenizer(tok) is tok
    assert as_tokenizer(tok, vocab_size=tok.vocab_size) is tok


@pytest.mark.parametrize("bad", [None, "not a tokenizer", b"bytes", 42, object()])
def test_things_that_are_not_tokenizers_get_a_type_error(bad):
    with pytest.raises(TypeError, match=r"must be a callable \(str -> sequence of ints\) or an object"):
        as_tokenizer(bad)


@pytest.mark.parametrize("vocab_size", [0, -5, 2.5, True, 2**31 + 1, 2**32])
def test_bad_vocab_sizes_are_rejected(vocab_size):
    # past 2**31 an id that passed the range check wrapped to a negative int32
    with pytest.raises(ValueError, match=r"vocab_size=.* must be a positive integer <= 2\*\*31 \(ids are int32\) or None"):
        as_tokenizer(lambda text: [0], vocab_size=vocab_size)


@pytest.mark.parametrize("tokens", [np.array([-1], np.int32), [2**31], np.array([2**31 + 7], np.int64)])
def test_ids_past_int32_are_refused_whatever_vocab_size_claims(tokens):
    for check in (validate_tokens, token_bytes):
        with pytest.raises(ValueError, match=r"is out of range; expected 0 <= id < 2147483648 \(vocab_size=4294967296\)"):
            check(tokens, 2**32)


@pytest.mark.parametrize("tokens, message", [
    ([1, 2**63], "token id 9223372036854775808 at index 1 is out of range"),  # numpy made the list float64
    ([1, -(2**70)], "token id -1180591620717411303424 at index 1 is out of range"),
    ([1, 2.5], "token id 2.5 at index 1 is not an integer"),
])  # fmt: skip
def test_a_bad_id_is_named_as_it_was_sent(tokens, message):
    for check in (validate_tokens, token_bytes):
        with pytest.raises(ValueError, match=re.escape(message)):
            check(tokens, None)
    assert validate_tokens([1.0, 2.0], None).tolist() == [1, 2]


@pytest.mark.parametrize("flag", ["add_bos", "add_eos"])
def test_a_tokenizer_flag_must_be_a_bool(flag):
    with pytest.raises(ValueError, match=rf"{flag}='no' must be a bool"):  # "no" is truthy
        ByteTokenizer(**{flag: "no"})


def test_non_integer_or_nested_encode_output_is_rejected():
    with pytest.raises(ValueError, match=r"encode\(\) output: tokens must be 1-D"):
        as_tokenizer(lambda text: [[1, 2]]).encode("x")
    with pytest.raises(ValueError, match=r"encode\(\) output: .*integ"):
        as_tokenizer(lambda text: [0.5]).encode("x")
    with pytest.raises(TypeError, match="decode=3 must be callable"):
        as_tokenizer(lambda text: [0], decode=3)
