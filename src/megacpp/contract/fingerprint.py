"""Capture the environment contract: one JSON-able dict describing the machine and stack.

The fingerprint is what every receipt embeds and what ``megacpp env diff`` compares. Its
fields are null where the thing does not exist here (no GPU, no nvcc, no git, a contract
package not installed) -- capture never fails for that.
"""

from __future__ import annotations

import datetime as dt
import os
import platform
import sys
from collections.abc import Iterable, Mapping
from importlib import metadata
from typing import Any

from megacpp._io import JSON_LIMIT, read_json_bounded
from megacpp.contract import probes
from megacpp.contract.gitinfo import capture_git
from megacpp.contract.patches import applied_patches
from megacpp.contract.sandbox_host import sandbox_host
from megacpp.errors import MegaCppError

FINGERPRINT_SCHEMA = "megacpp.fingerprint"
FINGERPRINT_VERSION = 1

# Packages whose versions are part of the contract unless a config names its own list.
DEFAULT_CONTRACT_PACKAGES: tuple[str, ...] = (
    "torch",
    "triton",
    "numpy",
    "tokenizers",
    "pyarrow",
    "mamba-ssm",
    "causal-conv1d",
    "liger-kernel",
    "flash-attn",
    "transformers",
    "megatron-core",
)
# Always captured: the rules and the diff rely on them.
REQUIRED_PACKAGES: tuple[str, ...] = ("torch", "triton")
# Distribution names under which a package may be installed (nightly builds rename triton).
_DISTRIBUTION_ALIASES: dict[str, tuple[str, ...]] = {"triton": ("triton", "pytorch-triton")}

# Environment variables that change which kernels are built or how they are run.
KERNEL_ENV_VARS: tuple[str, ...] = (
    "TORCH_CUDA_ARCH_LIST",
    "CUDA_HOME",
    "CUDA_PATH",
    "CUDA_VISIBLE_DEVICES",
    "CUBLAS_WORKSPACE_CONFIG",
    "PYTORCH_CUDA_ALLOC_CONF",
)
KERNEL_ENV_PREFIXES: tuple[str, ...] = ("TRITON_", "TORCHINDUCTOR_", "NCCL_")


def normalize_package(name: str) -> str:
    """PEP 503 form: ``Megatron_Core`` -> ``megatron-core``."""
    return "-".join(name.replace("_", "-").replace(".", "-").lower().split("-"))


def contract_packages(names: Iterable[str] | None = None) -> list[str]:
    """The contract list (``names`` or the default), with torch and triton always present."""
    chosen = [
        normalize_package(n) for n in (names if names is not None else DEFAULT_CONTRACT_PACKAGES)
    ]
    return list(dict.fromkeys([*REQUIRED_PACKAGES, *chosen]))


def package_versions(names: Iterable[str]) -> dict[str, str | None]:
    """Installed version of each distribution, ``None`` when it is not installed."""
    return {name: _installed_version(name) for name in names}


def _installed_version(name: str) -> str | None:
    for candidate in _DISTRIBUTION_ALIASES.get(name, (name,)):
        try:
            return metadata.version(candidate)
        except metadata.PackageNotFoundError:
            continue
    return None


def kernel_env(env: Mapping[str, str]) -> dict[str, str]:
    """The set variables among :data:`KERNEL_ENV_VARS` and :data:`KERNEL_ENV_PREFIXES`."""
    return {
        key: env[key]
        for key in sorted(env)
        if key in KERNEL_ENV_VARS or key.startswith(KERNEL_ENV_PREFIXES)
    }


