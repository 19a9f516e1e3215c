"""What the node's and the router's HTTP fronts share: a request whose client left is cancelled.

uvicorn does not cancel a handler when its client disconnects (it only stops a streamed
response once a write fails), so a non-streamed completion would run to its last token for
nobody, and a router would keep waiting on its node for it. ``unless_client_leaves`` runs the
handler's wait next to a task that waits for the ASGI ``http.disconnect`` message (the body
has been read by then, so nothing else is in the receive channel): when it comes first, the
wait is cancelled and ``ClientGone`` raised, and the handler cancels the engine request (a
node) or closes its upstream request (a router, whose node then sees the disconnect too).
The watch is a second task, not a poll: a request that is answered pays for two task
switches, not for a timer.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from typing import TypeVar

__all__ = ["CLIENT_GONE_STATUS", "ClientGone", "unless_client_leaves"]

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
