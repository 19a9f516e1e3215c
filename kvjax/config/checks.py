"""Checks of single arguments, shared by every layer: a bad value is refused by name, before
the caller changes anything."""

from __future__ import annotations

import numpy as np

__all__ = ["int_arg", "is_wildcard_host"]


def is_wildcard_host(host: str) -> bool:
    """Whether ``host`` (of a ``host:port``) means every interface: no peer can connect to it."""
    return host in ("", "0.0.0.0", "::", "[::]")


def int_arg(value, name: str, minimum: int = 0) -> int:
    """``value`` as a Python int >= ``minimum`` (numpy integers too); ValueError naming
    ``name`` for anything else: a float, a bool, a string, a smaller count."""
    if type(value) is int and value >= minimum:  # the common case first: allocate/extend call it every step
        return value
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
        raise ValueError(f"{name}={value!r} must be an int >= {minimum}")
    return int(value)
