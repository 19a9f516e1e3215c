"""Prompt canonicalization: equivalent prompts become identical text before tokenizing.

A cached prefix is only reused when the tokens match exactly, so two renderings of the same
template that differ in a line ending, a non-breaking space, a curly quote or a timestamp near
the top share nothing after the first difference. ``canonicalize`` removes those differences:

* whitespace and separator rules (each switchable in ``CanonicalizeConfig``), applied in this
  order: ``line_endings`` (CRLF, CR -> LF), ``unicode_spaces`` (NBSP and the other Unicode space
  separators -> " "), ``tabs`` (-> " "), ``dashes`` (Unicode hyphens, dashes, minus -> "-"),
  ``quotes`` (curly quotes -> ASCII), ``collapse_spaces`` (runs of spaces inside a line -> one;
  leading indentation is kept), ``trailing_spaces`` (spaces and tabs at line ends removed),
  ``blank_lines`` (runs of blank lines -> one);
* dynamic fields: text matched by declared named regexes (timestamps, request ids, "Current
  date: ..." lines) is replaced by a fixed placeholder ``<name>`` (``<name_2>``, ... for later
  matches) and its content appended at the END under a marker line::

      <body with placeholders>

      [dynamic fields]
      <name>: <matched text>

  so everything before the marker is identical across requests and the model still sees the
  values. Whitespace around a match stays in place (only the match's stripped core moves), so
  moving a field never joins or splits lines. Multi-line values continue on lines indented by
  two spaces.

Invariants (tested): ``canonicalize(canonicalize(x).text).text == canonicalize(x).text``;
``enabled=False`` returns the input unchanged with no changes. Idempotence assumes no declared
regex matches a placeholder (``<name>``) or spans one.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import re
from collections.abc import Callable, Mapping

__all__ = [
    "COMMON_DYNAMIC_FIELDS",
    "RULES",
    "CanonicalResult",
    "CanonicalizeConfig",
    "Change",
    "canonicalize",
    "template_fingerprint",
]

RULES = (
    "line_endings",
    "unicode_spaces",
    "tabs",
    "dashes",
    "quotes",
    "collapse_spaces",
    "trailing_spaces",
    "blank_lines",
)
"""Whitespace and separator rules in the order they run; each is a ``CanonicalizeConfig`` flag."""

DYNAMIC_RULE = "dynamic_fields"
"""``Change.rule`` of a moved dynamic field."""

COMMON_DYNAMIC_FIELDS: Mapping[str, str] = {
    "current_date": r"(?m)^(?:Current|Today's) date: [^\n]*$",
    "iso_timestamp": (
        r"\b\d{4}-\d{2}-\d{2}[T ]\d{2}:\d{2}(?::\d{2}(?:\.\d+)?)?(?:Z|[+-]\d{2}:?\d{2})?\b"
    ),
    "uuid": r"\b[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}\b",
}
"""Ready-made dynamic fields; pass ``dynamic_fields=COMMON_DYNAMIC_FIELDS`` to use them."""


@dataclasses.dataclass(frozen=True, slots=True)
class CanonicalizeConfig:
    """Which rules run. Defaults change nothing a reader would call meaningful.

    ``tabs`` is off by default: tab-indented code and TSV data change meaning when tabs become
    single spaces. ``collapse_spaces`` never touches leading indentation for the same reason.
    ``dynamic_fields`` is ``(name, regex)`` pairs (a mapping is accepted); earlier fields win
    when two match at the same position. Names are identifiers not ending in ``_<digits>``
    (those suffixes number repeated placeholders). ``dynamic_marker`` is the line that opens
    the moved-fields section.
    """

    enabled: bool = True
    line_endings: bool = True
    unicode_spaces: bool = True
    tabs: bool = False
    dashes: bool = True
    quotes: bool = True
    collapse_spaces: bool = True
    trailing_spaces: bool = True
    blank_lines: bool = True
    dynamic_fields: tuple[tuple[str, str], ...] = ()
    dynamic_marker: str = "[dynamic fields]"

    def __post_init__(self) -> None:
        for flag in ("enabled", *RULES):
            if not isinstance(getattr(self, flag), bool):
                raise ValueError(f"{flag}={getattr(self, flag)!r} must be a bool")
        object.__setattr__(self, "dynamic_fields", _field_pairs(self.dynamic_fields))
        _validate_dynamic_fields(self.dynamic_fields)
        _validate_marker(self)

    @classmethod
    def from_dict(cls, values: Mapping[str, object]) -> CanonicalizeConfig:
        """Build from a plain mapping (e.g. a parsed config file); unknown keys are an error."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"unknown canonicalize option(s) {unknown}; expected {sorted(known)}")
        return cls(**values)

    @classmethod
    def disabled(cls) -> CanonicalizeConfig:
        """Tokens are computed from the prompt exactly as given."""
        return cls(enabled=False)


