"""Prompt canonicalization: each rule and its report, moved fields, idempotence, fingerprints."""

import dataclasses
import doctest
import importlib

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvjax.text.canonicalize import (
    COMMON_DYNAMIC_FIELDS,
    RULES,
    CanonicalizeConfig,
    Change,
    canonicalize,
    template_fingerprint,
)
from kvjax.text.tokenizer import ByteTokenizer

FIELDS = {
    "date_line": r"(?m)^Current date: [^\n]*$",
    "stamp": r"\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}Z",
    "request_id": r"req-\d+",
}
NO_RULES = {rule: False for rule in RULES}

# Text built from the characters and fragments the rules and fields react to, so random
# examples exercise every rule, field matches next to blanks, and look-alike trailers.
FRAGMENTS = st.sampled_from([
    "a", "b", " ", "  ", "\t", "\n", "\r", "\r\n", "\u00a0", "\u3000", "\u2014", "\u2212",
    "\u201c", "\u201d", "\u2018", "\u2019", "-", ":", "<", ">", "1", "2",
    "req-", "req-7", "2024-05-01T10:00:00Z", "Current date: ", "Current date: today\n",
    "\n\n[dynamic fields]\n", "<stamp>: ", "<request_id>: ", "<request_id_2>: ", "<date_line>",
])
TEXTS = st.one_of(st.lists(FRAGMENTS, max_size=40).map("".join), st.text(max_size=60))
CONFIGS = st.builds(
    lambda flags, with_fields: CanonicalizeConfig(
        **dict(zip(RULES, flags)), dynamic_fields=FIELDS if with_fields else ()
    ),
    st.lists(st.booleans(), min_size=len(RULES), max_size=len(RULES)),
    st.booleans(),
)


def only(rule, **overrides):
    """A config with exactly one rule switched on."""
    return CanonicalizeConfig(**{**NO_RULES, rule: True}, **overrides)


def test_docstring_examples_hold():
    # The package re-exports the function under the module's name: fetch the module itself.
    module = importlib.import_module("kvjax.text.canonicalize")
    assert doctest.testmod(module).failed == 0


@settings(max_examples=200, deadline=None)
@given(TEXTS, CONFIGS)
def test_canonicalize_is_idempotent(text, config):
    once = canonicalize(text, config)
    twice = canonicalize(once.text, config)
    assert twice.text == once.text
    assert twice.dynamic_start == once.dynamic_start
    assert twice.changes == []


@settings(max_examples=50, deadline=None)
@given(TEXTS)
def test_disabled_config_returns_the_input_unchanged(text):
    result = canonicalize(text, CanonicalizeConfig.disabled())
    assert (result.text, result.changes, result.dynamic_start) == (text, [], len(text))


@settings(max_examples=100, deadline=None)
@given(st.lists(FRAGMENTS, max_size=30).map("".join))
def test_moving_fields_keeps_every_value_and_only_the_values(text):
    config = CanonicalizeConfig(**NO_RULES, dynamic_fields=FIELDS)
    result = canonicalize(text, config)
    if "[dynamic fields]" in text:
        return  # a look-alike trailer in the input may be adopted; idempotence covers it
    # The body is the input with each moved value (found where its change says) replaced by
    # its placeholder, and nothing else changed.
    expected, copied = [], 0
    for change in result.changes:
        assert change.rule == "dynamic_fields" and change.before == change.before.strip()
        assert text[change.position : change.position + len(change.before)] == change.before
        expected += [text[copied : change.position], change.after]
        copied = change.position + len(change.before)
    expected = "".join(expected) + text[copied:]
    assert result.text[: result.dynamic_start] == (expected.rstrip("\n") if result.moved else text)


@settings(max_examples=300, deadline=None)
@given(st.lists(FRAGMENTS.filter(lambda f: "[dynamic fields]" not in f) | st.sampled_from(["<request_id>", "<stamp>"]),
                max_size=40).map("".join))  # fmt: skip
def test_a_prompt_is_recoverable_from_its_canonical_form(text):
    # a placeholder's text typed in the prompt read the same as a moved value's: two prompts
    # differing only in where the value stood canonicalized alike (and shared KV)
    config = CanonicalizeConfig(**NO_RULES, dynamic_fields=FIELDS)
    result = canonicalize(text, config)
    body, _, trailer = result.text.partition("\n\n[dynamic fields]\n")
    moved = [change for change in result.changes if change.rule == "dynamic_fields"]
    assert bool(trailer) == bool(moved)
    for change in moved:
        assert body.count(change.after) == 1, (change.after, body)  # each moved placeholder is unique
        body = body.replace(change.after, change.before)
    assert body == (text.rstrip("\n") if moved else text)  # the section follows the body's last line


