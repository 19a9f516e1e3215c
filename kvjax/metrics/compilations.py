"""Counting the XLA executables this process builds, from any thread.

A step or a move between tiers that meets a new shape builds an executable: seconds of
compilation on CPU, or a load from JAX's persistent compilation cache. Serving should build
none after warm-up; ``CompileCount`` says whether it did::

    count = CompileCount()
    engine.warmup()
    after_warmup = count.value
    ...                                   # serve
    assert count.value == after_warmup    # nothing compiled while serving

Counts come from ``jax.monitoring``: one per ``backend_compile_duration`` event, which JAX
records around compiling *or* loading an executable from the persistent cache (counting the
cache's own hit event as well counted every load twice). They are process-wide: two engines
serving at once in one process see each other's builds.
"""

from __future__ import annotations

import threading

import jax

__all__ = ["CompileCount", "compilations"]

_BACKEND_COMPILE = "/jax/core/compile/backend_compile_duration"

_lock = threading.Lock()
_total = 0
_registered = False


def _on_duration(event: str, duration_secs: float, **kwargs) -> None:
    global _total
    if event == _BACKEND_COMPILE:
        with _lock:
            _total += 1


def compilations() -> int:
    """Executables built (compiled or loaded from the persistent cache) in this process since
    the first call of this function or a ``CompileCount`` (the listeners go in then)."""
    global _registered
    with _lock:
        if not _registered:
            jax.monitoring.register_event_duration_secs_listener(_on_duration)
            _registered = True
        return _total


class CompileCount:
    """Executables built in this process since construction (``value``)."""

    def __init__(self):
        self._start = compilations()

    @property
    def value(self) -> int:
        return compilations() - self._start