@dataclasses.dataclass(frozen=True, slots=True)
class Change:
    """What one rule changed: ``count`` occurrences, the first at ``position``.

    ``position`` is a character offset into the text as that rule saw it (rules run in
    sequence). ``before``/``after`` are a short snippet around the first occurrence. For a
    moved dynamic field (``rule == "dynamic_fields"``), ``before`` is the moved value and
    ``after`` its placeholder.
    """

    rule: str
    position: int
    count: int
    before: str
    after: str


@dataclasses.dataclass(frozen=True, slots=True)
class CanonicalResult:
    """Canonical ``text``, the ``changes`` made, and where the moved-fields section starts.

    ``text[:dynamic_start]`` is the part shared across requests of one template;
    ``dynamic_start == len(text)`` when nothing was moved.
    """

    text: str
    changes: list[Change]
    dynamic_start: int

    @property
    def moved(self) -> list[tuple[str, str]]:
        """``(placeholder, value)`` of every dynamic field this call moved, in text order."""
        return [(c.after, c.before) for c in self.changes if c.rule == DYNAMIC_RULE]


def canonicalize(text: str, config: CanonicalizeConfig | None = None) -> CanonicalResult:
    """Canonical form of ``text`` under ``config`` (default ``CanonicalizeConfig()``).

    >>> cfg = CanonicalizeConfig(dynamic_fields={"request_id": r"req-\\d+"})
    >>> result = canonicalize("Hello\\u00a0 there\\r\\nid: req-42\\r\\n", cfg)
    >>> print(result.text)
    Hello there
    id: <request_id>
    <BLANKLINE>
    [dynamic fields]
    <request_id>: req-42
    >>> [c.rule for c in result.changes]
    ['line_endings', 'unicode_spaces', 'collapse_spaces', 'dynamic_fields']
    """
    if not isinstance(text, str):
        raise TypeError(f"text must be a str, got {type(text).__name__}")
    config = CanonicalizeConfig() if config is None else config
    if not config.enabled:
        return CanonicalResult(text, [], len(text))
    changes: list[Change] = []
    for name, pattern, replacement in _compiled_rules(config):
        text = _apply_rule(name, pattern, replacement, text, changes)
    if not config.dynamic_fields:
        return CanonicalResult(text, changes, len(text))
    body, entries = _split_trailer(text, config)
    body = _move_dynamic_fields(body, config, entries, changes)
    if not entries:
        return CanonicalResult(body, changes, len(body))
    body = body.rstrip("\n")
    return CanonicalResult(body + _render_trailer(config, entries), changes, len(body))


