"""Presets: named TOML files of engine settings that ship inside the package.

A preset is either a name (``"tiny"``: the shipped ``tiny.toml``) or the path of a TOML file.
The shipped ones live in the checkout's top-level ``configs/`` folder, which the wheel installs
as the package data of ``kvjax.presets`` (``setup.cfg`` maps the folder onto that package), so
one set of files serves both a checkout and an installed wheel.

A preset's sections are read by ``kvjax.serving.preset``; one top-level key is read here:
``weights = "tiny.npz"`` names a weights file relative to the TOML file, and comes back as an
absolute path.
"""

from __future__ import annotations

import os
import re
import tomllib
from pathlib import Path
from typing import Any

__all__ = ["PRESET_SECTIONS", "load_preset", "preset_dir", "preset_names"]

_INSTALLED = Path(__file__).resolve().parents[1] / "presets"  # kvjax/presets in a wheel
_CHECKOUT = Path(__file__).resolve().parents[2] / "configs"  # the source checkout
_TOML_POSITION = re.compile(r"\s*\(at line (\d+), column (\d+)\)$")


def preset_dir() -> Path:
    """The folder of the shipped presets: ``kvjax/presets`` when installed from a wheel, the
    checkout's ``configs/`` otherwise (a checkout on the path, or an editable install)."""
    return _INSTALLED if _INSTALLED.is_dir() else _CHECKOUT


def preset_names() -> list[str]:
    """Names of the shipped presets, sorted."""
    return sorted(path.stem for path in preset_dir().glob("*.toml"))


PRESET_SECTIONS = ("weights", "model", "cache", "tiers", "scheduler", "engine")
"""The top-level names a preset may have: ``weights`` (a file name) and five tables."""


def load_preset(preset: str | os.PathLike) -> dict[str, Any]:
    """The contents of a preset (a shipped name or a ``.toml`` path) as a dict of sections.

    Raises ValueError naming the value and what was expected: an unknown name (listing the
    shipped ones), a path that is not a file, text that is not UTF-8 or not valid TOML (with the
    file, line and column), or a ``weights`` entry that is not a string.
    """
    path = _resolve(preset)
    try:
        text = path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as error:
        raise ValueError(f"{path}: not UTF-8 text ({error.reason} at byte {error.start}); "
                         "expected a TOML preset") from None
    try:
        sections = tomllib.loads(text)
    except tomllib.TOMLDecodeError as error:
        raise ValueError(_toml_error(path, str(error))) from None
    unknown = sorted(set(sections) - set(PRESET_SECTIONS))
    if unknown:  # a misspelled [tier] used to leave the tiers out silently, a 'weight =' the weights
        raise ValueError(f"{path}: unknown top-level names {unknown}; expected some of {list(PRESET_SECTIONS)}")
    for name, value in sections.items():
        if name != "weights" and not isinstance(value, dict):
            raise ValueError(f"{path}: {name} = {value!r} must be a [{name}] table")
    weights = sections.get("weights")
    if weights is not None:
        if not isinstance(weights, str) or not weights:
            raise ValueError(f"{path}: weights={weights!r} must be the name of a weights file "
                             "beside the preset, e.g. \"tiny.npz\"")
        sections["weights"] = str(path.parent / weights)
    return sections


def _resolve(preset: str | os.PathLike) -> Path:
    if not isinstance(preset, (str, os.PathLike)):
        raise ValueError(f"preset={preset!r} must be a preset name or the path of a .toml file")
    text = os.fspath(preset)
    if text.endswith(".toml") or os.sep in text or (os.altsep and os.altsep in text):
        path = Path(text).expanduser().resolve()  # absolute: the weights beside it must not follow the cwd
        if not path.is_file():
            problem = "is a directory" if path.is_dir() else "does not exist"
            raise ValueError(f"preset file {text!r} {problem}; expected a TOML file")
        return path
    path = preset_dir() / f"{text}.toml"
    if not text or not path.is_file():
        raise ValueError(f"preset {text!r} is not a shipped preset; expected one of "
                         f"{preset_names()} or the path of a .toml file")
    return path


def _toml_error(path: Path, message: str) -> str:
    """``file:line:column: invalid TOML: what`` from tomllib's message, which ends in the
    position as text (Python 3.12 has no attributes for it)."""
    found = _TOML_POSITION.search(message)
    if found is None:
        return f"{path}: invalid TOML: {message}"
    line, column = found.groups()
    return f"{path}:{line}:{column}: invalid TOML: {message[: found.start()]}"
