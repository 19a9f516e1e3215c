"""Engine settings (the ``[engine]`` section of a preset): a frozen, validated dataclass."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from typing import Any

from kvjax.config.from_mapping import config_from_dict
from pallas_kernels.backend import resolve_impl

__all__ = ["EngineConfig"]


@dataclasses.dataclass(frozen=True, slots=True)
class EngineConfig:
    """How the engine runs its steps. Tokens and seconds as named.

    ``max_model_len``: longest sequence (prompt + generated tokens) a request may reach; None
    means the whole device pool. ``token_buckets``: the step's token-count ladder (powers of
    two; None: ``engine_step.default_token_buckets``). ``seed``: seeds sampled requests that
    bring no seed of their own. ``canonicalize``: canonicalize text prompts before tokenizing
    (``kvjax.text.canonicalize`` defaults; pass a ``CanonicalizeConfig`` to ``Engine`` for more).
    ``template_chars``: leading characters of a prompt that identify its template for miss
    attribution. ``impl``: kernel implementation (None: the backend's best).
    ``spill_ahead``: with lower tiers, evict cached device pages down to the pool's low
    watermark whenever a step ends above the high one (their host copies start early); off,
    pages leave the device only when their blocks are reallocated.
    """

    max_model_len: int | None = None
    token_buckets: tuple[int, ...] | None = None
    seed: int = 0
    canonicalize: bool = False
    template_chars: int = 256
    impl: str | None = None
    spill_ahead: bool = False

    def __post_init__(self):
        if self.max_model_len is not None and (not isinstance(self.max_model_len, int)
                                               or self.max_model_len < 2):
            raise ValueError(f"max_model_len={self.max_model_len!r} must be None or an int >= 2")
        if self.token_buckets is not None:
            buckets = self.token_buckets
            if not isinstance(buckets, (str, bytes)) and isinstance(buckets, Iterable):
                buckets = tuple(buckets)
            if not isinstance(buckets, tuple) or not all(isinstance(b, int) and not isinstance(b, bool)
                                                         for b in buckets):  # fmt: skip
                raise ValueError(f"token_buckets={self.token_buckets!r} must be a sequence of ints (token counts), "
                                 "or None")  # fmt: skip
            object.__setattr__(self, "token_buckets", buckets)
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or not 0 <= self.seed < 2**32:
            raise ValueError(f"seed={self.seed!r} must be an int in [0, 2**32)")
        for flag in ("canonicalize", "spill_ahead"):
            if not isinstance(getattr(self, flag), bool):
                raise ValueError(f"{flag}={getattr(self, flag)!r} must be a bool")
        if isinstance(self.template_chars, bool) or not isinstance(self.template_chars, int) \
                or self.template_chars < 1:  # fmt: skip
            raise ValueError(f"template_chars={self.template_chars!r} must be an int >= 1")
        if self.impl is not None:  # a misspelled [engine] impl failed only at the first step, requests queued
            resolve_impl(self.impl)

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> EngineConfig:
        """Build from a mapping (a TOML section); unknown keys raise ValueError."""
        return config_from_dict(cls, values, "engine config")