def test_placeholder_text_in_a_prompt_is_numbered_past():
    config = CanonicalizeConfig(dynamic_fields={"order": r"ORD-\d+"})
    first = canonicalize("Cancel ORD-17, keep <order>.", config).text
    second = canonicalize("Cancel <order>, keep ORD-17.", config).text
    assert first == "Cancel <order_2>, keep <order>.\n\n[dynamic fields]\n<order_2>: ORD-17"
    assert second == "Cancel <order>, keep <order_2>.\n\n[dynamic fields]\n<order_2>: ORD-17"
    assert canonicalize(first, config).text == first and canonicalize(second, config).text == second


def test_a_carriage_return_around_a_field_stays_in_the_body():
    # Found by the property above: with the line-ending rule off, the "\r" of a CRLF line
    # was moved into the trailer as part of the date's value.
    config = CanonicalizeConfig(**NO_RULES, dynamic_fields=FIELDS)
    result = canonicalize("Current date: \r", config)
    [change] = result.changes
    assert change.before == "Current date:"
    assert result.text[: result.dynamic_start].endswith(" \r")


def test_prompts_differing_only_in_dynamic_fields_share_the_prefix_before_them():
    template = (
        "System: you are a support bot.\r\nCurrent date: {date}\r\n"
        "Request {rid} received {stamp}.\r\nUser: where is my order?\r\n"
    )
    config = CanonicalizeConfig(dynamic_fields=FIELDS)
    first = canonicalize(
        template.format(date="Monday", rid="req-1", stamp="2024-05-01T10:00:00Z"), config
    )
    second = canonicalize(
        template.format(date="Friday", rid="req-99", stamp="2025-12-31T23:59:59Z"), config
    )
    assert first.text != second.text
    assert first.dynamic_start == second.dynamic_start
    prefix = first.text[: first.dynamic_start]
    assert prefix == second.text[: second.dynamic_start]
    assert prefix == (
        "System: you are a support bot.\n<date_line>\n"
        "Request <request_id> received <stamp>.\nUser: where is my order?"
    )
    assert first.text[first.dynamic_start :] == (
        "\n\n[dynamic fields]\n<date_line>: Current date: Monday\n"
        "<request_id>: req-1\n<stamp>: 2024-05-01T10:00:00Z"
    )
    # Tokens of the shared part are identical, so a cached prefix covers all of it.
    tok = ByteTokenizer()
    a, b = tok.encode(first.text), tok.encode(second.text)
    shared = len(prefix.encode())
    assert (a[:shared] == b[:shared]).all() and a[shared] == b[shared]  # the "\n\n" after it


def rule_case(rule, text, expected, position, count, before, after):
    return pytest.param(rule, text, expected, Change(rule, position, count, before, after), id=rule)


@pytest.mark.parametrize(
    "rule, text, expected, change",
    [
        rule_case("line_endings", "a\r\nb\rc", "a\nb\nc", 1, 2, "a\r\nb\rc", "a\nb\rc"),
        rule_case(
            "unicode_spaces", "x\u00a0y\u3000z", "x y z", 1, 2, "x\u00a0y\u3000z", "x y\u3000z"
        ),
        rule_case("tabs", "k:\tv\t", "k: v ", 2, 2, "k:\tv\t", "k: v\t"),
        rule_case(
            "dashes", "1\u20132 \u2014 x\u2212y", "1-2 - x-y",
            1, 3, "1\u20132 \u2014 x\u2212y", "1-2 \u2014 x\u2212y",
        ),
        rule_case(
            "quotes", "\u201chi\u201d \u2018x\u2019", "\"hi\" 'x'",
            0, 4, "\u201chi\u201d \u2018x\u2019", "\"hi\u201d \u2018x\u2019",
        ),
        rule_case(
            "collapse_spaces", "    keep   one  two", "    keep one two",
            8, 2, "    keep   one  two", "    keep one  two",
        ),
        rule_case("trailing_spaces", "a \t\nb  ", "a\nb", 1, 2, "a \t\nb  ", "a\nb  "),
        rule_case(
            "blank_lines", "a\n\n\n\nb\n\n\nc\n\nd", "a\n\nb\n\nc\n\nd",
            1, 2, "a\n\n\n\nb\n\n\nc\n\nd", "a\n\nb\n\n\nc\n\nd",
        ),
    ],
)
def test_each_rule_changes_only_its_pattern_and_reports_it(rule, text, expected, change):
    result = canonicalize(text, only(rule))
    assert result.text == expected
    assert result.changes == [change]
    # Switched off, the same rule leaves the text alone.
    assert canonicalize(text, CanonicalizeConfig(**NO_RULES)).text == text


