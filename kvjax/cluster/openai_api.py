"""The OpenAI completions protocol as nodes and the router speak it: request parsing and
validation, response and stream-chunk bodies, error bodies, incremental text for streams.

Request fields. A field kvjax does not know is ignored, as vLLM ignores one: the request is
served as if it were not there, and the server logs the names (``IgnoredFields``) and counts
them in ``/metrics``; clients and SDKs send fields of their own. The fields whose ignoring would
change the answer are known here and refused unless at their neutral value (below). Known:

* ``model`` (required; the served model's name), ``prompt`` (a string, a list of one string,
  or a list of token ids), ``max_tokens`` (default 16), ``stream``, ``stream_options``
  (``include_usage``), ``temperature`` (default 0: greedy, unlike OpenAI's 1, so a prompt's
  output does not depend on the node that served it), ``top_k`` (0, or -1 as in vLLM: all),
  ``seed`` (any 64-bit integer, as in vLLM; the engine takes it modulo 2**32), ``user`` (a string);
* ``stop``: a string or a list of strings, each non-empty, at most 4 of them as in OpenAI
  (vLLM takes any number; every stop string is searched at every token on the engine's
  thread, which all requests share, so the limit stands). The answer ends before the
  earliest stop string, with ``finish_reason`` "stop"; a stream never sends text the answer
  cuts away (it holds back text that may begin a stop string until the next tokens tell);
* vLLM's ``min_tokens`` (an integer in [0, ``max_tokens``]; default 0): no stop string ends
  the request before it has generated that many tokens (see
  ``kvjax.serving.stop_strings``); vLLM's ``ignore_eos`` (a bool): accepted, and changes
  nothing, as a node ends a request on no EOS token (only on its stop strings and length);
* OpenAI fields kvjax does not implement are accepted only at their neutral value, and only
  of the type OpenAI gives them (``echo: 0`` and ``n: true`` are refused, not read as false
  and 1): ``n`` / ``best_of`` 1, ``echo`` false, ``top_p`` 1, ``frequency_penalty`` /
  ``presence_penalty`` 0, ``logprobs`` null, ``suffix`` "", ``logit_bias`` {};
* so are vLLM's sampling and decoding fields whose silent ignoring would change the text (a
  vLLM client sending them expects them honoured): ``use_beam_search`` false, ``min_p`` 0,
  ``repetition_penalty`` 1, ``stop_token_ids`` [], ``bad_words`` [],
  ``include_stop_str_in_output`` false, ``skip_special_tokens`` true, ``add_special_tokens``
  true (kvjax decodes and encodes by its tokenizer's own rule), ``return_tokens_as_token_ids``
  false, ``response_format`` {"type": "text"}; and only null for ``truncate_prompt_tokens``,
  ``allowed_token_ids``, ``prompt_logprobs``, ``guided_json``, ``guided_regex``,
  ``guided_choice``, ``guided_grammar``, ``structured_outputs``, ``logits_processors`` and
  ``prompt_embeds``. vLLM fields that change no text where those hold (``length_penalty``,
  ``spaces_between_special_tokens``, ``priority``, ``guided_decoding_backend``, ...) are
  unknown here, so ignored;
* an explicit null is the same as a field not given, as in OpenAI and vLLM (clients that
  serialize every field send their unset ones as null);
* ``namespace`` (kvjax's extension): the tenant whose cached blocks the request may share,
  a string (default: the default namespace). The same can come in the ``X-KVJax-Namespace``
  header, which is where a gateway that authenticates tenants sets it (ASCII only, as HTTP
  header values are: a namespace outside ASCII goes in the body; the header at most once); body
  and header must agree when both are given. The namespace is trusted input: whoever can choose it can
  hit that tenant's cache, so expose the router to tenants only behind such a gateway;
* vLLM's ``cache_salt`` (a non-empty string, as vLLM requires; null: no salt): the request's
  blocks are shared only with requests of the same namespace and the same salt, so a user's
  private prompt gives nobody else a prefix-cache hit to time. Where vLLM mixes the salt into
  the first block's hash, kvjax makes it the ``salt`` of the ``kvjax.cache.block_keys.Namespace``
  every block key chain starts from (``CompletionRequest.block_namespace``): the node's cache,
  the router's directory lookup and remote fetch between nodes all key the request's blocks
  under it, and a salted request shares nothing with an unsalted one. As in vLLM, whoever
  knows a salt shares its blocks: keep it secret (one per user, say);
* ``remote_fetch`` (kvjax's extension, default true): whether the serving node may fetch
  the prompt's cached prefix from another node (``kvjax.cluster.remote_fetch``) instead of
  recomputing it; false recomputes what the node does not hold (a comparison run).

The official client passes the extension (and vLLM's fields) in ``extra_body``:
``extra_body={"namespace": "tenant-a", "cache_salt": "user-7"}``.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping

from kvjax.cache.block_keys import Namespace, as_namespace
from kvjax.serving.stop_strings import StopStrings

__all__ = [
    "CONTEXT_LENGTH_EXCEEDED",
    "NAMESPACE_HEADER",
    "NODE_CAPACITY_EXCEEDED",
    "CompletionRequest",
    "RequestError",
    "TextStream",
    "completion_body",
    "error_body",
    "model_body",
    "parse_completion_request",
    "sse",
    "stream_chunk",
    "unknown_model",
    "usage_body",
]

NAMESPACE_HEADER = "x-kvjax-namespace"
# Error codes of a 400 for a request too long: for the model (OpenAI's code: no node serves
# it), or for one node's page pool (a router tries the other nodes, whose pools may be larger).
CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"
NODE_CAPACITY_EXCEEDED = "node_capacity_exceeded"


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _is_bool(value) -> bool:
    return isinstance(value, bool)


def _of_type(kind: type):
    return lambda value: isinstance(value, kind)


def _anything(value) -> bool:
    return True


# Fields kvjax does not implement, OpenAI's and then vLLM's: their type (checked first, so
# that True == 1 and 0 == False cannot pass for a neutral value) and the values that ask for
# nothing; no value: only null (of any type)
_NEUTRAL = {"n": ("an integer", _is_int, (1,)), "best_of": ("an integer", _is_int, (1,)),
            "echo": ("a bool", _is_bool, (False,)),
            "top_p": ("a number", _is_number, (1,)), "frequency_penalty": ("a number", _is_number, (0,)),
            "presence_penalty": ("a number", _is_number, (0,)), "logprobs": ("an integer", _is_int, ()),
            "suffix": ("a string", _of_type(str), ("",)),
            "logit_bias": ("an object", _of_type(dict), ({},)),
            "use_beam_search": ("a bool", _is_bool, (False,)), "min_p": ("a number", _is_number, (0,)),
            "repetition_penalty": ("a number", _is_number, (1,)),
            "stop_token_ids": ("a list", _of_type(list), ([],)),
            "bad_words": ("a list", _of_type(list), ([],)),
            "include_stop_str_in_output": ("a bool", _is_bool, (False,)),
            "skip_special_tokens": ("a bool", _is_bool, (True,)), "add_special_tokens": ("a bool", _is_bool, (True,)),
            "return_tokens_as_token_ids": ("a bool", _is_bool, (False,)),
            "response_format": ("an object", _of_type(dict), ({"type": "text"},)),
            **{name: ("anything", _anything, ()) for name in (
                "truncate_prompt_tokens", "allowed_token_ids", "prompt_logprobs", "guided_json", "guided_regex",
                "guided_choice", "guided_grammar", "structured_outputs", "logits_processors",
                "prompt_embeds")}}  # fmt: skip
_FIELDS = ("model", "prompt", "max_tokens", "stream", "stream_options", "temperature", "top_k", "seed", "user",
           "stop", "min_tokens", "ignore_eos", "namespace", "cache_salt", "remote_fetch", *_NEUTRAL)  # fmt: skip
_KNOWN = frozenset(_FIELDS)
MAX_STOP_STRINGS = 4  # OpenAI's limit


class RequestError(ValueError):
    """A bad request: ``status`` (400, 404, 503, ...) and the OpenAI error ``param`` and ``code``."""

    def __init__(self, message: str, *, status: int = 400, param: str | None = None,
                 kind: str = "invalid_request_error", code: str | None = None):  # fmt: skip
        super().__init__(message)
        self.status, self.param, self.kind, self.code = status, param, kind, code

    def body(self) -> dict:
        return error_body(str(self), param=self.param, kind=self.kind, code=self.code)


@dataclasses.dataclass(frozen=True, slots=True)
class CompletionRequest:
    """A validated ``/v1/completions`` body."""

    model: str
    prompt: str | None  # text, or None when the prompt came as token ids
    prompt_tokens: tuple[int, ...] | None
    max_tokens: int = 16
    stream: bool = False
    include_usage: bool = False
    temperature: float = 0.0
    top_k: int = 0
    seed: int | None = None
    namespace: str | None = None  # the tenant; None: the default namespace
    remote_fetch: bool = True
    stop: tuple[str, ...] = ()  # stop strings
    min_tokens: int = 0
    ignored_fields: tuple[str, ...] = ()  # the body's fields kvjax does not know, sorted (not used)
    cache_salt: str = ""  # "": none

    @property
    def block_namespace(self) -> Namespace:
        """What the request's blocks are keyed under, on the node, the router and in remote
        fetch alike: its tenant and its ``cache_salt``."""
        return dataclasses.replace(as_namespace(self.namespace), salt=self.cache_salt)


def parse_completion_request(raw: bytes | str | Mapping, headers: Mapping[str, str] | None = None) -> CompletionRequest:
    """Validate a request body (JSON text or a parsed object); RequestError naming the field,
    its value and what was expected. Fields it does not know are ignored, named in
    ``ignored_fields``."""
    body = _json_object(raw)
    ignored = tuple(sorted(set(body) - _KNOWN))
    for name, (kind, is_kind, neutral) in _NEUTRAL.items():
        value = body.get(name)
        if value is None:
            continue
        if not is_kind(value):
            raise RequestError(f"{name}={_short(value)} must be {kind}", param=name)
        if value not in neutral:
            accepted = " or ".join(json.dumps(option) for option in (*neutral, None))  # as JSON spells them
            raise RequestError(f"{name}={_short(value)} is not supported; kvjax accepts only {accepted}",
                               param=name)
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise RequestError(f"model={model!r} must be the served model's name (a non-empty string)", param="model")
    prompt, tokens = _prompt(body.get("prompt"))
    stream = _typed(body, "stream", bool, False)
    options = _typed(body, "stream_options", dict, None) or {}
    if not stream and options:
        raise RequestError("stream_options is only allowed with stream=true", param="stream_options")
    include_usage = options.get("include_usage")
    include_usage = False if include_usage is None else include_usage
    if not isinstance(include_usage, bool) or set(options) - {"include_usage"}:
        raise RequestError(f"stream_options={options!r}; expected {{'include_usage': bool}}", param="stream_options")
    _typed(body, "user", str, None)  # not used, but a client sending a dict there has a bug to hear about
    _typed(body, "ignore_eos", bool, False)  # no EOS ends a node's request: true is what it does already
    max_tokens = _int_in(body, "max_tokens", 16, 1, None)
    return CompletionRequest(
        model=model, prompt=prompt, prompt_tokens=tokens,
        max_tokens=max_tokens, stream=stream, include_usage=include_usage,
        temperature=_number_in(body, "temperature", 0.0, 0.0, 2.0), top_k=_top_k(body),
        seed=_seed(body), namespace=_namespace(body, headers or {}),
        remote_fetch=_typed(body, "remote_fetch", bool, True), stop=_stop(body),
        min_tokens=_min_tokens(body, max_tokens), ignored_fields=ignored, cache_salt=_cache_salt(body))  # fmt: skip


def error_body(message: str, *, param: str | None = None, kind: str = "invalid_request_error",
               code: str | None = None) -> dict:  # fmt: skip
    """An OpenAI error object."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def model_body(model: str) -> dict:
    """The served model as ``GET /v1/models`` lists it and ``GET /v1/models/{model}`` answers."""
    return {"id": model, "object": "model", "created": 0, "owned_by": "kvjax"}