def template_fingerprint(
    text: str, config: CanonicalizeConfig | None = None, *, max_chars: int | None = None
) -> str:
    """16-hex-digit stable hash of the template behind ``text``.

    The text is canonicalized with ``config``'s rules (even when ``config.enabled`` is False:
    the fingerprint describes the template, not the tokens sent), the moved-fields section is
    dropped (dynamic fields leave only their placeholders) and every run of digits becomes
    ``0``. Prompts rendered from one template with different numbers, dates or declared fields
    share a fingerprint, so a cache miss can be told apart: same fingerprint as a cached
    prompt means the template's variable parts broke the prefix, a new fingerprint means a
    template never seen. ``max_chars`` hashes only the first characters of the masked text
    (the system prompt and instructions, without the user's question).

    >>> template_fingerprint("Order 1234 at 10:15") == template_fingerprint("Order 7 at 9:05")
    True
    """
    if max_chars is not None and (not _is_int(max_chars) or max_chars < 0):
        raise ValueError(f"{max_chars=} must be a non-negative integer or None")
    config = CanonicalizeConfig() if config is None else config
    result = canonicalize(text, dataclasses.replace(config, enabled=True))
    masked = _DIGIT_RUN.sub("0", result.text[: result.dynamic_start])
    if max_chars is not None:
        masked = masked[:max_chars]
    encoded = masked.encode("utf-8", "surrogatepass")
    return hashlib.blake2b(encoded, digest_size=8, person=b"kvjax-template").hexdigest()


# -- whitespace and separator rules -------------------------------------------------------

_SINGLE_QUOTES = "\u2018\u2019\u201a\u201b"
_DIGIT_RUN = re.compile(r"\d+")

_RULE_PATTERNS: dict[str, tuple[str, str | Callable[[re.Match[str]], str]]] = {
    "line_endings": (r"\r\n?", "\n"),
    "unicode_spaces": ("[\u00a0\u1680\u2000-\u200a\u202f\u205f\u3000]", " "),
    "tabs": ("\t", " "),
    "dashes": ("[\u2010-\u2015\u2212]", "-"),
    "quotes": ("[\u2018-\u201f]", lambda m: "'" if m.group() in _SINGLE_QUOTES else '"'),
    # A run preceded by a non-blank character is inside a line; indentation is left alone.
    "collapse_spaces": (r"(?<=[^ \t\n]) {2,}", " "),
    "trailing_spaces": (r"[ \t]+(?=\n|\Z)", ""),
    "blank_lines": (r"\n{3,}", "\n\n"),
}
_SNIPPET_CONTEXT = 12  # characters of context on each side of a reported change


@functools.lru_cache(maxsize=64)
def _compiled_rules(config: CanonicalizeConfig) -> list[tuple[str, re.Pattern[str], object]]:
    return [
        (name, re.compile(_RULE_PATTERNS[name][0]), _RULE_PATTERNS[name][1])
        for name in RULES
        if getattr(config, name)
    ]


def _apply_rule(name, pattern, replacement, text: str, changes: list[Change]) -> str:
    first = pattern.search(text)
    if first is None:
        return text
    new_text, count = pattern.subn(replacement, text)
    new = replacement(first) if callable(replacement) else first.expand(replacement)
    left = text[max(0, first.start() - _SNIPPET_CONTEXT) : first.start()]
    right = text[first.end() : first.end() + _SNIPPET_CONTEXT]
    before, after = left + first.group() + right, left + new + right
    changes.append(Change(name, first.start(), count, before, after))
    return new_text


# -- dynamic fields -----------------------------------------------------------------------

_FIELD_NAME = re.compile(r"[A-Za-z][A-Za-z0-9_]*")
_NUMBERED = re.compile(r".*_\d+")
_ENTRY = re.compile(r"<([A-Za-z][A-Za-z0-9_]*?)(?:_([1-9]\d*))?>: (.*)")
_CONTINUATION = "  "  # indent of a moved value's second and later lines


@functools.lru_cache(maxsize=64)
def _compiled_fields(fields: tuple[tuple[str, str], ...]) -> list[tuple[str, re.Pattern[str]]]:
    return [(name, re.compile(regex)) for name, regex in fields]


