"""Typed, fail-closed reading of TOML tables into frozen dataclasses (shared by the model
and run configs). Every error names the field and what it accepts."""

from __future__ import annotations

import math
from dataclasses import fields
from typing import Any, get_type_hints

from megacpp.errors import ConfigError

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1  # config integers reach torch and numpy as int64


def build_section(cls: type, table: Any, section: str, skip: frozenset[str] = frozenset()) -> Any:
    """``cls(**table)`` after rejecting unknown keys and coercing each value to its field's
    type (bool, int, float or str)."""
    if not isinstance(table, dict):
        raise ConfigError(f"[{section}] must be a table, got {type(table).__name__}")
    hints = get_type_hints(cls)
    known = sorted({f.name for f in fields(cls)} - skip)
    unknown = sorted(set(table) - set(known))
    if unknown:
        raise ConfigError(f"unknown key(s) {unknown} in [{section}]; allowed: {known}")
    return cls(
        **{key: coerce(value, hints[key], f"{section}.{key}") for key, value in table.items()}
    )


def coerce(value: Any, hint: Any, name: str) -> Any:
    """``value`` as a ``hint`` (bool, int, float -- ints accepted -- or str), or ConfigError."""
    if hint is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{name} = {value!r}: expected true or false")
    if hint is int:
        is_int = isinstance(value, int) and not isinstance(value, bool)
        if is_int and INT64_MIN <= value <= INT64_MAX:
            return value
        raise ConfigError(f"{name} = {value!r}: expected an integer (64-bit)")
    if hint is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
            return float(value)
        raise ConfigError(f"{name} = {value!r}: expected a finite number")
    if hint is str:
        if isinstance(value, str):
            return value
        raise ConfigError(f"{name} = {value!r}: expected a string")
    raise TypeError(f"unsupported config type {hint} for {name}")  # a bug, not user input


def check(ok: bool, name: str, value: Any, allowed: str) -> None:
    if not ok:
        raise ConfigError(f"{name} = {value!r} is invalid; allowed: {allowed}")


def choice(name: str, value: str, allowed: tuple[str, ...]) -> None:
    check(value in allowed, name, value, " | ".join(allowed))