def unknown_model(model: str, served: str, where: str) -> RequestError:
    """The 404 for a model not served (``where``: "this node", "the cluster"), with OpenAI's
    code "model_not_found"."""
    return RequestError(f"model={model!r} is not served here; {where} serves {served!r}", status=404,
                        param="model", code="model_not_found")  # fmt: skip


def completion_body(request_id: str, model: str, created: int, text: str, finish_reason: str, usage: dict) -> dict:
    """A non-streamed completion; ``created``: when the request came, in Unix seconds."""
    return {"id": request_id, "object": "text_completion", "created": created, "model": model,
            "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}],
            "usage": usage}  # fmt: skip


def stream_chunk(request_id: str, model: str, created: int, text: str, finish_reason: str | None = None, *,
                 usage: dict | None = None, include_usage: bool = False) -> dict:  # fmt: skip
    """One streamed chunk; with ``usage`` the usage-only chunk (no choices). As OpenAI's:
    ``created`` (when the request came, Unix seconds) is the same in every chunk of a stream,
    and with ``include_usage`` (the request's ``stream_options``) the other chunks carry
    ``"usage": null``."""
    choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
    choices = [] if usage is not None else [choice]
    chunk = {"id": request_id, "object": "text_completion", "created": created, "model": model, "choices": choices}
    if usage is not None or include_usage:
        chunk["usage"] = usage
    return chunk


