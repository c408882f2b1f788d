"""Readers for ``compat.toml``: arch -> minimum CUDA, CUDA -> minimum driver, Triton's ptxas.

The tables carry their sources in the TOML file; these functions only look rows up.
"""

from __future__ import annotations

import functools
import tomllib
from importlib import resources
from typing import Any

from megacpp.contract.versions import short_version, version_at_least, version_tuple


@functools.cache
def _tables() -> dict[str, Any]:
    text = resources.files("megacpp.contract").joinpath("compat.toml").read_text("utf-8")
    return tomllib.loads(text)


def min_cuda_for_target(target: str) -> str | None:
    """Oldest CUDA toolkit whose ptxas accepts ``target`` (e.g. ``"sm_121a"`` -> ``"12.9"``)."""
    return _tables()["arch_min_cuda"].get(target)


def min_driver_for_cuda(cuda: str) -> str | None:
    """Minimum Linux driver for the CUDA ``major.minor`` of ``cuda``; ``None`` if not tabled."""
    wanted = short_version(cuda, 2)
    for row in _tables()["cuda_driver"]:
        if row["cuda"] == wanted:
            return row["min_driver"]
    return None


def newest_tabled_cuda() -> str:
    """The newest CUDA version in the driver table (derivations beyond it are unknowable)."""
    return max((row["cuda"] for row in _tables()["cuda_driver"]), key=version_tuple)


def cuda_supported_by_driver(driver: str) -> str | None:
    """Highest tabled CUDA version whose minimum driver is ``<= driver`` (a lower bound)."""
    best: str | None = None
    for row in _tables()["cuda_driver"]:
        if version_at_least(driver, row["min_driver"]) and (
            best is None or version_tuple(row["cuda"]) > version_tuple(best)
        ):
            best = row["cuda"]
    return best


def bundled_ptxas_from_table(triton_version: str | None) -> dict[str, str]:
    """``{"ptxas": "12.8.93", "ptxas-blackwell": "12.9.86"}`` for a Triton release, or ``{}``."""
    wanted = short_version(triton_version, 2)
    for row in _tables()["triton_ptxas"]:
        if row["triton"] == wanted:
            tools = {"ptxas": row["ptxas"]}
            if "ptxas_blackwell" in row:
                tools["ptxas-blackwell"] = row["ptxas_blackwell"]
            return tools
    return {}
