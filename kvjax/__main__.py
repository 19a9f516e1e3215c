"""``python -m kvjax <command>``: the command-line entry.

Each command lives in its own module, which provides ``add_subcommand(subparsers)``
registering an argparse parser whose ``func`` default takes the parsed arguments and
returns an exit code. Errors are one line on stderr (see ``kvjax.tools.cli``).
"""

from __future__ import annotations

import importlib
import sys

from kvjax.tools.cli import ArgumentParser, run_command

# Modules that contribute a subcommand, in the order `--help` lists them.
COMMAND_MODULES = ("kvjax.tools.demo", "kvjax.tools.replay_cli", "kvjax.tools.cluster_demo")

DESCRIPTION = ("kvjax: reusable KV cache for JAX/Flax serving. 'demo' serves a built-in workload "
               "with and without the cache; 'replay' sizes a cache from a request trace.")


def main(argv: list[str] | None = None) -> int:
    parser = ArgumentParser(prog="kvjax", description=DESCRIPTION)
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in COMMAND_MODULES:
        module = importlib.import_module(name)
        if hasattr(module, "add_subcommand"):
            module.add_subcommand(subparsers)
    args = parser.parse_args(argv)
    return run_command(args, prog=f"kvjax {args.command}")


if __name__ == "__main__":
    sys.exit(main())
