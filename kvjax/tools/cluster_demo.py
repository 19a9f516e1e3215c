"""``python -m kvjax cluster-demo --nodes 2``: the demo workload through a cluster on loopback,
routed by ``prefix`` and by ``round_robin`` (``--router`` picks), with and without fetching
prefixes from other nodes, side by side.

It starts a redis-server (``kvjax.cluster.redis_process``), N nodes of the ``tiny`` preset
(host tier included: fetched pages land there) and one router per strategy (``python -m
kvjax.cluster``; ``kvjax.cluster.processes``), all on 127.0.0.1 and stopped by pid at the end.
The built-in workload (``kvjax.tools.workload``: shared system prompts, multi-turn
conversations, few-shot templates, two tenants) runs through each router in turn, first with
every request asking its node not to fetch (``remote_fetch: false``: what another node holds
is recomputed), then with fetching, each run in namespaces of its own (so no run hits what
another cached), then once more directly on one node with every request in a namespace of
its own: a single node that never hits. The demo prints, per run, the requests, cached prompt
tokens, tokens fetched from other nodes and computed prefill tokens of every node, the
fetches' waits p50/p99 and time to first token p50/p99 (measured by the client, streaming),
and checks that every request produced the same text as on the uncached node. Exits 1 if
any differs.

``--router round_robin`` breaks affinity on purpose: a conversation's turns land on both
nodes, so the node serving a turn fetches the prefix the other one computed.

Requests are text (greedy); the system prompts are longer than the single-node demo's
(``DEMO_WORKLOAD``); a conversation's next turn is its previous prompt, the reply
and the next user message, sent when the reply is complete (closed loop); sessions start
``--arrival-ms`` apart. Needs the cluster's packages (``pip install 'kvjax[cluster]'``) and a
redis-server binary (see ``kvjax.cluster.redis_process``).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

from kvjax.cluster.processes import ServiceProcess
from kvjax.cluster.redis_process import RedisProcess
from kvjax.cluster.router import STRATEGIES
from kvjax.config.presets import load_preset
from kvjax.tools.cluster_demo_client import Completion, complete
from kvjax.tools.workload import Session, WorkloadSpec, build_workload

__all__ = [
    "DEMO_STRATEGIES",
    "DEMO_WORKLOAD",
    "ClusterDemoResult",
    "add_subcommand",
    "format_table",
    "run_cluster_demo",
    "run_workload",
]

DEMO_STRATEGIES = ("prefix", "round_robin")
_REFERENCE = "one uncached node"
_NO_FETCH = ", no fetch"
_NEEDS = ("fastapi", "uvicorn", "httpx", "redis", "prometheus_client")
_MODEL = "tiny"
_MAX_ARRIVAL_MS = 3_600_000  # an hour between sessions: beyond it a demo runs for days (and time.sleep overflows)
DEMO_WORKLOAD = WorkloadSpec(system_prompt_chars=1400)
"""The built-in workload with system prompts long enough that prefill, not the HTTP hops,
decides time to first token on CPU (measured: TTFT p50 85 ms routed by prefix, 143 ms round
robin; with the single-node demo's 480 characters both were within noise of each other)."""


@dataclasses.dataclass(slots=True)
class ClusterDemoResult:
    """Completions by run ("prefix", "round_robin", and the uncached reference) and request id."""

    runs: dict[str, dict[str, Completion]]
    node_ids: list[str]

    def differing(self, run: str) -> list[str]:
        """Request ids whose text differs from the uncached node's (or that are missing)."""
        reference = self.runs[_REFERENCE]
        got = self.runs[run]
        return sorted(rid for rid in reference if rid not in got or got[rid].text != reference[rid].text)

    @property
    def compared(self) -> list[str]:
        """Every run but the uncached reference, in order."""
        return [run for run in self.runs if run != _REFERENCE]

    @property
    def identical(self) -> bool:
        return all(not self.differing(run) for run in self.compared)


def run_cluster_demo(nodes: int = 2, *, out=sys.stdout, preset: str = "tiny", arrival_ms: float = 100.0,
                     spec: WorkloadSpec | None = None, log_dir: str | None = None,
                     strategies: tuple[str, ...] = DEMO_STRATEGIES) -> ClusterDemoResult:  # fmt: skip
    """Runs the demo (see the module docstring) and prints its table to ``out``.

    ValueError naming the value for ``nodes`` < 1, ``arrival_ms`` outside [0, an hour] or an
    unknown strategy; ModuleNotFoundError naming the missing packages; RuntimeError (with the log's path) if a
    process does not start.
    """
    if isinstance(nodes, bool) or not isinstance(nodes, int) or nodes < 1:
        raise ValueError(f"nodes={nodes!r} must be an int >= 1")
    unknown = [strategy for strategy in strategies if strategy not in STRATEGIES]
    if unknown or not strategies:
        raise ValueError(f"strategies={list(strategies)!r}; expected some of {list(STRATEGIES)}")
    if isinstance(arrival_ms, bool) or not isinstance(arrival_ms, (int, float)) \
            or not 0 <= arrival_ms <= _MAX_ARRIVAL_MS:  # inf or 1e300 killed every session's thread in time.sleep
        raise ValueError(f"arrival_ms={arrival_ms!r} must be in [0, {_MAX_ARRIVAL_MS}] (milliseconds between "
                         "sessions, at most an hour)")  # fmt: skip
    missing = [name for name in _NEEDS if importlib.util.find_spec(name) is None]
    if missing:
        raise ModuleNotFoundError(f"the cluster demo needs {', '.join(missing)}: pip install 'kvjax[cluster]'")
    load_preset(preset)  # a bad preset is refused here, not by every node process after their start
    sessions = build_workload(spec or DEMO_WORKLOAD)
    logs = Path(log_dir or tempfile.mkdtemp(prefix="kvjax-cluster-demo-"))
    logs.mkdir(parents=True, exist_ok=True)
    try:
        return _run(nodes, preset, arrival_ms, sessions, logs, out, tuple(dict.fromkeys(strategies)))
    except RuntimeError as error:  # the first line says which process or request, a log's last why
        lines = [line.strip() for line in str(error).splitlines() if line.strip()]
        why = f": {lines[-1]}" if len(lines) > 1 else ""
        raise RuntimeError(f"{lines[0] if lines else error}{why} (logs in {logs})") from error


def _run(nodes: int, preset: str, arrival_ms: float, sessions: list[Session], logs: Path, out,
         strategies: tuple[str, ...]) -> ClusterDemoResult:  # fmt: skip
    start = time.perf_counter()
    with _LoopbackCluster(nodes, preset, logs, strategies) as cluster:
        print(f"kvjax cluster demo: redis {cluster.redis.url}, {nodes} node(s) of preset {preset!r} "
              f"({', '.join(cluster.node_urls)}), routers {', '.join(f'{s} {u}' for s, u in cluster.routers.items())}; "
              f"started in {time.perf_counter() - start:.0f}s; logs in {logs}", file=out)  # fmt: skip
        num_requests = sum(len(s.turns) for s in sessions)
        print(f"workload: {len(sessions)} sessions, {num_requests} requests (system prompts, multi-turn, "
              f"few-shot; tenants {sorted({s.namespace for s in sessions})}), one session every {arrival_ms:g} ms",
              file=out)  # fmt: skip
        runs = {}
        for strategy in strategies:
            for run, fetch in ((strategy + _NO_FETCH, False), (strategy, True)):
                runs[run] = run_workload(cluster.routers[strategy], sessions, arrival_ms / 1000,
                                         lambda session, request_id, run=run: f"{run}:{session.namespace}",
                                         remote_fetch=fetch)  # fmt: skip
        first_node = cluster.node_urls[0]
        runs[_REFERENCE] = run_workload(first_node, sessions, arrival_ms / 1000,
                                        lambda session, request_id: f"uncached:{request_id}",
                                        remote_fetch=False)  # fmt: skip
    result = ClusterDemoResult(runs, [f"n{i}" for i in range(nodes)])
    print("\n" + format_table(result), file=out)
    return result


def run_workload(url: str, sessions: list[Session], arrival_s: float, namespace_of, *,
                 remote_fetch: bool = True) -> dict[str, Completion]:  # fmt: skip
    """Every session on its own thread, starting ``arrival_s`` apart; returns completions by
    request id. ``namespace_of(session, request_id)`` names each request's namespace;
    ``remote_fetch`` False asks the nodes to recompute what another node holds."""
    results: dict[str, Completion] = {}
    errors: list[BaseException] = []
    start = time.perf_counter()

    def run(index: int, session: Session) -> None:
        time.sleep(max(0.0, start + index * arrival_s - time.perf_counter()))
        prompt = session.prefix
        try:
            for turn, message in enumerate(session.turns):
                request_id = f"{session.session_id}/t{turn}"
                prompt += f"\nUser: {message}\nAssistant:"
                completion = complete(url, _MODEL, prompt, session.max_new_tokens, namespace_of(session, request_id),
                                      remote_fetch=remote_fetch)  # fmt: skip
                results[request_id] = completion
                prompt += completion.text
        except Exception as error:  # reported by the caller, with the session
            errors.append(RuntimeError(f"session {session.session_id} through {url}: {error}"))

    threads = [threading.Thread(target=run, args=(i, s), daemon=True) for i, s in enumerate(sessions)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]
    return results


def format_table(result: ClusterDemoResult) -> str:
    """The runs side by side: per node requests, cached, fetched and computed prompt tokens;
    fetch waits; TTFT; whether the text matches the uncached node."""
    columns = [*result.compared, _REFERENCE]
    rows: list[tuple[str, list[str]]] = []
    for node in result.node_ids:
        per_run = {run: [c for c in result.runs[run].values() if c.node == node] for run in columns}
        rows.append((f"{node}: requests", [str(len(per_run[run])) for run in columns]))
        cached = [sum(c.cached_tokens for c in per_run[run]) for run in columns]
        computed = [sum(c.prompt_tokens for c in per_run[run]) - hit for run, hit in zip(columns, cached)]
        rows.append((f"{node}: cached prompt tokens", [f"{tokens:,}" for tokens in cached]))
        rows.append((f"{node}:   fetched from others", [f"{sum(c.fetched_tokens for c in per_run[run]):,}"
                                                         for run in columns]))  # fmt: skip
        rows.append((f"{node}: prefill tokens computed", [f"{tokens:,}" for tokens in computed]))
    rows.extend(_totals(result, columns))
    width = max(len(label) for label, _ in rows) + 2
    column = max(14, *(len(run) + 2 for run in columns))
    lines = [f"{'':<{width}}" + "".join(f"{run:>{column}}" for run in columns)]
    lines += [f"{label:<{width}}" + "".join(f"{value:>{column}}" for value in values) for label, values in rows]
    for run in result.compared:
        differing = result.differing(run)
        verdict = "yes" if not differing else f"NO: {len(differing)} differ, e.g. {differing[:3]}"
        lines.append(f"{run}: same text as {_REFERENCE}: {verdict} ({len(result.runs[run])} requests)")
    return "\n".join(lines)


def _totals(result: ClusterDemoResult, columns: list[str]) -> list[tuple[str, list[str]]]:
    rates, fetched, fetches, fetch_p50, fetch_p99, p50, p99 = [], [], [], [], [], [], []
    for run in columns:
        completions = list(result.runs[run].values())
        prompt = sum(c.prompt_tokens for c in completions)
        rates.append(f"{sum(c.cached_tokens for c in completions) / prompt:.1%}" if prompt else "-")
        fetched.append(f"{sum(c.fetched_tokens for c in completions):,}")
        waits = [c.fetch_s for c in completions if c.fetch_s is not None]
        fetches.append(f"{len(waits)} ({sum(c.fetch_outcome == 'ok' for c in completions)} ok)")
        fetch_p50.append(_ms(waits, 50))
        fetch_p99.append(_ms(waits, 99))
        ttft = [c.ttft_s for c in completions]
        p50.append(_ms(ttft, 50))
        p99.append(_ms(ttft, 99))
    return [("cached share of prompt tokens", rates), ("tokens fetched from other nodes", fetched),
            ("fetches (requests; all pages verified)", fetches), ("fetch wait p50", fetch_p50), ("fetch wait p99", fetch_p99),
            ("TTFT p50", p50), ("TTFT p99", p99)]  # fmt: skip


def _ms(seconds: list[float], percentile: float) -> str:
    return f"{1e3 * np.percentile(seconds, percentile):,.0f} ms" if seconds else "-"


class _LoopbackCluster:
    """Redis, the nodes and one router per strategy as child processes; stopped on exit."""

    def __init__(self, nodes: int, preset: str, logs: Path, strategies: tuple[str, ...]):
        self.num_nodes, self.preset, self.logs, self.strategies = nodes, preset, logs, strategies
        self.processes: list[ServiceProcess] = []
        self.redis: RedisProcess | None = None
        self.node_urls: list[str] = []
        self.routers: dict[str, str] = {}

    def __enter__(self) -> _LoopbackCluster:
        try:
            self._start()
        except BaseException:
            self.__exit__()
            raise
        return self

    def _start(self) -> None:
        self.redis = RedisProcess.start()
        common = ["--port", "0", "--redis", self.redis.url, "--prefix", "demo"]
        env = {"JAX_PLATFORMS": os.environ.get("JAX_PLATFORMS", "cpu"), "JAX_COMPILATION_CACHE_DIR": _compile_cache(),
               "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0.1"}  # fmt: skip
        # The first node fills the compilation cache; the others and the routers start together.
        for index in range(self.num_nodes):
            node = ServiceProcess(["node", "--node-id", f"n{index}", "--preset", self.preset, "--model-name", _MODEL,
                                   *common], self.logs / f"n{index}.log", env)  # fmt: skip
            self.processes.append(node)
            if index == 0:
                node.wait_ready(_START_TIMEOUT_S)
        for strategy in self.strategies:
            self.processes.append(ServiceProcess(["router", "--strategy", strategy, *common],
                                                 self.logs / f"router-{strategy}.log"))  # fmt: skip
        for process in self.processes:
            if process.ready is None:
                process.wait_ready(_START_TIMEOUT_S)
        self.node_urls = [process.url for process in self.processes[: self.num_nodes]]
        self.routers = dict(zip(self.strategies, (process.url for process in self.processes[self.num_nodes :])))

    def __exit__(self, *exc_info) -> None:
        for process in reversed(self.processes):
            process.stop()
        if self.redis is not None:
            self.redis.stop()


_START_TIMEOUT_S = 240.0


def _compile_cache() -> str:
    """Where the node processes keep compiled steps (the single-node demo's place)."""
    return os.environ.get("JAX_COMPILATION_CACHE_DIR") or str(Path.home() / ".cache" / "kvjax" / "jax")


def add_subcommand(subparsers) -> None:
    """Registers ``python -m kvjax cluster-demo``."""
    parser = subparsers.add_parser("cluster-demo", help="the demo workload through a cluster: prefix vs round robin",
                                   description=_first_paragraph(__doc__))  # fmt: skip
    parser.add_argument("--nodes", type=int, default=2, help="serving nodes (default: %(default)s)")
    parser.add_argument("--preset", default="tiny", help="configs/<preset>.toml of every node (default: %(default)s)")
    parser.add_argument("--arrival-ms", type=float, default=100.0,
                        help="ms between sessions, at most an hour (default: %(default)s)")
    parser.add_argument("--router", nargs="+", default=list(DEMO_STRATEGIES), metavar="STRATEGY",
                        help=f"routing strategies to run, of {list(STRATEGIES)} (default: %(default)s)")
    parser.add_argument("--log-dir", help="where the processes' logs go (default: a new temporary directory)")
    parser.set_defaults(func=_main)


def _first_paragraph(doc: str) -> str:
    """The docstring's opening sentence as plain text: its first line alone stopped mid-sentence
    ("... on loopback,")."""
    return " ".join(doc.split("\n\n")[0].split()).replace("``", "")


def _main(args: argparse.Namespace, err=None) -> int:
    err = err or sys.stderr
    try:
        result = run_cluster_demo(args.nodes, preset=args.preset, arrival_ms=args.arrival_ms, log_dir=args.log_dir,
                                  strategies=tuple(args.router))  # fmt: skip
    except (ValueError, ModuleNotFoundError, FileNotFoundError) as error:
        print(f"kvjax cluster-demo: error: {error}", file=err)
        return 2
    except RuntimeError as error:  # a process that did not start, or a request that failed
        print(f"kvjax cluster-demo: error: {str(error).splitlines()[0]}", file=err)
        return 1
    return 0 if result.identical else 1
