"""Injected GPU facts for CPU tests (shared by tests/contract and tests/receipts).

GPU facts are the real fingerprint of this machine with the device-dependent fields
replaced, so rules and patches are exercised on a CPU exactly as they would read a
capture from a GB10, an H100 or any other device.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

FIXTURES = Path(__file__).parent / "fixtures"


def without_gpu(base: dict[str, Any]) -> dict[str, Any]:
    """``base`` as if captured on a CPU-only machine (identity on this CPU machine)."""
    facts = copy.deepcopy(base)
    facts.update(accelerator="cpu", devices=[], driver=None, triton=None)
    facts["torch"] = {**(facts["torch"] or {}), "cuda": None}
    facts["packages"]["triton"] = None
    return facts


def with_gpu(
    base: dict[str, Any],
    *,
    name: str,
    cc: str,
    sm_count: int,
    smem: int | None,
    triton: str | None = "3.5.0",
    bundled: dict[str, str] | None = None,
    system_ptxas: str | None = "13.0.88",
    torch_cuda: str = "13.0",
    driver: str = "580.95.05",
    driver_cuda: str | None = "13.0",
    env: dict[str, str] | None = None,
    count: int = 1,
) -> dict[str, Any]:
    """``base`` as if captured on ``count`` GPUs of one kind with the given stack."""
    facts = copy.deepcopy(base)
    major, minor = cc.split(".")
    facts["accelerator"] = "cuda"
    facts["devices"] = [
        {
            "index": i,
            "name": name,
            "compute_capability": cc,
            "arch": f"sm_{major}{minor}",
            "sm_count": sm_count,
            "smem_per_block_optin_bytes": smem,
            "smem_per_sm_bytes": None,
            "total_memory_bytes": 128 * 2**30,
            "l2_cache_bytes": None,
        }
        for i in range(count)
    ]
    facts["torch"] = {**(facts["torch"] or {}), "cuda": torch_cuda}
    facts["driver"] = {"version": driver, "cuda_version": driver_cuda, "source": "test"}
    facts["packages"]["triton"] = triton
    bundled = bundled if bundled is not None else {"ptxas": "12.8.93"}
    facts["triton"] = (
        None
        if triton is None
        else {
            "bundled_ptxas": {
                tool: {"path": f"/site/triton/backends/nvidia/bin/{tool}", "version": v}
                for tool, v in bundled.items()
            },
            "ptxas_overrides": {},
        }
    )
    facts["toolchain"]["ptxas"] = (
        {"path": "/usr/local/cuda/bin/ptxas", "version": system_ptxas} if system_ptxas else None
    )
    facts["env"] = dict(env or {})
    for var, value in facts["env"].items():
        if var.startswith("TRITON_PTXAS") and facts["triton"] is not None:
            version = system_ptxas if value == "/usr/local/cuda/bin/ptxas" else None
            facts["triton"]["ptxas_overrides"][var] = {"path": value, "version": version}
    return facts


def gb10(base: dict[str, Any], **kwargs: Any) -> dict[str, Any]:
    """A DGX Spark: GB10, cc 12.1, 48 SMs, 99 KiB of shared memory per block."""
    return with_gpu(base, name="NVIDIA GB10", cc="12.1", sm_count=48, smem=101376, **kwargs)


def h100(base: dict[str, Any], **kwargs: Any) -> dict[str, Any]:
    """An H100 SXM: cc 9.0, 132 SMs, 227 KiB of shared memory per block."""
    return with_gpu(
        base, name="NVIDIA H100 80GB HBM3", cc="9.0", sm_count=132, smem=232448, **kwargs
    )


def write_json(path: Path, data: Any) -> Path:
    path.write_text(json.dumps(data))
    return path
