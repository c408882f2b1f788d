"""Low-level probes of the machine: tools on PATH, the NVIDIA driver, GPUs, Triton's ptxas.

Every probe returns ``None`` (or an empty value) when the thing is absent -- no GPU, no
nvcc, no git, no driver library -- and never raises for that. ``env`` is the environment
whose ``PATH`` and variables are consulted (``os.environ`` by default), so tests can point
at a PATH without the tool.
"""

from __future__ import annotations

import ctypes
import importlib.util
import os
import platform
import re
import shutil
import subprocess
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from megacpp.contract.triton_ptxas import PTXAS_ENV_VARS, cuda_arch

_TOOL_TIMEOUT_S = 20
_CUDA_TOOL_RELEASE = re.compile(r"release \d+\.\d+, V(\d+\.\d+\.\d+)")
_SMI_DRIVER = re.compile(r"Driver Version:\s*([\d.]+)")
_SMI_CUDA = re.compile(r"CUDA Version:\s*([\d.]+)")


def which(name: str, env: Mapping[str, str]) -> str | None:
    """``shutil.which`` against ``env["PATH"]``."""
    return shutil.which(name, path=env.get("PATH", ""))


def run_tool(argv: list[str], env: Mapping[str, str]) -> str | None:
    """stdout of ``argv`` (resolved on ``env``'s PATH), or ``None`` if absent or failing."""
    executable = argv[0] if os.path.isabs(argv[0]) else which(argv[0], env)
    if executable is None or not os.access(executable, os.X_OK):
        return None
    try:
        done = subprocess.run(
            [executable, *argv[1:]],
            capture_output=True, check=False,
            text=True,
            timeout=_TOOL_TIMEOUT_S,
            env=dict(env),
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout if done.returncode == 0 else None


def cuda_tool_version(executable: str, env: Mapping[str, str]) -> str | None:
    """``"13.0.88"`` from ``nvcc --version`` / ``ptxas --version`` output."""
    output = run_tool([executable, "--version"], env)
    match = _CUDA_TOOL_RELEASE.search(output or "")
    return match.group(1) if match else None


def find_cuda_tool(name: str, env: Mapping[str, str]) -> str | None:
    """A CUDA toolkit binary: on PATH, else under ``$CUDA_HOME/bin`` or ``/usr/local/cuda/bin``."""
    on_path = which(name, env)
    if on_path:
        return on_path
    for home in (env.get("CUDA_HOME"), env.get("CUDA_PATH"), "/usr/local/cuda"):
        candidate = Path(home or "", "bin", name)
        if home and candidate.is_file() and os.access(candidate, os.X_OK):
            return str(candidate)
    return None


def toolchain(env: Mapping[str, str]) -> dict[str, Any]:
    """nvcc, the system ptxas, gcc and g++ versions (each ``None`` when absent)."""
    nvcc = find_cuda_tool("nvcc", env)
    ptxas = find_cuda_tool("ptxas", env)
    return {
        "nvcc": cuda_tool_version(nvcc, env) if nvcc else None,
        "ptxas": {"path": ptxas, "version": cuda_tool_version(ptxas, env)} if ptxas else None,
        "gcc": _gnu_version("gcc", env),
        "gxx": _gnu_version("g++", env),
    }


def _gnu_version(compiler: str, env: Mapping[str, str]) -> str | None:
    output = (run_tool([compiler, "-dumpfullversion", "-dumpversion"], env) or "").strip()
    return output or None


def host(env: Mapping[str, str]) -> dict[str, Any]:
    """Hostname, OS, kernel, CPU and memory -- informational fields."""
    return {
        "hostname": platform.node() or None,
        "os": _os_name(),
        "kernel": platform.release() or None,
        "machine": platform.machine() or None,
        "cpu_model": _cpu_model(),
        "cpu_count": os.cpu_count(),
        "memory_bytes": _memory_bytes(),
    }


def _os_name() -> str:
    try:
        for line in Path("/etc/os-release").read_text().splitlines():
            if line.startswith("PRETTY_NAME="):
                return line.split("=", 1)[1].strip().strip('"')
    except OSError:
        pass
    return platform.platform()


def _cpu_model() -> str | None:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith(("model name", "hardware", "cpu model")):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or None


def _memory_bytes() -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def driver(env: Mapping[str, str]) -> dict[str, Any] | None:
    """NVIDIA driver version and the CUDA version it supports, via NVML, else nvidia-smi."""
    return _driver_from_nvml() or _driver_from_nvidia_smi(env)


def _driver_from_nvml() -> dict[str, Any] | None:
    try:
        nvml = ctypes.CDLL("libnvidia-ml.so.1")
    except OSError:
        return None
    if nvml.nvmlInit_v2() != 0:
        return None
    try:
        text = ctypes.create_string_buffer(96)
        version = text.value.decode() if nvml.nvmlSystemGetDriverVersion(text, 96) == 0 else None
        cuda = ctypes.c_int(0)
        ok = nvml.nvmlSystemGetCudaDriverVersion_v2(ctypes.byref(cuda)) == 0
    finally:
        nvml.nvmlShutdown()
    cuda_version = f"{cuda.value // 1000}.{cuda.value % 1000 // 10}" if ok else None
    return {"version": version, "cuda_version": cuda_version, "source": "nvml"}


def _driver_from_nvidia_smi(env: Mapping[str, str]) -> dict[str, Any] | None:
    output = run_tool(["nvidia-smi"], env)
    driver_match = _SMI_DRIVER.search(output or "")
    if not driver_match:
        return None
    cuda_match = _SMI_CUDA.search(output or "")
    return {
        "version": driver_match.group(1),
        "cuda_version": cuda_match.group(1) if cuda_match else None,
        "source": "nvidia-smi",
    }


def torch_build() -> dict[str, Any] | None:
    """What torch was built with: CUDA runtime, cuDNN, NCCL, HIP, git revision."""
    try:
        import torch
    except ImportError:
        return None
    nccl = None
    if torch.cuda.is_available():
        try:
            nccl = ".".join(str(p) for p in torch.cuda.nccl.version())
        except (AttributeError, RuntimeError):
            nccl = None
    cudnn = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    return {
        "cuda": torch.version.cuda,
        "hip": torch.version.hip,
        "cudnn": cudnn,
        "nccl": nccl,
        "git_version": torch.version.git_version,
    }


def cuda_devices() -> list[dict[str, Any]]:
    """One entry per visible CUDA device; ``[]`` without a GPU or a CUDA build of torch."""
    try:
        import torch
    except ImportError:
        return []
    if not torch.cuda.is_available():
        return []
    return [
        _device_entry(index, torch.cuda.get_device_properties(index))
        for index in range(torch.cuda.device_count())
    ]


def _device_entry(index: int, props: Any) -> dict[str, Any]:
    capability = f"{props.major}.{props.minor}"
    return {
        "index": index,
        "name": props.name,
        "compute_capability": capability,
        "arch": cuda_arch(capability),
        "sm_count": props.multi_processor_count,
        "smem_per_block_optin_bytes": getattr(props, "shared_memory_per_block_optin", None),
        "smem_per_sm_bytes": getattr(props, "shared_memory_per_multiprocessor", None),
        "total_memory_bytes": props.total_memory,
        "l2_cache_bytes": getattr(props, "L2_cache_size", None),
    }


def triton_ptxas(env: Mapping[str, str]) -> dict[str, Any] | None:
    """Triton's bundled ptxas binaries and any overrides, without importing Triton."""
    spec = importlib.util.find_spec("triton")
    if spec is None or not spec.submodule_search_locations:
        return None
    bin_dir = Path(next(iter(spec.submodule_search_locations)), "backends", "nvidia", "bin")
    bundled = {
        tool: {"path": str(bin_dir / tool), "version": cuda_tool_version(str(bin_dir / tool), env)}
        for tool in PTXAS_ENV_VARS
        if (bin_dir / tool).is_file()
    }
    overrides = {}
    for env_var in PTXAS_ENV_VARS.values():
        value = env.get(env_var)
        if value:
            path = value.split()[0]  # Triton allows options after the path
            overrides[env_var] = {"path": path, "version": cuda_tool_version(path, env)}
    return {"bundled_ptxas": bundled, "ptxas_overrides": overrides}
