"""Launch configurations as read-only data: the Triton launch options of one kernel, and the
lookup of an op's configuration table by the device's compute capability.

Every ``ops/<surface>/configs.py`` keeps its table as a read-only mapping from a device key
(``"9.0"`` for compute capability 9.0) to frozen dataclasses; ``"default"`` serves every
device without an entry of its own, and the CPU (the Triton interpreter). A launcher takes
its configuration as an argument, defaulting to this lookup, so a sweep passes candidates
instead of changing module state.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TypeVar

import torch

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
    key = device_key(device)
    return table[key] if key in table else table[DEFAULT]
