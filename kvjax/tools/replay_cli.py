"""``python -m kvjax replay TRACE --device-blocks N [--host-blocks M] [--disk-blocks K]
[--write-through] [--policy NAME] [--json]``; with ``--nodes N`` a cluster of N such nodes
behind the router (``kvjax.tools.cluster_replay_cli``).

Replays a Mooncake-format trace through the real KVCache (no model, no bytes), above optional
host and disk tiers (see ``kvjax.tools.replay``), and prints block and token hit rates, per tier and in all,
next to the offline (farthest next use) and unlimited-capacity yardsticks.
With ``--json`` the last line is one JSON object (rates as fractions); see
``ReplayReport.as_dict`` for its keys. Bad input (a malformed line, a missing file) prints one
error line naming it and exits with status 2.
"""

from __future__ import annotations

import argparse
import json
import sys

from kvjax.cache.policies import POLICIES
from kvjax.tools.cluster_replay_cli import add_cluster_arguments, cluster_options_without_nodes, run_cluster_replay
from kvjax.tools.replay import DEFAULT_POLICY, ReplayReport, replay_report
from kvjax.tools.trace import MOONCAKE_BLOCK_TOKENS, load_trace

__all__ = ["add_subcommand", "format_report", "run_replay"]


def add_subcommand(subparsers) -> None:
    """Registers the ``replay`` parser; its ``func`` returns the exit status."""
    replay = subparsers.add_parser(
        "replay",
        help="replay a Mooncake-format trace to size a cache",
        description="Replay a Mooncake-format trace (one JSON object per line with timestamp "
        "in ms, input_length, output_length, hash_ids) through the prefix cache, one request "
        "at a time, with no model. Every hash id is one cache block.",
    )
    replay.add_argument("trace", help="path of the trace (JSON lines)")
    replay.add_argument("--device-blocks", type=_positive_int, required=True, metavar="N",
                        help="cache capacity in blocks (one block per hash id)")  # fmt: skip
    replay.add_argument("--host-blocks", type=_non_negative_int, default=0, metavar="M",
                        help="host tier capacity in blocks (default: 0, no host tier)")  # fmt: skip
    replay.add_argument("--disk-blocks", type=_non_negative_int, default=0, metavar="K",
                        help="disk tier capacity in blocks (default: 0, no disk tier)")  # fmt: skip
    replay.add_argument("--write-through", action="store_true",
                        help="write every used block to the host (default: write-back on eviction); "
                             "needs --host-blocks")  # fmt: skip
    replay.add_argument("--policy", default=DEFAULT_POLICY, choices=sorted(POLICIES),
                        help=f"eviction policy (default: {DEFAULT_POLICY})")  # fmt: skip
    replay.add_argument("--block-tokens", type=_positive_int, default=MOONCAKE_BLOCK_TOKENS,
                        metavar="T", help="tokens per hash id (default: %(default)s)")  # fmt: skip
    replay.add_argument("--json", action="store_true",
                        help="end the output with one JSON line of the results")  # fmt: skip
    add_cluster_arguments(replay)
    replay.set_defaults(func=run_replay)


def run_replay(args: argparse.Namespace, out=None, err=None) -> int:
    """Runs the parsed ``replay`` command; 0 on success, 2 for a bad or unreadable trace, a
    capacity out of range or ``--write-through`` without a host tier, 1 (with a warning) for a
    trace without requests."""
    out, err = out or sys.stdout, err or sys.stderr  # looked up now: tests swap them
    if cluster_options_without_nodes(args):
        print(f"kvjax replay: error: {', '.join(cluster_options_without_nodes(args))}: cluster options; add --nodes N",
              file=err)  # fmt: skip
        return 2
    if args.write_through and not args.host_blocks:  # it copies every block to the host tier: there is none
        print("kvjax replay: error: --write-through needs a host tier (--host-blocks M with M >= 1); "
              "without one there is nowhere to write blocks through to", file=err)  # fmt: skip
        return 2
    try:
        requests = load_trace(args.trace, block_tokens=args.block_tokens)
    except (OSError, ValueError) as error:
        print(f"kvjax replay: error: {error}", file=err)
        return 2
    if not requests:  # a table of zeros would read as results
        print(f"kvjax replay: warning: trace {args.trace!r} holds no requests (blank or empty); "
              "expected JSON lines, one request each; nothing replayed", file=err)
        return 1
    try:
        if args.nodes is not None:
            return run_cluster_replay(args, requests, out)
        report = replay_report(requests, args.device_blocks, policy=args.policy,
                               block_tokens=args.block_tokens, host_blocks=args.host_blocks,
                               disk_blocks=args.disk_blocks, write_through=args.write_through)  # fmt: skip
    except ValueError as error:  # a capacity out of range, named with what was expected
        print(f"kvjax replay: error: {error}", file=err)
        return 2
    print(format_report(args.trace, report), file=out)
    if args.json:
        print(json.dumps(report.as_dict()), file=out)
    return 0


def format_report(trace: str, report: ReplayReport) -> str:
    """Human-readable table: the policy (per tier when there are lower tiers), the offline
    policy with every tier's room and unlimited capacity."""
    online = report.online
    write = "write-through" if report.write_through else "write-back"
    lines = [
        f"trace {trace}: {online.requests} requests, {online.blocks} blocks, "
        f"{online.tokens} prompt tokens",
        f"capacity {report.device_blocks} device blocks, {report.host_blocks} host, "
        f"{report.disk_blocks} disk ({write}); sequential replay (no concurrency)",
        f"{'':<28}{'block hits':>12}{'token hits':>12}{'evicted':>10}",
    ]
    rows = [(f"policy {report.policy}", online.block_hit_rate, online.token_hit_rate,
             online.evicted_blocks)]  # fmt: skip
    if report.host_blocks or report.disk_blocks:
        rates = online.tier_rates()
        rows += [(f"  of which {tier}", rates[f"{tier}_block_hit_rate"],
                  rates[f"{tier}_token_hit_rate"], "") for tier in ("device", "host", "disk")]  # fmt: skip
    for label, counts in (("offline (farthest use)", report.offline),
                          ("unlimited capacity", report.unlimited)):  # fmt: skip
        rows.append((label, counts.block_hit_rate, counts.token_hit_rate, counts.evicted_blocks))
    for label, block_rate, token_rate, evicted in rows:
        lines.append(f"{label:<28}{block_rate:>12.2%}{token_rate:>12.2%}{evicted:>10}")
    if report.offline.hit_blocks:
        share = online.hit_blocks / report.offline.hit_blocks
        lines.append(f"policy {report.policy} gets {share:.1%} of the offline block hits "
                     f"(offline with {report.offline_blocks} blocks: every tier's room)")  # fmt: skip
    if report.unlimited.hit_blocks:
        share = online.hit_blocks / report.unlimited.hit_blocks
        lines.append(f"policy {report.policy} gets {share:.1%} of the unlimited-capacity block hits")
    return "\n".join(lines)


def _positive_int(text: str) -> int:
    return _int_at_least(text, 1)


def _non_negative_int(text: str) -> int:
    return _int_at_least(text, 0)


def _int_at_least(text: str, low: int) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < low:
        raise argparse.ArgumentTypeError(f"{value} must be >= {low}")
    return value
