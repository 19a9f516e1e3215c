"""What the node's and the router's HTTP fronts share: OpenAI error bodies for every error,
a request whose client left is cancelled, a limit on request bodies, and the fields requests
carried that were ignored.

Errors (``answer_errors_as_openai``): OpenAI clients read ``{"error": {"message", "type",
"param", "code"}}``; FastAPI's own answers for a route or method that does not exist are
``{"detail": ...}``, and an unexpected failure is plain text. Every error of an app is
turned into the OpenAI body with the right status: a ``RequestError`` with its own, 404 for
an unknown route (as OpenAI answers "Invalid URL"), 405 naming the allowed methods, 500.

A client that leaves (``unless_client_leaves``): uvicorn does not cancel a handler when its
client disconnects (it only stops a streamed response once a write fails), so a
non-streamed completion would run to its last token for nobody, and a router would keep
waiting on its node for it. The handler's wait runs next to a task that waits for the ASGI
``http.disconnect`` message (the body has been read by then, so nothing else is in the
receive channel): when it comes first, the wait is cancelled and ``ClientGone`` raised, and
the handler cancels the engine request (a node) or closes its upstream request (a router,
whose node then sees the disconnect too). The watch is a second task, not a poll: a request
that is answered pays for two task switches, not for a timer.

Request bodies (``limit_request_bodies``): a handler reads the whole body into memory before
parsing it, so without a limit one client could make the server hold any number of bytes. A
body whose ``Content-Length`` passes the limit gets a 413 before a byte of it is read; one sent
chunked (no length) gets the 413 once the bytes received pass it, the rest never held. The
default, ``DEFAULT_MAX_BODY_BYTES`` (8 MiB), is far above any prompt a node can serve (a token
id costs at most 12 bytes of JSON, ``"4294967295, "``, so 8 MiB holds ~700,000 of them, and
text escaped as ``\\uXXXX``, 6 bytes a character, ~1.4 million characters) and small enough
that a few hundred such requests at once cost a few GiB, not the host. uvicorn reads and drops
what the client still sends of a refused body, so the client reads its 413 instead of a reset
connection (the official client would retry that), and the connection stays usable.

Ignored fields (``IgnoredFields``): a request's fields kvjax does not know are ignored, as vLLM
ignores them (``kvjax.cluster.openai_api``); the server counts them and names them in a warning,
at most one line every ``log_every_s`` (a client that sends one on every request would
otherwise write a line per request), which says how many requests since carried some too.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CollectorRegistry, Counter
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect

from kvjax.cluster.openai_api import RequestError, error_body

__all__ = ["CLIENT_GONE_STATUS", "DEFAULT_MAX_BODY_BYTES", "ClientGone", "IgnoredFields", "answer_errors_as_openai",
           "limit_request_bodies", "unless_client_leaves"]  # fmt: skip

_LOG = logging.getLogger(__name__)
T = TypeVar("T")
CLIENT_GONE_STATUS = 499  # nginx's "client closed request": logged, never read by anyone
DEFAULT_MAX_BODY_BYTES = 8 * 2**20  # see the module docstring
Receive = Callable[[], Awaitable[dict]]


class ClientGone(Exception):
    """The client closed its connection before its answer was ready."""


async def unless_client_leaves(receive: Receive, work: Awaitable[T]) -> T:
    """``work``'s result, or ClientGone (``work`` cancelled, its clean-up run) if the client
    disconnects first. ``receive``: the request's ASGI receive, its body already read."""
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(_disconnect(receive))
    try:
        await asyncio.wait((task, watch), return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:  # the server itself stops the handler
        task.cancel()
        watch.cancel()
        raise
    if task.done():  # answered (even if the client left at the same moment: nothing lost)
        watch.cancel()
        return task.result()
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError, Exception):  # it ends for nobody
        await task
    raise ClientGone()


async def _disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


