"""Shared builders for the disk tier tests: a small tier, its blocks, an unwritable directory."""

import contextlib
import errno
import glob
import os
import subprocess

import tier_cases

from kvjax.tiers import disk_segments
from kvjax.tiers.disk_tier import DiskTier

BLOCK_SHAPE = (2, 2, 4, 8)
NS = b"N" * 16
OTHER_NS = b"O" * 16


def random_blocks(n, dtype="float32", seed=0):
    return tier_cases.random_blocks(n, BLOCK_SHAPE, dtype, seed)


def block_bytes(dtype="float32"):
    return tier_cases.block_bytes(BLOCK_SHAPE, dtype)


def make_tier(path, dtype="float32", capacity=1 << 20, blocks_per_segment=4, **kw):
    return DiskTier(str(path), BLOCK_SHAPE, dtype, capacity,
                    segment_bytes=blocks_per_segment * block_bytes(dtype), **kw)


def segment_dirs(path):
    return sorted(p for p in glob.glob(os.path.join(path, "seg-*")) if os.path.isdir(p))


@contextlib.contextmanager
def unwritable(path, monkeypatch):
    """Makes `path` refuse new entries: immutable flag, else mode bits, else a failing write."""
    if subprocess.run(["chattr", "+i", str(path)], check=False, capture_output=True).returncode == 0:
        try:
            yield
        finally:
            subprocess.run(["chattr", "-i", str(path)], check=True)
    elif os.geteuid() != 0:
        os.chmod(path, 0o555)
        try:
            yield
        finally:
            os.chmod(path, 0o755)
    else:
        def refuse(*args, **kwargs):
            raise PermissionError(errno.EACCES, "Permission denied", str(path))
        with monkeypatch.context() as patch:
            patch.setattr(disk_segments, "_save_payload", refuse)
            yield


def dir_bytes(path):
    """Bytes of every file under `path` (segments, manifests, the lock file)."""
    return sum(os.path.getsize(os.path.join(root, name)) for root, _, names in os.walk(path) for name in names)


@contextlib.contextmanager
def unreadable(segment, monkeypatch):
    """Makes a segment's files refuse reads: mode 000, or as root (whom modes do not stop) the
    errors such a read raises: TensorStore's PERMISSION_DENIED, then orbax's PermissionError."""
    files = [os.path.join(root, name) for root, _, names in os.walk(segment) for name in names]
    if os.geteuid() != 0:
        modes = {path: os.stat(path).st_mode for path in files}
        for path in files:
            os.chmod(path, 0o000)
        try:
            yield
        finally:
            for path, mode in modes.items():
                os.chmod(path, mode)
        return

    open_payload, restore_payload = disk_segments._open_payload, disk_segments._restore_payload

    def refuse_open(path, use_ocdbt):
        if os.path.abspath(path) != os.path.abspath(segment):
            return open_payload(path, use_ocdbt)
        raise ValueError(f'PERMISSION_DENIED: Error opening "zarr3" driver: Error reading local file '
                         f'"{path}/payload/zarr.json": Failed to open: Permission denied [os_error_code=\'13\']')

    def refuse_restore(checkpointer, path):
        if os.path.abspath(path) != os.path.abspath(segment):
            return restore_payload(checkpointer, path)
        raise PermissionError(errno.EACCES, "Permission denied", path)
    with monkeypatch.context() as patch:
        patch.setattr(disk_segments, "_open_payload", refuse_open)
        patch.setattr(disk_segments, "_restore_payload", refuse_restore)
        yield
