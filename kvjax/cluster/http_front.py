"""What the node's and the router's HTTP fronts share: OpenAI error bodies for every error,
and a request whose client left is cancelled.

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
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from typing import TypeVar

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect

from kvjax.cluster.openai_api import RequestError, error_body

__all__ = ["CLIENT_GONE_STATUS", "ClientGone", "answer_errors_as_openai", "unless_client_leaves"]

T = TypeVar("T")
CLIENT_GONE_STATUS = 499  # nginx's "client closed request": logged, never read by anyone
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
