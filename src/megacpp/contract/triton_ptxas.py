"""Which ptxas Triton will run for a device, and whether that ptxas knows the device's arch.

Triton compiles to PTX, then assembles with a ptxas binary bundled in its wheel. The target
it asks for is ``sm_<cc>`` plus an ``a`` suffix from sm_90 on (``sm_121a`` on a GB10).
Triton >= 3.6 bundles two assemblers and picks ``ptxas-blackwell`` for every arch >= 100;
each is overridden by its own environment variable. Preflight rule ``triton-ptxas-arch``
and the ``triton-system-ptxas`` patch both read :func:`ptxas_routing`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from megacpp.contract.compat import bundled_ptxas_from_table, min_cuda_for_target
from megacpp.contract.versions import version_at_least, version_tuple

# tool name -> the environment variable Triton reads to override that tool's path
PTXAS_ENV_VARS: dict[str, str] = {
    "ptxas": "TRITON_PTXAS_PATH",
    "ptxas-blackwell": "TRITON_PTXAS_BLACKWELL_PATH",
}
_FIRST_TRITON_WITH_BLACKWELL_PTXAS = "3.6"


@dataclass(frozen=True)
class PtxasRouting:
    """The assembler Triton will use for one device."""

    arch: str  # the device's arch, "sm_121"
    target: str  # what Triton passes to ptxas --gpu-name, "sm_121a"
    tool: str  # "ptxas" or "ptxas-blackwell"
    env_var: str  # the variable that overrides ``tool``
    path: str | None  # the binary Triton will run (None: unknown)
    version: str | None  # its CUDA version, "12.9.86" (None: unknown)
    overridden: bool  # True when ``env_var`` points somewhere
    needed_cuda: str | None  # oldest CUDA whose ptxas knows ``target`` (None: arch not tabled)

    @property
    def supported(self) -> bool | None:
        """Whether this ptxas accepts the target; ``None`` when either version is unknown."""
        if self.version is None or self.needed_cuda is None:
            return None
        return version_at_least(self.version, self.needed_cuda)

    def describe(self) -> str:
        origin = f"${self.env_var}" if self.overridden else f"Triton's bundled {self.tool}"
        version = self.version or "unknown version"
        return f"{origin} ({self.path or 'path unknown'}, CUDA {version})"


def cuda_arch(compute_capability: str) -> str:
    """``"12.1"`` -> ``"sm_121"``."""
    major, _, minor = compute_capability.partition(".")
    return f"sm_{int(major)}{int(minor or 0)}"


def triton_target(compute_capability: str) -> str:
    """The name Triton gives ptxas: ``sm_90a``, ``sm_100a``, ``sm_121a``; ``sm_80`` below 9.0."""
    arch = cuda_arch(compute_capability)
    return arch + "a" if int(compute_capability.partition(".")[0]) >= 9 else arch


def triton_tool_for(compute_capability: str, triton_version: str | None) -> str:
    """``ptxas-blackwell`` for arch >= 100 on Triton >= 3.6, else ``ptxas``."""
    major, _, minor = compute_capability.partition(".")
    arch_number = int(major) * 10 + int(minor or 0)
    blackwell_split = version_at_least(triton_version, _FIRST_TRITON_WITH_BLACKWELL_PTXAS)
    return "ptxas-blackwell" if blackwell_split and arch_number >= 100 else "ptxas"


def ptxas_routing(facts: dict[str, Any], device: dict[str, Any]) -> PtxasRouting | None:
    """How Triton would assemble for ``device``; ``None`` without Triton or a CUDA device."""
    triton = facts.get("triton")
    capability = device.get("compute_capability")
    if not triton or not capability:
        return None
    version = facts.get("packages", {}).get("triton")
    tool = triton_tool_for(capability, version)
    env_var = PTXAS_ENV_VARS[tool]
    override_value = (facts.get("env") or {}).get(env_var)
    if override_value:
        override = (triton.get("ptxas_overrides") or {}).get(env_var) or {}
        path, ptxas_version = (
            override.get("path") or override_value.split()[0],
            override.get("version"),
        )
    else:
        bundled = (triton.get("bundled_ptxas") or {}).get(tool) or {}
        path = bundled.get("path")
        ptxas_version = bundled.get("version") or bundled_ptxas_from_table(version).get(tool)
    target = triton_target(capability)
    return PtxasRouting(
        arch=cuda_arch(capability),
        target=target,
        tool=tool,
        env_var=env_var,
        path=path,
        version=ptxas_version,
        overridden=bool(override_value),
        needed_cuda=min_cuda_for_target(target),
    )


def system_ptxas(facts: dict[str, Any]) -> dict[str, Any] | None:
    """The CUDA toolkit's own ptxas captured in ``facts`` (``{"path", "version"}``) or None."""
    ptxas = (facts.get("toolchain") or {}).get("ptxas")
    return ptxas if ptxas and ptxas.get("path") and version_tuple(ptxas.get("version")) else None