def usage_body(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict:
    """OpenAI usage, with the prompt tokens served from cached KV in ``prompt_tokens_details``."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}  # fmt: skip


def sse(payload: dict | str) -> bytes:
    """One server-sent event: ``data: <json>`` (or ``data: [DONE]``) and a blank line."""
    text = payload if isinstance(payload, str) else json.dumps(payload, separators=(",", ":"))
    return f"data: {text}\n\n".encode()


class TextStream:
    """Text deltas of a growing token sequence, never splitting a character, never sending
    text past a stop string.

    A byte-level tokenizer can end a prefix in the middle of a UTF-8 character, which decodes
    to one U+FFFD until the rest arrives (the decoder replaces an incomplete character by a
    single U+FFFD; invalid bytes before it are final). So one trailing U+FFFD is held back
    and the deltas concatenate to the final text exactly.

    With ``stop`` strings (and the request's ``min_tokens``) the text is cut where the
    engine cuts the answer (the same ``StopStrings`` finds it), and an end of the text that
    begins a stop string waits until the next tokens complete it (it is cut away) or not (it
    is sent): for a decoder whose text of a prefix is a prefix of the later text (a
    byte-level one), no delta holds text the final answer leaves out.
    """

    def __init__(self, decode, stop: tuple[str, ...] = (), min_tokens: int = 0):
        self._decode = decode
        self._ids: list[int] = []
        self._stop = StopStrings(stop, decode, min_tokens) if stop else None
        self.sent = ""

    def push(self, token_id: int) -> str:
        """The new stable text after ``token_id`` ("" if none)."""
        self._ids.append(token_id)
        text = self._decode(self._ids)
        if text.endswith("\ufffd"):
            text = text[:-1]
        if self._stop is not None:
            cut = self._stop.find(text, self._ids)
            text = text[: len(text) - self._stop.held_back(text)] if cut is None else text[:cut]
        delta = text[len(self.sent) :] if text.startswith(self.sent) else ""
        self.sent += delta
        return delta

    def finish(self, final_text: str) -> str:
        """The rest of ``final_text`` (the answer: the whole output decoded, cut before a stop
        string) not sent yet."""
        delta = final_text[len(self.sent) :] if final_text.startswith(self.sent) else ""
        self.sent += delta
        return delta


# --- helpers -------------------------------------------------------------------------------


def _json_object(raw) -> dict:
    if isinstance(raw, Mapping):
        return dict(raw)
    try:
        body = json.loads(raw)
    except ValueError as error:  # JSONDecodeError, UnicodeDecodeError, an int past Python's digit limit
        raise RequestError(f"the request body is not valid JSON: {error}") from None
    except RecursionError:
        raise RequestError("the request body nests JSON too deeply to parse") from None
    if not isinstance(body, dict):
        raise RequestError(f"the request body must be a JSON object, got {type(body).__name__}")
    return body


def _prompt(prompt) -> tuple[str | None, tuple[int, ...] | None]:
    if isinstance(prompt, str):
        return prompt, None
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        return prompt[0], None
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return None, tuple(prompt)
    raise RequestError(f"prompt={_short(prompt)} must be a string, a list of one string or a non-empty list of "
                       "token ids", param="prompt")  # fmt: skip


def _stop(body: Mapping) -> tuple[str, ...]:
    value = body.get("stop")
    if value is None:
        return ()
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or not all(isinstance(stop, str) and stop for stop in stops):
        raise RequestError(f"stop={_short(value)} must be a non-empty string or a list of non-empty strings",
                           param="stop")  # fmt: skip
    if len(stops) > MAX_STOP_STRINGS:
        raise RequestError(f"stop has {len(stops)} strings; at most {MAX_STOP_STRINGS} are accepted (OpenAI's limit)",
                           param="stop")  # fmt: skip
    return tuple(stops)


def _min_tokens(body: Mapping, max_tokens: int) -> int:
    value = body.get("min_tokens")
    if value is None:
        return 0
    if not _is_int(value) or not 0 <= value <= max_tokens:
        raise RequestError(f"min_tokens={_short(value)} must be an integer in [0, max_tokens={max_tokens}]",
                           param="min_tokens")  # fmt: skip
    return value


def _namespace(body: Mapping, headers: Mapping[str, str]) -> str | None:
    in_body, in_header = body.get("namespace"), headers.get(NAMESPACE_HEADER)
    sent = headers.getlist(NAMESPACE_HEADER) if hasattr(headers, "getlist") else [in_header]  # Starlette's Headers
    if len(sent) > 1:
        # .get reads the first: a gateway that appends its tenant to one the client sent would
        # have let the client's choice win
        raise RequestError(f"the {NAMESPACE_HEADER} header comes {len(sent)} times ({_short(sent)}); send it once",
                           param="namespace")  # fmt: skip
    if in_header is not None and not in_header.isascii():
        # HTTP servers hand header bytes over as Latin-1: UTF-8 sent there would name another
        # tenant than the body's field, and a router could not forward it (header values are ASCII)
        raise RequestError(f"the {NAMESPACE_HEADER} header holds non-ASCII bytes ({_short(in_header)} read as "
                           "Latin-1); header values must be ASCII: send such a namespace in the body's "
                           "namespace field", param="namespace")  # fmt: skip
    if in_body is not None and (not isinstance(in_body, str) or not in_body):
        raise RequestError(f"namespace={in_body!r} must be a non-empty string (a tenant name)", param="namespace")
    if in_body is not None and in_header is not None and in_body != in_header:
        raise RequestError(f"namespace={in_body!r} in the body but {in_header!r} in the {NAMESPACE_HEADER} header",
                           param="namespace")  # fmt: skip
    namespace = in_body if in_body is not None else (in_header or None)
    if namespace is not None:
        _check_encodes("namespace", namespace)
    return namespace


def _cache_salt(body: Mapping) -> str:
    """vLLM's ``cache_salt``: a non-empty string, as vLLM requires; "" when not given."""
    salt = body.get("cache_salt")
    if salt is None:
        return ""
    if not isinstance(salt, str) or not salt:
        raise RequestError(f"cache_salt={_short(salt)} must be a non-empty string", param="cache_salt")
    _check_encodes("cache_salt", salt)
    return salt


def _check_encodes(name: str, text: str) -> None:
    try:
        text.encode()  # the namespace digest keys every block: a lone surrogate cannot be hashed
    except UnicodeEncodeError:
        raise RequestError(f"{name}={_short(text)} must be valid Unicode text (it holds a lone surrogate)",
                           param=name) from None


def _typed(body: Mapping, name: str, kind: type, default):
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, kind):
        raise RequestError(f"{name}={_short(value)} must be a {kind.__name__}", param=name)
    return value


def _int_in(body: Mapping, name: str, default, low: int, high: int | None):
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, int) or isinstance(value, bool) or value < low or (high is not None and value > high):
        bounds = f">= {low}" if high is None else f"in [{low}, {high}]"
        raise RequestError(f"{name}={_short(value)} must be an integer {bounds}", param=name)
    return value


def _seed(body: Mapping) -> int | None:
    """The seed as the engine takes it (32 bits): any 64-bit integer, as vLLM accepts, taken
    modulo 2**32 (a client drawing 64-bit seeds got a 400)."""
    seed = _int_in(body, "seed", None, -(2**63), 2**63 - 1)
    return None if seed is None else seed % 2**32


def _top_k(body: Mapping) -> int:
    """0 (all the vocabulary) for -1, vLLM's spelling of no limit."""
    value = body.get("top_k")
    if value is None:
        return 0
    if not _is_int(value) or value < -1:
        raise RequestError(f"top_k={_short(value)} must be an integer >= -1 (0 or -1: no limit)", param="top_k")
    return max(value, 0)


def _number_in(body: Mapping, name: str, default: float, low: float, high: float) -> float:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not low <= value <= high:
        raise RequestError(f"{name}={_short(value)} must be a number in [{low}, {high}]", param=name)
    return float(value)


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
