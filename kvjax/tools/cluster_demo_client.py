"""The cluster demo's client: one streamed ``/v1/completions`` request, timed.

Standard library only (``urllib``), so that ``python -m kvjax`` imports this module on the
core install; the servers it talks to need the cluster's packages.
"""

from __future__ import annotations

import dataclasses
import json
import time
import urllib.error
import urllib.request

__all__ = ["Completion", "complete"]


@dataclasses.dataclass(frozen=True, slots=True)
class Completion:
    """One finished request as the client saw it."""

    node: str  # the node that served it (``X-KVJax-Node``)
    text: str
    prompt_tokens: int
    cached_tokens: int  # prompt tokens served from cached KV
    ttft_s: float  # seconds from sending to the first streamed chunk


def complete(base_url: str, model: str, prompt: str, max_tokens: int, namespace: str,
             timeout_s: float = 120.0) -> Completion:  # fmt: skip
    """Send one greedy streamed completion to ``base_url`` (a node or a router) and read it
    to the end. RuntimeError naming the status and the server's message on an error answer."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}, "namespace": namespace}  # fmt: skip
    request = urllib.request.Request(f"{base_url}/v1/completions", data=json.dumps(body).encode(),
                                     headers={"content-type": "application/json"})  # fmt: skip
    start = time.perf_counter()
    ttft, pieces, usage = None, [], None
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            node = response.headers.get("x-kvjax-node", "?")
            for line in response:
                if not line.startswith(b"data: "):
                    continue
                payload = line[6:].strip()
                if ttft is None:
                    ttft = time.perf_counter() - start
                if payload == b"[DONE]":
                    break
                chunk = json.loads(payload)
                if "error" in chunk:
                    raise RuntimeError(f"{base_url} failed mid-stream: {chunk['error'].get('message')}")
                pieces.extend(choice["text"] for choice in chunk.get("choices", ()))
                usage = chunk.get("usage") or usage
    except urllib.error.HTTPError as error:
        message = error.read().decode(errors="replace")[:300]
        raise RuntimeError(f"{base_url} answered {error.code}: {message}") from None
    if usage is None:
        raise RuntimeError(f"{base_url} ended the stream without usage")
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    return Completion(node, "".join(pieces), usage["prompt_tokens"], cached, ttft or 0.0)