def test_a_change_snippet_shows_twelve_characters_either_side():
    text = "0123456789abcdef\u2014ghijklmnopqrstuvwxyz"
    (change,) = canonicalize(text, only("dashes")).changes
    assert change.before == "456789abcdef\u2014ghijklmnopqr"
    assert change.after == "456789abcdef-ghijklmnopqr"


def test_rules_run_in_order_and_each_reports_positions_in_the_text_it_saw():
    result = canonicalize("a\u00a0\u00a0b  \r\n", CanonicalizeConfig())
    assert result.text == "a b\n"
    assert [(c.rule, c.position, c.count) for c in result.changes] == [
        ("line_endings", 6, 1),
        ("unicode_spaces", 1, 2),
        ("collapse_spaces", 1, 2),  # "a  b  \n": both runs follow a letter
        ("trailing_spaces", 3, 1),  # "a b \n"
    ]


def test_default_config_keeps_tabs_and_indentation():
    code = "def f():\n\treturn  1\n    x = 2\n"
    assert canonicalize(code).text == "def f():\n\treturn 1\n    x = 2\n"


def test_repeated_fields_are_numbered_and_surrounding_blanks_stay_in_place():
    config = CanonicalizeConfig(**NO_RULES, dynamic_fields={"request_id": r"\s*req-\d+\s*"})
    result = canonicalize("ids: req-1 and\n req-22\nend", config)
    assert result.text == (
        "ids: <request_id> and\n <request_id_2>\nend\n\n[dynamic fields]\n"
        "<request_id>: req-1\n<request_id_2>: req-22"
    )
    assert result.moved == [("<request_id>", "req-1"), ("<request_id_2>", "req-22")]
    assert [c.position for c in result.changes] == [5, 16]


def test_multiline_values_continue_indented_and_survive_a_second_pass():
    config = CanonicalizeConfig(dynamic_fields={"block": r"(?s)BEGIN.*?END"})
    result = canonicalize("head\nBEGIN x\n\n  y END\ntail", config)
    assert result.text == "head\n<block>\ntail\n\n[dynamic fields]\n<block>: BEGIN x\n\n    y END"
    assert canonicalize(result.text, config).text == result.text


def test_the_leftmost_match_wins_and_ties_go_to_the_earlier_field():
    fields = [("long", r"ab+"), ("short", r"a"), ("b", r"b")]
    config = CanonicalizeConfig(**NO_RULES, dynamic_fields=fields)
    assert canonicalize("bab", config).moved == [("<b>", "b"), ("<long>", "ab")]


def test_new_fields_are_appended_after_an_existing_section_with_numbers_continued():
    config = CanonicalizeConfig(dynamic_fields=FIELDS)
    first = canonicalize("q req-1", config)
    second = canonicalize(first.text.replace("q ", "q req-2 "), config)
    assert second.text == (
        "q <request_id_2> <request_id>\n\n[dynamic fields]\n"
        "<request_id>: req-1\n<request_id_2>: req-2"
    )


@pytest.mark.parametrize(
    "text",
    [
        "x\n\n[dynamic fields]\nnot an entry",
        "x\n\n[dynamic fields]\n<unknown>: 1",
        "x\n\n[dynamic fields]\n<request_id>: req-1",  # placeholder not in the body
    ],
)
def test_a_look_alike_section_that_does_not_parse_is_ordinary_text(text):
    config = CanonicalizeConfig(dynamic_fields={"request_id": r"req-\d+"})
    result = canonicalize(text, config)
    [moved] = [change for change in result.changes if change.rule == "dynamic_fields"] or [None]
    assert moved is None or moved.after not in text  # numbered past the look-alike's placeholder
    assert result.text.startswith(text if moved is None else text.replace("req-1", moved.after))
    assert canonicalize(result.text, config).text == result.text


