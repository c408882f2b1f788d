"""Typed, fail-closed reading of TOML files and tables into dataclasses (shared by the
model, run, data build and contract configs). Every error names the file or field and what
it accepts."""

from __future__ import annotations

import math
import os
import types
from collections.abc import Iterable
from dataclasses import fields
from typing import Any, get_args, get_type_hints

from megacpp._io import CONFIG_LIMIT, parse_toml_text, read_toml_bounded
from megacpp.errors import ConfigError

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1  # config integers reach torch and numpy as int64


def read_toml(path: str | os.PathLike[str], what: str) -> dict[str, Any]:
    """The parsed TOML file at ``path``; ``what`` names it in errors ("run config"). The file
    must be a regular file under the config size bound (:func:`megacpp._io.read_toml_bounded`)."""
    return read_toml_bounded(path, CONFIG_LIMIT, what=what, error=ConfigError)


def parse_toml(text: str, source: str) -> dict[str, Any]:
    """The parsed TOML ``text``; ``source`` (a path or a preset's name) starts its errors."""
    return parse_toml_text(text, source, ConfigError)


def check_keys(table: Any, known: Iterable[str], where: str) -> dict[str, Any]:
    """``table`` itself once it is a table whose keys are all in ``known``; ``where`` names it
    in errors ("[model]", "the build config")."""
    if not isinstance(table, dict):
        raise ConfigError(f"{where} must be a table, got {type(table).__name__}")
    known = sorted(known)
    unknown = sorted(set(table) - set(known))
    if unknown:
        raise ConfigError(f"unknown key(s) {unknown} in {where}; allowed: {known}")
    return table


def build_section(cls: type, table: Any, section: str, skip: frozenset[str] = frozenset()) -> Any:
    """``cls(**table)`` after rejecting unknown keys and coercing each value to its field's
    type (bool, int, float or str)."""
    hints = get_type_hints(cls)
    check_keys(table, {f.name for f in fields(cls)} - skip, f"[{section}]")
    return cls(
        **{key: coerce(value, hints[key], f"{section}.{key}") for key, value in table.items()}
    )


def coerce(value: Any, hint: Any, name: str) -> Any:
    """``value`` as a ``hint`` (bool, int, float -- ints accepted --, str, tuple[str, ...] from a
    list of strings, tuple[int, ...] from a list of integers, or a union of them such as
    ``bool | str``: the first that fits), or ConfigError."""
    if isinstance(hint, types.UnionType):
        for option in get_args(hint):
            try:
                return coerce(value, option, name)
            except ConfigError:
                continue
        names = " or ".join(getattr(option, "__name__", str(option)) for option in get_args(hint))
        raise ConfigError(f"{name} = {value!r}: expected a {names}")
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
    if hint == tuple[str, ...]:
        if isinstance(value, (list, tuple)) and all(isinstance(v, str) for v in value):
            return tuple(value)
        raise ConfigError(f"{name} = {value!r}: expected a list of strings")
    if hint == tuple[int, ...]:
        ints = isinstance(value, (list, tuple)) and all(
            isinstance(v, int) and not isinstance(v, bool) and INT64_MIN <= v <= INT64_MAX
            for v in value)
        if ints:
            return tuple(value)
        raise ConfigError(f"{name} = {value!r}: expected a list of integers")
    raise TypeError(f"unsupported config type {hint} for {name}")  # a bug, not user input


def check(ok: bool, name: str, value: Any, allowed: str) -> None:
    if not ok:
        raise ConfigError(f"{name} = {value!r} is invalid; allowed: {allowed}")


def choice(name: str, value: str, allowed: tuple[str, ...]) -> None:
    check(value in allowed, name, value, " | ".join(allowed))