@functools.lru_cache(maxsize=64)
def _placeholders(names: tuple[str, ...]) -> re.Pattern[str]:
    """``<name>`` or ``<name_N>`` of the declared names only (not every tag of an HTML prompt)."""
    alternatives = "|".join(re.escape(name) for name in sorted(names, key=len, reverse=True))
    return re.compile(rf"<({alternatives})(?:_([1-9]\d*))?>")


def _move_dynamic_fields(
    body: str, config: CanonicalizeConfig, entries: list[tuple[str, str]], changes: list[Change]
) -> str:
    """Replace each match's core with a placeholder, appending ``(placeholder, value)``."""
    fields = _compiled_fields(config.dynamic_fields)
    seen = {name: 0 for name, _ in fields}
    for placeholder, _ in entries:
        name, number = _parse_placeholder(placeholder)
        seen[name] = max(seen[name], number)
    # A placeholder's text already in the prompt (typed by its author, not moved here) is
    # numbered past: a moved value's placeholder must not read the same as text that stays,
    # or two prompts differing only in where the value was would canonicalize alike.
    for found in _placeholders(tuple(seen)).finditer(body) if seen else ():
        if found.group(1) in seen:
            seen[found.group(1)] = max(seen[found.group(1)], int(found.group(2) or 1))
    pieces, copied = [], 0
    for name, match in _leftmost_matches(fields, body):
        # Any whitespace around a match is layout, not value: a "\r" left by a CRLF line (with
        # the line-ending rule off) must not be moved into the trailer with the value.
        leading = len(match.group()) - len(match.group().lstrip())
        core = match.group().strip()
        if not core:  # a blank match carries no value; leave it
            continue
        seen[name] += 1
        placeholder = f"<{name}>" if seen[name] == 1 else f"<{name}_{seen[name]}>"
        core_start = match.start() + leading
        pieces += [body[copied:core_start], placeholder]
        copied = core_start + len(core)
        entries.append((placeholder, core))
        changes.append(Change(DYNAMIC_RULE, core_start, 1, core, placeholder))
    return "".join(pieces) + body[copied:]


def _leftmost_matches(fields, text: str):
    """Non-overlapping matches of all fields, left to right; ties go to the earlier field.

    Each field's next match is cached and searched again only once the scan passes its
    start, so a field without matches costs one scan of the text, not one per match.
    """
    upcoming = [pattern.search(text) for _, pattern in fields]
    position = 0
    while True:
        live = [i for i, match in enumerate(upcoming) if match is not None]
        if not live:
            return
        chosen = min(live, key=lambda i: (upcoming[i].start(), i))
        match = upcoming[chosen]
        yield fields[chosen][0], match
        position = max(match.end(), match.start() + 1)  # an empty match still advances
        for i in live:
            if upcoming[i].start() < position:
                upcoming[i] = fields[i][1].search(text, position) if position <= len(text) else None


def _render_trailer(config: CanonicalizeConfig, entries: list[tuple[str, str]]) -> str:
    lines = ["", "", config.dynamic_marker]
    for placeholder, value in entries:
        first, *rest = value.split("\n")
        lines.append(f"{placeholder}: {first}")
        lines += [_CONTINUATION + line if line else "" for line in rest]
    return "\n".join(lines)


