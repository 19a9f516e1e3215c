"""Cluster pieces as child processes: ``python -m kvjax.cluster <command>`` started, waited for
until it prints its ready line, and stopped by pid. For tests and the cluster demo.

>>> node = ServiceProcess(["node", "--node-id", "n1", "--port", "0", "--redis", url], "n1.log")  # doctest: +SKIP
>>> node.wait_ready().url                                                                     # doctest: +SKIP
'http://127.0.0.1:41383'
"""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

__all__ = ["ServiceProcess"]


class ServiceProcess:
    """One ``python -m kvjax.cluster <args>`` child; its stderr goes to ``log_path``.

    ``env`` adds to this process's environment (e.g. ``JAX_COMPILATION_CACHE_DIR``).
    """

    def __init__(self, args: Sequence[str], log_path: str | Path, env: Mapping[str, str] | None = None):
        self.args, self.log_path = list(args), Path(log_path)
        self._log = open(self.log_path, "wb")
        self.process = subprocess.Popen([sys.executable, "-m", "kvjax.cluster", *self.args], stdout=subprocess.PIPE,
                                        stderr=self._log, env={**os.environ, **(env or {})})  # fmt: skip
        self.ready: dict | None = None
        self._pending = b""  # read from its stdout, not yet a whole line

    def wait_ready(self, timeout_s: float = 180.0) -> ServiceProcess:
        """Wait for the JSON line with ``ready`` it prints once it serves (``.ready``), past any
        line before it (a router waiting for its Redis says so first); RuntimeError with the end
        of its log if it exits or takes longer than ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while self.ready is None:
            line = self.wait_line(max(0.0, deadline - time.monotonic()))
            if "ready" in line:
                self.ready = line
        return self

    def wait_line(self, timeout_s: float = 180.0) -> dict:
        """The next JSON line it prints; RuntimeError with the end of its log if it exits or
        takes longer than ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while b"\n" not in self._pending:
            remaining = deadline - time.monotonic()
            if self.process.poll() is not None or remaining <= 0:
                self.stop()
                log = self.log_path.read_text(errors="replace")[-3000:]
                command = f"python -m kvjax.cluster {' '.join(self.args)}"
                exited = self.process.returncode is not None and remaining > 0
                what = (f"exited with code {self.process.returncode} before it was ready" if exited else
                        f"did not get ready within {timeout_s}s")  # fmt: skip
                raise RuntimeError(f"`{command}` {what}; its log ends:\n{log}")
            readable, _, _ = select.select([self.process.stdout], [], [], min(remaining, 0.5))
            if readable:
                self._pending += os.read(self.process.stdout.fileno(), 4096)
        line, self._pending = self._pending.split(b"\n", 1)
        return json.loads(line.decode())

    @property
    def url(self) -> str:
        """What it serves at (the ready line's ``ready``)."""
        if self.ready is None:
            raise RuntimeError("not ready yet: call wait_ready()")
        return self.ready["ready"]

    @property
    def pid(self) -> int:
        return self.process.pid

    def stop(self, timeout_s: float = 30.0) -> None:
        """SIGTERM by pid (a clean shutdown: a node leaves the directory and drains its requests
        for up to its ``--drain-s``, 20 s by default), SIGKILL after ``timeout_s``; idempotent."""
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self._close()

    def kill(self) -> None:
        """SIGKILL by pid: a process that dies without cleaning up."""
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()
        self._close()

    def _close(self) -> None:
        self._log.close()
        if self.process.stdout is not None:
            self.process.stdout.close()
