"""The command line's frame: one-line errors, no tracebacks, and their exit codes.

* 2, a usage error: an argument argparse refuses, or a ``ValueError`` a command raises for a
  value it was given (a preset, a file, a size). The caller can fix it.
* 1, a runtime failure: a ``CommandError`` (the command ran and could not do its job, e.g.
  every request of the demo was rejected) or an ``OSError`` (a file could not be read or
  written).
* 130: interrupted (Ctrl-C).

Each prints one line on stderr, ``kvjax <command>: error: <what>``, naming the value and what
was expected. Other exceptions are bugs and keep their tracebacks.
"""

from __future__ import annotations

import argparse
import sys

__all__ = ["ArgumentParser", "CommandError", "run_command"]


class CommandError(Exception):
    """A command that ran and failed: printed as one line, exit status ``exit_code``."""

    def __init__(self, message: str, exit_code: int = 1):
        super().__init__(message)
        self.exit_code = exit_code


class ArgumentParser(argparse.ArgumentParser):
    """``argparse.ArgumentParser`` whose usage errors are one line on stderr (exit status 2),
    without the usage text; subcommand parsers are of this class too."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {_one_line(message)} (see {self.prog} --help)\n")


def run_command(args: argparse.Namespace, prog: str, err=None) -> int:
    """Runs ``args.func(args)`` and returns its exit status, turning the failures above into
    one line on ``err`` (default: ``sys.stderr`` at call time)."""
    err = err or sys.stderr
    try:
        return int(args.func(args) or 0)
    except CommandError as error:
        code, message = error.exit_code, str(error)
    except ValueError as error:  # a value the command was given: the caller's to fix
        code, message = 2, str(error)
    except OSError as error:
        code, message = 1, _os_error(error)
    except KeyboardInterrupt:
        code, message = 130, "interrupted"
    print(f"{prog}: error: {_one_line(message)}", file=err)
    return code


def _os_error(error: OSError) -> str:
    if error.filename is None:
        return str(error)
    return f"{error.strerror or error}: {str(error.filename)!r}"


def _one_line(message: str) -> str:
    return " ".join(message.split()) or "(no message)"