def answer_errors_as_openai(app: FastAPI, routes: str) -> None:
    """Make every error answer of ``app`` an OpenAI error body (see the module docstring);
    ``routes``: what the app serves, for the 404 of a route it does not (e.g. "POST
    /v1/completions, GET /v1/models"). A ``ClientGone``, or a client that left while sending its
    body (Starlette's ``ClientDisconnect``), is answered with an empty 499."""

    @app.exception_handler(RequestError)
    async def request_error(_, error: RequestError):
        return JSONResponse(error.body(), status_code=error.status)

    @app.exception_handler(ClientGone)
    @app.exception_handler(ClientDisconnect)  # it left while sending its body: not a server error to log
    async def client_gone(_, error: Exception):
        return Response(status_code=CLIENT_GONE_STATUS)  # nobody reads it

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, error: HTTPException):
        where = f"{request.method} {request.url.path}"
        if error.status_code == 404:
            message = f"Invalid URL ({where}); this server answers {routes}"
        elif error.status_code == 405:
            allowed = (error.headers or {}).get("Allow", "")
            message = f"method {request.method} is not allowed on {request.url.path}; use {allowed or 'another'}"
        else:
            message = f"{where}: {error.detail}"
        return JSONResponse(error_body(message), status_code=error.status_code, headers=error.headers)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, error: RequestValidationError):
        return JSONResponse(error_body(f"{request.method} {request.url.path}: {error.errors()}"), status_code=400)

    @app.exception_handler(Exception)
    async def unexpected(_, error: Exception):  # the server logs the traceback after this answer
        return JSONResponse(error_body(f"internal error: {type(error).__name__}: {error}", kind="server_error"),
                            status_code=500)  # fmt: skip


def limit_request_bodies(app: FastAPI, max_body_bytes: int) -> None:
    """Answer a request whose body passes ``max_body_bytes`` with a 413 naming the limit,
    without reading more of it than the limit (see the module docstring). ValueError for a
    limit that is not a positive integer."""
    if isinstance(max_body_bytes, bool) or not isinstance(max_body_bytes, int) or max_body_bytes < 1:
        raise ValueError(f"max_body_bytes={max_body_bytes!r} must be a positive integer (bytes)")
    app.add_middleware(_BodyLimit, max_body_bytes=max_body_bytes)

    @app.exception_handler(_BodyTooLarge)
    async def body_too_large(_, error: _BodyTooLarge):
        return JSONResponse(error_body(str(error)), status_code=413)


class IgnoredFields:
    """The request fields a server ignored: counted in ``{prefix}_ignored_request_fields_total``
    of ``registry``, named in a warning at most every ``log_every_s`` seconds."""

    def __init__(self, registry: CollectorRegistry, prefix: str, *, log_every_s: float = 10.0):
        self.counter = Counter(f"{prefix}_ignored_request_fields",
                               "Request fields ignored because kvjax does not know them (named in the log)",
                               registry=registry)  # fmt: skip
        self.log_every_s = log_every_s
        self._logged_at = -math.inf  # time.monotonic() of the last warning
        self._unlogged = 0  # requests with ignored fields since then, not named in a warning

    def note(self, fields: tuple[str, ...]) -> None:
        """Count one request's ignored ``fields`` (none: nothing to do) and maybe name them."""
        if not fields:
            return
        self.counter.inc(len(fields))
        now = time.monotonic()
        if now - self._logged_at < self.log_every_s:
            self._unlogged += 1
            return
        names = repr(list(fields))
        names = names if len(names) <= 300 else names[:297] + "..."  # the client chose them
        since = f" ({self._unlogged} more requests carried ignored fields since the last such line)" \
            if self._unlogged else ""  # fmt: skip
        _LOG.warning("The following fields were present in the request but ignored: %s%s", names, since)
        self._logged_at, self._unlogged = now, 0


class _BodyTooLarge(Exception):
    """A chunked request body that passed the limit while it was read."""

    def __init__(self, limit: int):
        super().__init__(f"the request body passed this server's limit of {_bytes(limit)} before its end; "
                         "send a smaller one")  # fmt: skip


class _BodyLimit:
    """ASGI middleware of ``limit_request_bodies``."""

    def __init__(self, app, max_body_bytes: int):
        self.app, self.max_body_bytes = app, max_body_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        limit = self.max_body_bytes
        declared = _content_length(scope)
        if declared is not None and declared > limit:
            message = f"the request body has {declared} bytes; this server accepts at most {_bytes(limit)}"
            return await JSONResponse(error_body(message), status_code=413)(scope, receive, send)
        received = 0

        async def limited() -> dict:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    raise _BodyTooLarge(limit)
            return message

        await self.app(scope, limited, send)


def _content_length(scope) -> int | None:
    for name, value in scope["headers"]:
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:  # the HTTP server refuses such a request before it gets here
                return None
    return None


def _bytes(count: int) -> str:
    return f"{count} bytes ({count / 2**20:g} MiB)" if count >= 2**20 else f"{count} bytes"