def _split_trailer(text: str, config: CanonicalizeConfig) -> tuple[str, list[tuple[str, str]]]:
    """Split off a moved-fields section written by an earlier call, if ``text`` ends in one.

    Anything that does not parse exactly (unknown field, a placeholder missing from the body,
    a stray line) is ordinary prompt text, and the whole text is returned as the body.
    """
    separator = "\n\n" + config.dynamic_marker + "\n"
    start = text.rfind(separator)
    if start < 0:
        return text, []
    body, names = text[:start], {name for name, _ in config.dynamic_fields}
    in_body = {found.group() for found in _placeholders(tuple(sorted(names))).finditer(body)} if names else set()
    # one pass for every entry: a search of the body per entry was quadratic
    entries: list[tuple[str, str]] = []
    listed: set[str] = set()
    for line in text[start + len(separator) :].split("\n"):
        entry = _ENTRY.fullmatch(line)
        if entry is not None and entry.group(1) in names:
            placeholder = line[: line.index(">") + 1]
            if placeholder not in in_body or placeholder in listed:
                return text, []
            listed.add(placeholder)
            entries.append((placeholder, entry.group(3)))
        elif entries and (not line or line.startswith(_CONTINUATION)):
            placeholder, value = entries[-1]
            entries[-1] = (placeholder, value + "\n" + line[len(_CONTINUATION) :])
        else:
            return text, []
    return body, entries


def _parse_placeholder(placeholder: str) -> tuple[str, int]:
    entry = _ENTRY.fullmatch(placeholder + ": ")
    if entry is None:
        raise RuntimeError(f"placeholder {placeholder!r} was accepted but does not parse")
    return entry.group(1), int(entry.group(2) or 1)


def _field_pairs(fields: object) -> tuple[tuple[object, ...], ...]:
    """``dynamic_fields`` as (name, regex) pairs: from a mapping, a sequence of pairs, or a
    sequence of ``{"name": ..., "regex": ...}`` tables (TOML's ``[[dynamic_fields]]``)."""
    if isinstance(fields, Mapping):
        fields = fields.items()
    if isinstance(fields, (str, bytes)):
        fields = [fields]  # refused below, not read as one pair per character
    try:
        return tuple(_field_pair(pair) for pair in fields)
    except TypeError:
        raise ValueError(
            f"dynamic_fields={fields!r} must be a mapping or a sequence of (name, regex) pairs"
        ) from None


def _field_pair(pair: object) -> tuple[object, ...]:
    if isinstance(pair, Mapping):  # tuple() of a table would be its keys: ("name", "regex")
        if set(pair) != {"name", "regex"}:
            raise ValueError(f"dynamic_fields entry {dict(pair)!r} must be a table of exactly name and regex")
        return (pair["name"], pair["regex"])
    if isinstance(pair, (str, bytes)):
        raise ValueError(f"dynamic_fields entry {pair!r} must be a (name, regex) pair, not one string")
    return tuple(pair)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _validate_dynamic_fields(fields: tuple[tuple[str, ...], ...]) -> None:
    names = []
    for pair in fields:
        if len(pair) != 2 or not all(isinstance(part, str) for part in pair):
            raise ValueError(f"dynamic_fields entry {pair!r} must be a (name, regex) pair of str")
        name, regex = pair
        if not _FIELD_NAME.fullmatch(name) or _NUMBERED.fullmatch(name):
            raise ValueError(
                f"dynamic_fields name {name!r} must be an identifier (letters, digits, _) "
                "starting with a letter and not ending in _<digits>"
            )
        try:
            pattern = re.compile(regex)
        except re.error as error:
            raise ValueError(
                f"dynamic_fields[{name!r}]: invalid regex {regex!r}: {error}"
            ) from None
        if pattern.fullmatch(""):
            raise ValueError(f"dynamic_fields[{name!r}]: regex {regex!r} matches the empty string")
        names.append(name)
    duplicates = sorted({name for name in names if names.count(name) > 1})
    if duplicates:
        raise ValueError(f"dynamic_fields names {duplicates} appear more than once")


def _validate_marker(config: CanonicalizeConfig) -> None:
    marker = config.dynamic_marker
    if not isinstance(marker, str) or not marker or marker != marker.strip() or "\n" in marker:
        raise ValueError(
            f"dynamic_marker={marker!r} must be one non-empty line without surrounding blanks"
        )
    for name, pattern, replacement in _compiled_rules(config):
        if pattern.search(marker):  # the marker must survive a second pass unchanged
            raise ValueError(f"dynamic_marker={marker!r} would be changed by the {name} rule")
