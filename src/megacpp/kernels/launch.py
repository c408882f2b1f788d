"""Launch configurations as read-only data: the Triton launch options of one kernel, and the
lookup of an op's configuration table by the device's compute capability.

Every ``ops/<surface>/configs.py`` keeps its table as a read-only mapping from a device key
(``"9.0"`` for compute capability 9.0) to frozen dataclasses; ``"default"`` serves every
device without an entry of its own, and the CPU (the Triton interpreter). A launcher takes
its configuration as an argument, defaulting to this lookup, so a sweep passes candidates
instead of changing module state. Where a tuning script writes the table, it is a JSON file
beside ``configs.py`` (:func:`read_table`, :func:`write_entry`): the tuner writes data, and
the validation and the reasons behind each setting stay in code and prose that it does not
rewrite.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from types import MappingProxyType
from typing import Any, TypeVar

import torch

from megacpp._config import check_keys
from megacpp._io import atomic_write_text
from megacpp.errors import ConfigError
from megacpp.kernels.device import capability

DEFAULT = "default"
T = TypeVar("T")


@dataclass(frozen=True)
class Launch:
    """Triton launch options of one kernel (``None``: Triton's default)."""

    num_warps: int = 4
    num_stages: int | None = None
    maxnreg: int | None = None

    def options(self) -> dict[str, int]:
        """The keyword arguments of a launch (the options that are set)."""
        values = {"num_warps": self.num_warps, "num_stages": self.num_stages,
                  "maxnreg": self.maxnreg}
        return {name: value for name, value in values.items() if value is not None}


@functools.cache
def device_key(device: torch.device) -> str:
    """``"9.0"`` for a CUDA device of compute capability 9.0; :data:`DEFAULT` elsewhere."""
    if device.type != "cuda":
        return DEFAULT
    major, minor = capability(device)
    return f"{major}.{minor}"


def for_device(table: Mapping[str, T], device: torch.device) -> T:
    """The entry of ``table`` for ``device``'s capability, else its :data:`DEFAULT` entry."""
    return for_key(table, device_key(device))


def for_key(table: Mapping[str, T], key: str) -> T:
    """``table[key]`` when the table has an entry for that device key, else its default."""
    return table[key] if key in table else table[DEFAULT]


# -- tables a tuner writes: a JSON file beside the op's configs.py -----------------------------
def read_table(path: Path, parse: Callable[[Any, str], T]) -> Mapping[str, T]:
    """The JSON table at ``path`` ({device key: entry}, with a :data:`DEFAULT` entry) as a
    read-only mapping of ``parse(entry, where)`` results."""
    data = json.loads(path.read_text(encoding="utf-8"))
    if not isinstance(data, dict) or DEFAULT not in data:
        raise ConfigError(f"{path}: a table of device keys with a {DEFAULT!r} entry is needed")
    return MappingProxyType({key: parse(entry, f"{path.name}[{key!r}]")
                             for key, entry in data.items()})


def write_entry(path: Path, key: str, entry: Any) -> None:
    """Set ``key``'s entry of the JSON table at ``path`` (a tuner's result for one device),
    keeping the others; written atomically."""
    data = json.loads(path.read_text(encoding="utf-8"))
    data[key] = entry
    atomic_write_text(path, json.dumps(data, indent=1) + "\n")


def int_fields(cls: type[T], table: Any, where: str) -> T:
    """``cls(**table)`` for a dataclass of positive int fields, every field given once."""
    names = [f.name for f in fields(cls)]
    check_keys(table, names, where)
    missing = [name for name in names if name not in table]
    bad = {k: v for k, v in table.items() if type(v) is not int or v < 1}
    if missing or bad:
        raise ConfigError(f"{where}: needs every one of {names} as a positive integer "
                          f"(missing {missing}, invalid {bad})")
    return cls(**table)
