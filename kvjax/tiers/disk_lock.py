"""Who owns a disk tier's directory: one writer, or any number of read-only readers.

A ``DiskTier`` holds an advisory ``fcntl.flock`` on ``<directory>/kvjax-disk.lock`` for its
lifetime: exclusive to write, shared to read only. A writer records who it is in the file
(``pid=<pid> host=<host> since=<UTC time>``) so that the next opener's error names it, and
empties the file when it lets go.

Why flock: its locks belong to an open file, so a second tier in the same process conflicts
like one in another process, and the kernel drops them when the process exits, even on a
crash; a lock file left behind is harmless, only a held lock counts. This process also keeps
its own table of the directories it holds (by real path), so a second tier in it is refused
even on a filesystem that emulates flock with per-process POSIX locks (NFS on Linux).

The lock is advisory: it stops kvjax, not a process that writes there without asking.
"""

from __future__ import annotations

import datetime
import errno
import fcntl
import logging
import os
import socket
import threading
import weakref

__all__ = ["LOCK_FILE", "DirectoryInUseError", "DirectoryLock"]

LOCK_FILE = "kvjax-disk.lock"
_log = logging.getLogger(__name__)
_NO_ACCESS = (errno.EACCES, errno.EPERM, errno.EROFS)

# Directories this process holds: real path -> [shared, count]. A writer's count is 1.
_held: dict[str, list] = {}
_lock_fds: set[int] = set()  # the descriptors of the lock files this process holds
_held_lock = threading.RLock()  # re-entrant: a finalizer may run (GC) while this thread holds it


def _forget_in_child() -> None:
    """After a fork: the child holds nothing. It closes its copies of the lock descriptors, so
    that a child outliving its parent (killed, or closed its tier) does not keep the directory
    locked, and forgets the directories (its finalizers then leave those descriptor numbers,
    which it may reuse, alone)."""
    for fd in _lock_fds:
        try:
            os.close(fd)
        except OSError:
            pass
    _lock_fds.clear()
    _held.clear()


os.register_at_fork(after_in_child=_forget_in_child)


class DirectoryInUseError(ValueError):
    """A disk tier's directory is locked by another ``DiskTier`` (in this process or another)."""


class DirectoryLock:
    """The lock of one directory, taken at construction, held until ``release`` (or until
    this object is garbage-collected, or the process exits).

    ``shared``: a read-only reader's lock (any number at once, none while a writer holds it).
    Raises ``DirectoryInUseError`` naming the directory and the holder when it is taken. A
    writer whose lock file can neither be opened nor created gets a PermissionError naming
    it (it could write the directory beside a writer that holds the lock); a reader's leaves
    the directory unlocked (a read-only directory without one): ``held`` is False and a
    warning says so.
    """

    def __init__(self, directory: str, *, shared: bool):
        self.directory = directory
        self.path = os.path.join(directory, LOCK_FILE)
        self.shared = shared
        self._key = os.path.realpath(directory)
        with _held_lock:
            _check_this_process(self._key, self.directory, shared)
            fd, writable, refused = _open_lock_file(self.path, shared)
            if fd is None and not shared:
                raise PermissionError(refused.errno, f"disk directory {directory}: its lock file can be neither "
                                      f"opened nor created ({refused.strerror}); a writing DiskTier needs it "
                                      "(read_only=True serves the directory without writing)", self.path)
            if fd is not None:
                try:
                    _flock(fd, self.directory, self.path, shared)
                except BaseException:
                    os.close(fd)
                    raise
            entry = _held.setdefault(self._key, [shared, 0])
            entry[1] += 1
            if fd is not None:
                _lock_fds.add(fd)
        self.held = fd is not None
        if fd is None:
            _log.warning("disk tier: %s cannot be opened or created; %s is not locked against "
                         "other writers", self.path, directory)
        elif writable and not shared:
            _record_holder(fd)
        # Released when this object goes (or at exit) even if nobody calls release().
        self._finalizer = weakref.finalize(self, _release, fd, self._key, writable and not shared, os.getpid())

    def release(self) -> None:
        """Lets go of the lock (idempotent)."""
        self._finalizer()


def _holder_of(path: str) -> str:
    """Who the lock file at ``path`` says holds it, in words."""
    try:
        with open(path, "rb") as f:
            fields = dict(part.split("=", 1) for part in f.read(4096).decode().split() if "=" in part)
    except (OSError, UnicodeDecodeError):
        fields = {}
    if "pid" not in fields:
        return "another process (no holder recorded yet)"
    where = f"pid {fields['pid']} on host {fields.get('host', '?')}"
    return f"{where} since {fields['since']}" if "since" in fields else where


def _check_this_process(key: str, directory: str, shared: bool) -> None:
    entry = _held.get(key)
    if entry is not None and not (shared and entry[0]):
        what = "a read-only DiskTier" if entry[0] else "a DiskTier"
        raise DirectoryInUseError(f"disk directory {directory} is in use by this process (pid {os.getpid()}): "
                                  f"{what} holds it; close() that one first or use another directory")


def _open_lock_file(path: str, shared: bool) -> tuple[int | None, bool, OSError | None]:
    """(fd, writable, None), or (None, False, the error) when the file can be neither opened
    nor created."""
    modes = (os.O_RDONLY | os.O_CREAT, os.O_RDONLY) if shared else (os.O_RDWR | os.O_CREAT, os.O_RDONLY)
    refused = None
    for mode in modes:
        try:
            return os.open(path, mode | os.O_CLOEXEC, 0o644), bool(mode & os.O_RDWR), None
        except FileNotFoundError as err:
            refused = refused or err
        except OSError as err:
            if err.errno not in _NO_ACCESS:
                raise
            refused = refused or err
    return None, False, refused


def _flock(fd: int, directory: str, path: str, shared: bool) -> None:
    try:
        fcntl.flock(fd, (fcntl.LOCK_SH if shared else fcntl.LOCK_EX) | fcntl.LOCK_NB)
        return
    except BlockingIOError:
        pass
    holder = _holder_of(path)
    if not shared:  # a writer was refused: by readers (a shared lock is free) or by a writer
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            fcntl.flock(fd, fcntl.LOCK_UN)
            holder = "another process that opened it read-only"
        except BlockingIOError:
            pass
    raise DirectoryInUseError(f"disk directory {directory} is in use by {holder} (lock file {path}); "
                              "one DiskTier writes a directory at a time: close that one or use another directory")


def _record_holder(fd: int) -> None:
    since = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    record = f"pid={os.getpid()} host={socket.gethostname()} since={since}\n".encode()
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, record, 0)
    except OSError as err:  # the lock holds all the same; only the error message is poorer
        _log.warning("disk tier: could not record the lock holder: %s", err)


def _release(fd: int | None, key: str, clear: bool, owner_pid: int) -> None:
    if os.getpid() != owner_pid:  # a forked child's copy: closed at the fork (_forget_in_child)
        return
    with _held_lock:
        entry = _held.get(key)
        if entry is not None:
            entry[1] -= 1
            if entry[1] <= 0:
                del _held[key]
        if fd is None:
            return
        _lock_fds.discard(fd)
        try:
            if clear:
                os.ftruncate(fd, 0)
            fcntl.flock(fd, fcntl.LOCK_UN)  # now, even if some descriptor of this open file lives on
        except OSError:
            pass
        finally:
            os.close(fd)