def test_common_dynamic_fields_move_dates_timestamps_and_uuids():
    config = CanonicalizeConfig(dynamic_fields=COMMON_DYNAMIC_FIELDS)
    text = (
        "Today's date: 1 May\n"
        "id 123e4567-e89b-12d3-a456-426614174000 at 2024-05-01 10:00:00+02:00."
    )
    assert canonicalize(text, config).moved == [
        ("<current_date>", "Today's date: 1 May"),
        ("<uuid>", "123e4567-e89b-12d3-a456-426614174000"),
        ("<iso_timestamp>", "2024-05-01 10:00:00+02:00"),
    ]


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"dynamic_fields": {"stamp": "(x"}}, r"dynamic_fields\['stamp'\]: invalid regex '\(x'"),
        ({"dynamic_fields": {"maybe": r"\d*"}}, r"\['maybe'\]: regex .* matches the empty string"),
        ({"dynamic_fields": {"2fast": "x"}}, r"name '2fast' must be an identifier"),
        ({"dynamic_fields": {"field_2": "x"}}, r"name 'field_2' must be an identifier .*_<digits>"),
        ({"dynamic_fields": [("a", "x"), ("a", "y")]}, r"names \['a'\] appear more than once"),
        ({"dynamic_fields": [("a", "x", "y")]}, r"entry \('a', 'x', 'y'\) must be a \(name, regex"),
        ({"dynamic_fields": 5}, r"dynamic_fields=5 must be a mapping or a sequence"),
        ({"dynamic_fields": [{"name": "a", "pattern": "x"}]}, r"entry \{'name': 'a', 'pattern': 'x'\} must be a table "
                                                             r"of exactly name and regex"),
        ({"dynamic_fields": ["ax"]}, r"entry 'ax' must be a \(name, regex\) pair, not one string"),
        ({"dynamic_fields": "ax"}, r"entry 'ax' must be a \(name, regex\) pair, not one string"),
        ({"tabs": "yes"}, r"tabs='yes' must be a bool"),
        ({"dynamic_marker": ""}, r"dynamic_marker='' must be one non-empty line"),
        ({"dynamic_marker": "a\nb"}, r"dynamic_marker='a\\nb' must be one non-empty line"),
        ({"dynamic_marker": "[dynamic \u2014 fields]"}, r"would be changed by the dashes rule"),
    ],
)
def test_bad_configs_name_the_field(kwargs, message):
    with pytest.raises(ValueError, match=message):
        CanonicalizeConfig(**kwargs)


def test_from_dict_builds_a_config_and_rejects_unknown_keys():
    config = CanonicalizeConfig.from_dict({"tabs": True, "dynamic_fields": {"r": "req-1"}})
    assert config == CanonicalizeConfig(tabs=True, dynamic_fields=(("r", "req-1"),))
    with pytest.raises(ValueError, match=r"unknown canonicalize option\(s\) \['tab'\]; expected"):
        CanonicalizeConfig.from_dict({"tab": True})
    # TOML's [[dynamic_fields]] tables: tuple() of one gave its keys, a field "name" matching "regex"
    tables = CanonicalizeConfig.from_dict({"dynamic_fields": [{"name": "order", "regex": "ORD-[0-9]+"}]})
    assert tables.dynamic_fields == (("order", "ORD-[0-9]+"),)


def test_non_text_is_a_type_error():
    with pytest.raises(TypeError, match="text must be a str, got bytes"):
        canonicalize(b"abc")


def test_fingerprint_ignores_digits_and_dynamic_fields_but_not_the_template():
    config = CanonicalizeConfig(dynamic_fields=COMMON_DYNAMIC_FIELDS)
    a = "Order 1234 for 123e4567-e89b-12d3-a456-426614174000.\r\nCurrent date: Monday"
    b = "Order 77 for 00000000-aaaa-bbbb-cccc-000000000000.\nCurrent date: Friday, 1 May"
    assert template_fingerprint(a, config) == template_fingerprint(b, config)
    assert template_fingerprint(a) != template_fingerprint(b)  # without fields, the uuid differs
    refund = a.replace("Order", "Refund")
    assert template_fingerprint(a, config) != template_fingerprint(refund, config)
    # The fingerprint applies the rules even when canonicalization of tokens is off.
    disabled = dataclasses.replace(config, enabled=False)
    assert template_fingerprint(a, disabled) == template_fingerprint(a, config)
    assert len(template_fingerprint(a)) == 16 and int(template_fingerprint(a), 16) >= 0


def test_fingerprint_over_the_first_characters_ignores_what_follows():
    system = "You are a careful assistant. Answer in 3 sentences.\n"
    one = template_fingerprint(system + "Q: why is the sky blue?", max_chars=len(system))
    two = template_fingerprint(system + "Q: what is a prefix cache?", max_chars=len(system))
    assert one == two
    assert template_fingerprint(system + "Q: why is the sky blue?") != template_fingerprint(system)
    with pytest.raises(ValueError, match=r"max_chars=-1 must be a non-negative integer or None"):
        template_fingerprint(system, max_chars=-1)
