"""Building frozen config dataclasses from plain mappings (TOML sections, JSON)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, TypeVar

__all__ = ["config_from_dict"]

T = TypeVar("T")


def config_from_dict(cls: type[T], values: Mapping[str, Any], what: str) -> T:
    """``cls(**values)``, but an unknown key is a ``ValueError`` listing the known ones.

    ``what`` names the config in the message, e.g. ``"pool config"``.
    """
    known = [field.name for field in dataclasses.fields(cls)]
    unknown = sorted(set(values) - set(known))
    if unknown:
        raise ValueError(f"unknown {what} keys {unknown}; expected some of {known}")
    return cls(**values)
