"""``python -m kvjax.cluster {redis,node,router}``: run the pieces of a cluster by hand.

* ``redis``: a redis-server on loopback from the binary the install brought (for machines
  without a system Redis; see ``kvjax.cluster.redis_process``).
* ``node``: the ``tiny`` (or another) preset's engine behind the OpenAI-compatible API,
  registered in the directory at ``--redis`` (without it: a standalone server).
* ``router``: the OpenAI-compatible front that routes by the directory.

Each prints one JSON line once it serves, e.g. ``{"ready": "http://127.0.0.1:8001",
"node_id": "n1"}``, then logs warnings only (a router whose Redis does not answer prints a
``not_ready`` line naming it first, and ``ready`` once it answers); Ctrl-C (SIGINT) or
SIGTERM stops it cleanly: a node leaves the directory at once, and a node or router takes no
new request and gives those in flight ``--drain-s`` seconds (``kvjax.cluster.drain``; a
second signal cuts them now).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import signal
import socket
import sys
import threading
import urllib.parse
from collections.abc import Awaitable, Callable

import redis
import uvicorn

from kvjax.cluster.directory import Directory, check_node_id
from kvjax.cluster.drain import DEFAULT_GRACE_S, DrainingServer, NodeDrain
from kvjax.cluster.http_front import DEFAULT_MAX_BODY_BYTES
from kvjax.cluster.node_server import create_node_app, start_worker
from kvjax.cluster.redis_process import RedisProcess
from kvjax.cluster.remote_fetch import RemoteFetcher
from kvjax.cluster.remote_offers import FAULTS, OfferService
from kvjax.cluster.router import STRATEGIES, RoutingPolicy
from kvjax.cluster.router_options import add_router_options, router_config
from kvjax.cluster.router_server import RouterService, create_router_app, directory_down, router_drain
from kvjax.config.checks import is_wildcard_host
from kvjax.serving.engine import Engine

__all__ = ["main"]

ROUTER_DESCRIPTION = ("The OpenAI-compatible front of the cluster: per request it computes the prompt's block keys, "
                      "looks them up in the directory at --redis (one round trip) and sends the request to a live "
                      "node. 'prefix' (the default) sends it to the node holding the longest cached prefix among "
                      "those within their share of the recent requests (share + slack, bounded-load style) and not "
                      "overloaded; 'least_loaded' and 'round_robin' ignore the prefix. A failed node's request is "
                      "retried on another.")

DESCRIPTION = ("Run the pieces of a kvjax cluster by hand: 'redis' (a redis-server on loopback for the "
               "directory), 'node' (an engine behind the OpenAI-compatible API, registered at --redis) and "
               "'router' (the OpenAI-compatible front that routes by the directory). Each prints one JSON "
               "line once it serves; Ctrl-C or SIGTERM stops it cleanly (a node or router first finishes the "
               "requests it has, for up to --drain-s seconds).")


_LOG = logging.getLogger("kvjax.cluster")
_REDIS_RETRY_S = 0.5  # how often a router whose Redis does not answer asks again

def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvjax.cluster", description=DESCRIPTION)
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    redis_parser = commands.add_parser("redis", help="run a redis-server on loopback")
    redis_parser.add_argument("--port", type=int, default=6379)
    redis_parser.set_defaults(func=_run_redis)
    node = commands.add_parser("node", help="serve one engine")
    _common(node, default_port=8001)
    node.add_argument("--node-id", required=True, help="stable name of this node (no ':' or spaces)")
    node.add_argument("--advertise", help="URL routers use to reach this node (default: http://HOST:PORT)")
    node.add_argument("--preset", default="tiny", help="configs/<preset>.toml")
    node.add_argument("--model-name", help="the model name clients send (default: the preset's name)")
    node.add_argument("--no-tiers", action="store_true", help="leave out the preset's host and disk tiers")
    node.add_argument("--weights", help="weights written by save_weights (an .npz file or an orbax directory), or "
                      "'random' (default: the preset's own weights, e.g. configs/tiny.npz; random if it ships none)")
    node.add_argument("--no-remote-fetch", action="store_true",
                      help="never fetch a prefix from another node (this node still offers its own)")
    node.add_argument("--transfer-address", default=None,
                      help="host:port of the block transfer server (default: --host, any free port)")
    node.add_argument("--remote-suspect-s", type=float, default=10.0,
                      help="seconds a peer whose fetch failed is not asked again")
    node.add_argument("--drain-s", type=float, default=DEFAULT_GRACE_S, metavar="S",
                      help="on SIGTERM or Ctrl-C, seconds the requests in flight may still run (new ones get a "
                           "503, the node leaves the directory at once); then a stream still open ends with an "
                           "error event and a non-streamed request gets a 503 (default: %(default)s)")
    node.add_argument("--remote-fault", default=None, choices=FAULTS,
                      help="misbehave when peers ask for blocks, and take POST /kv/fault to change how (fault "
                           "tests only)")
    node.add_argument("--step-control", action="store_true",
                      help='take POST /test/steps {"steps": N}: run N more engine steps, then hold every request '
                           'where it is until the next one ({"steps": null}: run freely); for tests that act while '
                           "requests are in flight, on any device (tests only)")
    node.set_defaults(func=_run_node)
    router = commands.add_parser("router", help="route requests to the nodes", description=ROUTER_DESCRIPTION)
    _common(router, default_port=8000)
    router.add_argument("--strategy", default="prefix", choices=STRATEGIES, help="(default: %(default)s)")
    add_router_options(router)
    router.add_argument("--max-attempts", type=int, default=3, metavar="N",
                        help="nodes to try per request (default: %(default)s)")
    router.add_argument("--read-timeout-s", type=float, default=600.0, metavar="S",
                        help="longest a node may stay silent while answering (a whole non-streamed answer, or "
                             "between two stream chunks) before the client gets a 504 (default: %(default)s)")
    router.add_argument("--drain-s", type=float, default=DEFAULT_GRACE_S, metavar="S",
                        help="on SIGTERM or Ctrl-C, seconds the requests in flight (streams included) may still "
                             "run; new ones get a 503 and /health answers 503 'draining' at once; then a stream "
                             "still open ends with an error event and a non-streamed request gets a 503 (default: "
                             "%(default)s)")
    router.set_defaults(func=_run_router)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.command == "redis" else logging.WARNING,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s", force=True)  # fmt: skip
    return int(args.func(args) or 0)


def _common(parser: argparse.ArgumentParser, default_port: int) -> None:
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on")
    parser.add_argument("--port", type=int, default=default_port, help="0: any free port")
    parser.add_argument("--redis", help="the directory's Redis, e.g. redis://127.0.0.1:6379/0")
    parser.add_argument("--prefix", default="kvjax", help="the cluster's key prefix in Redis")
    parser.add_argument("--node-ttl", type=float, default=6.0, help="seconds a node stays listed without heartbeat")
    parser.add_argument("--max-body-bytes", type=int, default=DEFAULT_MAX_BODY_BYTES,
                        help="largest request body taken; a larger one gets a 413 (default: 8 MiB)")


def _reachable_host(args) -> str:
    """The host the transfer server binds by default (bracketed if IPv6, as its port follows):
    ``--host``, or, where that is every interface, the host of ``--advertise`` (peers must be
    told an address they can reach)."""
    host = args.host
    if is_wildcard_host(host):
        host = urllib.parse.urlsplit(args.advertise).hostname if args.advertise else None
        if not host:
            raise SystemExit(f"node: --host {args.host} listens on every interface; give --transfer-address "
                             "HOST:PORT (or --advertise URL) with an address peers can reach for the block "
                             "transfer server")
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


def _http_address(host: str, port: int) -> str:
    """The URL of a server on ``host:port`` (an IPv6 host bracketed: "http://::1:8001" is no URL,
    and a router given it as a node's address failed every request it sent there)."""
    return f"http://[{host}]:{port}" if ":" in host and not host.startswith("[") else f"http://{host}:{port}"


def _run_redis(args) -> int:
    stop = threading.Event()
    for stop_signal in (signal.SIGINT, signal.SIGTERM):  # from before the start: one during it stops too
        signal.signal(stop_signal, lambda *_: stop.set())
    try:
        server = RedisProcess.start(port=args.port)
    except (RuntimeError, FileNotFoundError, OSError) as error:  # port in use, no binary
        raise SystemExit(f"redis: {str(error).splitlines()[0]}") from None
    try:
        print(json.dumps({"ready": server.url, "pid": server.pid, "binary": server.binary}), flush=True)
        while not stop.wait(0.2):
            pass
    finally:
        server.stop()
    return 0


def _run_node(args) -> int:
    # everything that can fail by a setting fails before the engine compiles, in one line
    try:
        check_node_id(args.node_id)
    except ValueError as error:
        raise SystemExit(f"node: {error}") from None
    _check_max_body_bytes(args, "node")
    try:
        drain = NodeDrain(args.node_id, args.drain_s)
    except ValueError as error:
        raise SystemExit(f"node: --drain-s: {error}") from None
    if args.redis and not args.advertise and is_wildcard_host(args.host):
        # routers would be told http://0.0.0.0:PORT, which names no machine of theirs (its
        # host is the transfer server's default too)
        raise SystemExit(f"node: --host {args.host} listens on every interface; give --advertise URL with an "
                         "address routers and peers can reach")  # fmt: skip
    transfer_address = (args.transfer_address or f"{_reachable_host(args)}:0") if args.redis else None
    directory = _directory(args, "node")
    sock = _listen(args.host, args.port, "node")
    try:
        engine = Engine.from_preset(args.preset, tiers=not args.no_tiers, weights=args.weights)
    except ValueError as error:  # a bad preset or weights path: one line, not a traceback
        raise SystemExit(f"node: {error}") from None
    engine.warmup()  # compile before registering: a router must not send work to a compiling node
    address = args.advertise or _http_address(args.host, sock.getsockname()[1])
    model = args.model_name or args.preset
    transport = remote = None
    if directory is not None:  # peers find each other through the directory
        from kvjax.tiers.remote_transport import RemoteTransport  # the transfer server only where used

        try:
            transport = RemoteTransport(transfer_address)
        except Exception as error:  # noqa: BLE001 - a bad address or port: one line, not a traceback
            raise SystemExit(f"node: the block transfer server cannot start at {transfer_address!r}: {error}") from None
        if not args.no_remote_fetch and engine.cache.config.tiered and not engine.cache.codec.lossy:
            remote = RemoteFetcher(engine.cache, transport, directory, args.node_id,
                                   suspect_s=args.remote_suspect_s)  # fmt: skip
    if directory is not None:
        _warn_if_replacing(directory, args.node_id, address)
    try:
        worker = start_worker(engine, node_id=args.node_id, address=address, model=model, directory=directory,
                              remote=remote)  # fmt: skip
    except (ValueError, RuntimeError) as error:  # another model on the prefix, Redis unreachable
        raise SystemExit(f"node: {error}") from None
    offers = None
    if transport is not None:
        cache = engine.cache
        offers = OfferService(transport, worker.export, cache.page_identity, cache.codec.block_nbytes,
                              fault=args.remote_fault or "none")  # fmt: skip
    try:
        app = create_node_app(worker, model, args.node_id, offers, fault_control=args.remote_fault is not None,
                              step_control=args.step_control, drain=drain, max_body_bytes=args.max_body_bytes)  # fmt: skip
        _serve(lambda config: DrainingServer(config, drain, worker.leave_directory), app, sock,
               {"ready": address, "node_id": args.node_id, "model": model,
                "transfer": None if transport is None else transport.address,
                "remote_fetch": remote is not None})  # fmt: skip
    finally:
        worker.stop()
        if remote is not None:
            remote.close()
        engine.close()
        if transport is not None:
            transport.close()
            if transport.stats()["abandoned_pulls"]:
                # A pull still blocked in the transfer library aborts the interpreter's exit
                # (std::terminate): everything is closed, so leave without it.
                logging.shutdown()
                sys.stdout.flush()
                os._exit(0)
    return 0


def _check_max_body_bytes(args, command: str) -> None:
    if args.max_body_bytes < 1:
        raise SystemExit(f"{command}: --max-body-bytes {args.max_body_bytes} must be >= 1 (bytes)")


def _run_router(args) -> int:
    _check_max_body_bytes(args, "router")
    directory = _directory(args, "router")
    if directory is None:
        raise SystemExit("router: --redis URL is required (the directory it routes by)")
    try:
        config = router_config(args, args.strategy)
        service = RouterService(directory, RoutingPolicy(config), max_attempts=args.max_attempts)
    except ValueError as error:
        raise SystemExit(f"router: {error}") from None
    try:
        drain = router_drain(args.drain_s)
    except ValueError as error:
        raise SystemExit(f"router: --drain-s: {error}") from None
    try:
        app = create_router_app(service, read_timeout_s=args.read_timeout_s, drain=drain,
                                max_body_bytes=args.max_body_bytes)  # fmt: skip
    except ValueError as error:
        raise SystemExit(f"router: {error}") from None
    sock = _listen(args.host, args.port, "router")
    address = _http_address(args.host, sock.getsockname()[1])

    async def directory_answers() -> None:
        """Return once the directory's Redis answers. Till then the router serves (``/health``
        says why it is not ready, requests get a 503) but is not ready: it says so, once, in a
        ``not_ready`` line naming the Redis, and the ``ready`` line waits."""
        error = await asyncio.to_thread(_ping, directory)
        if error is None:
            return
        reason = f"{directory_down(directory, error)}; the router routes once it answers"
        _LOG.warning("router: %s (until then /health answers 503 and requests get a 503)", reason)
        print(json.dumps({"not_ready": address, "directory": directory.address, "reason": reason}), flush=True)
        while await asyncio.to_thread(_ping, directory) is not None:
            await asyncio.sleep(_REDIS_RETRY_S)

    _serve(lambda config: DrainingServer(config, drain), app, sock, {"ready": address, "strategy": args.strategy},
           ready_when=directory_answers)
    return 0


def _ping(directory: Directory) -> redis.RedisError | None:
    """None if the directory's Redis answers, else why not (blocking: one round trip)."""
    try:
        directory.client.ping()
    except redis.RedisError as error:
        return error
    return None


def _warn_if_replacing(directory: Directory, node_id: str, address: str) -> None:
    """A live node of the same id is replaced in the directory by this one (a restart within
    its TTL does that on purpose): say so, naming it, rather than take its place silently."""
    try:
        live = [view for view in directory.live_nodes() if view.node_id == node_id]
    except redis.RedisError:
        return  # registering says what is wrong with Redis
    for view in live:
        if view.address != address:
            _LOG.warning("node %s is live at %s (epoch %d): this node replaces it in the directory; "
                         "use another --node-id unless that one is gone", node_id, view.address, view.epoch)


def _directory(args, who: str) -> Directory | None:
    if not args.redis:
        return None
    try:
        return Directory.connect(args.redis, prefix=args.prefix, node_ttl_s=args.node_ttl)
    except ValueError as error:  # a malformed URL (redis-py's message does not echo it)
        raise SystemExit(f"{who}: --redis {args.redis!r}: {error}") from None


def _listen(host: str, port: int, who: str) -> socket.socket:
    """Bind before serving, so that port 0 gives a known port and the ready line is true;
    a port in use (or a host not here) is a one-line error naming it."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as error:
        sock.close()
        raise SystemExit(f"{who}: cannot listen on {host}:{port}: {error.strerror or error}") from None
    sock.listen(2048)
    return sock


def _serve(server_class: Callable[[uvicorn.Config], uvicorn.Server], app, sock: socket.socket, ready: dict,
           ready_when: Callable[[], Awaitable[None]] | None = None) -> None:  # fmt: skip
    """Serve ``app`` on ``sock`` with ``server_class`` (uvicorn's, or a ``DrainingServer``);
    print ``ready`` once it serves (and ``ready_when`` returned), and a ``stopped`` line once it
    stopped at a signal."""
    server = server_class(uvicorn.Config(app, log_level="warning", lifespan="on", timeout_graceful_shutdown=5))

    async def serve():
        async def announce():
            while not server.started:
                await asyncio.sleep(0.01)
            if ready_when is not None:
                await ready_when()
            print(json.dumps(ready), flush=True)

        announcer = asyncio.ensure_future(announce())
        try:
            await server.serve(sockets=[sock])
        finally:
            announcer.cancel()

    try:
        asyncio.run(serve())
    except KeyboardInterrupt:  # Ctrl-C: uvicorn has shut down; no traceback
        print(json.dumps({"stopped": ready.get("ready")}), flush=True)
        return
    if isinstance(server, DrainingServer) and server.signals:  # it drained and stopped without raising
        print(json.dumps({"stopped": ready.get("ready")}), flush=True)


if __name__ == "__main__":
    sys.exit(main())