def capture_fingerprint(
    *,
    packages: Iterable[str] | None = None,
    project_root: str | os.PathLike[str] | None = None,
    env: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    """Capture this machine's environment contract.

    ``packages`` replaces the default contract package list (torch and triton are always
    added); ``project_root`` is where git state is read (default: the megacpp checkout);
    ``env`` replaces ``os.environ`` (its PATH is where tools are looked up).
    """
    env = os.environ if env is None else env
    devices = probes.cuda_devices()
    return {
        "schema": FINGERPRINT_SCHEMA,
        "schema_version": FINGERPRINT_VERSION,
        "captured_at": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "host": probes.host(env),
        "python": {
            "version": platform.python_version(),
            "implementation": platform.python_implementation(),
            "executable": sys.executable,
        },
        "torch": probes.torch_build(),
        "triton": probes.triton_ptxas(env),
        "driver": probes.driver(env) if devices else None,
        "toolchain": probes.toolchain(env),
        "accelerator": "cuda" if devices else "cpu",
        "devices": devices,
        "packages": package_versions(contract_packages(packages)),
        "env": kernel_env(env),
        "git": capture_git(project_root, env),
        "patches": applied_patches(),
        "sandbox": sandbox_host(env),
    }


def with_numerics(fingerprint: dict[str, Any], *, float8: str) -> dict[str, Any]:
    """``fingerprint`` plus the run's ``numerics``: the FP8 recipe of its linear GEMMs
    (``"off"``: bf16) and, with FP8 on, the torchao version that ran them. A receipt's
    numerics are contract fields: an FP8 result is never compared with a bf16 one as if
    they were the same setting (:mod:`megacpp.contract.diff`)."""
    numerics: dict[str, Any] = {"float8": float8}
    if float8 != "off":
        numerics["torchao"] = _installed_version("torchao")
    return {**fingerprint, "numerics": numerics}


def load_fingerprint(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Read a fingerprint JSON file (``megacpp env capture --json``), failing clearly."""
    data = read_json_file(path, "fingerprint")
    check_fingerprint(data, source=str(path))
    return data


def check_fingerprint(data: Any, *, source: str) -> None:
    """Raise a clear error unless ``data`` is a fingerprint of a schema version we read."""
    if not isinstance(data, dict) or data.get("schema") != FINGERPRINT_SCHEMA:
        found = data.get("schema") if isinstance(data, dict) else type(data).__name__
        raise MegaCppError(
            f"{source} is not a megacpp fingerprint (schema={found!r}); expected the output "
            "of `megacpp env capture --json`"
        )
    if data.get("schema_version") != FINGERPRINT_VERSION:
        raise MegaCppError(
            f"{source} has fingerprint schema_version {data.get('schema_version')!r}; this "
            f"megacpp reads version {FINGERPRINT_VERSION}"
        )
    problem = _shape_problem(data)
    if problem:
        raise MegaCppError(f"{source}: {problem} (the fingerprint was edited or is corrupt; "
                           "capture it again with `megacpp env capture`)")


_NONE = type(None)
_FIELDS: dict[str, tuple[type, ...]] = {  # what every reader may index
    "host": (dict,), "python": (dict,), "toolchain": (dict,), "packages": (dict,),
    "env": (dict,), "devices": (list,), "torch": (dict, _NONE), "triton": (dict, _NONE),
    "driver": (dict, _NONE),
}
_OPTIONAL_FIELDS: dict[str, tuple[type, ...]] = {"git": (dict, _NONE), "patches": (list,),
                                                  "numerics": (dict,)}


def _shape_problem(data: dict[str, Any]) -> str | None:
    """The first field of a fingerprint whose type the readers cannot use, or None."""
    for key, types in (*_FIELDS.items(), *_OPTIONAL_FIELDS.items()):
        if key not in data and key in _OPTIONAL_FIELDS:
            continue
        value = data.get(key)
        if not isinstance(value, types):
            return f"{key} = {value!r:.60} is not a {' or '.join(t.__name__ for t in types)}"
    if not all(isinstance(v, (str, _NONE)) for v in data["packages"].values()):
        return "packages holds a version that is not a string or null"
    if not all(isinstance(v, str) for v in data["env"].values()):
        return "env holds a value that is not a string"
    for i, device in enumerate(data["devices"]):
        if not (isinstance(device, dict) and isinstance(device.get("name"), str)
                and isinstance(device.get("arch"), (str, _NONE))):
            return f"devices[{i}] is not a table with a name and an arch"
    for i, patch in enumerate(data.get("patches") or []):
        if not (isinstance(patch, dict) and isinstance(patch.get("name"), str)):
            return f"patches[{i}] is not a table with a name"
    return None


def read_json_file(path: str | os.PathLike[str], what: str) -> Any:
    """Parse a JSON file; a missing, unreadable or truncated file is a one-line error."""
    return read_json_bounded(path, JSON_LIMIT, what=f"{what} file")
