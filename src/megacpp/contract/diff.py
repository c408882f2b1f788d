"""Compare two fingerprints field by field and say which differences break the contract.

A difference is *contract-breaking* when results from the two environments cannot be
compared as if they meant the same thing: torch minor version, CUDA runtime major.minor,
compiler major, device (name, arch, SM count), Triton minor and its ptxas, any other
contract package version, kernel-affecting environment variables, applied patches, and the
run's numerics (the FP8 recipe of its linear GEMMs, recorded by training receipts).
Everything else (hostname, capture time, memory, driver, git commit, what the C++ sandbox
can rely on) is informational.
A field this table does not know is contract-breaking: fail closed.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass
from fnmatch import fnmatchcase
from typing import Any

from megacpp.contract.fingerprint import check_fingerprint
from megacpp.contract.versions import short_version, version_tuple


@dataclass(frozen=True)
class Difference:
    """One field that differs between fingerprint ``a`` and fingerprint ``b``."""

    field: str  # dotted path, e.g. "packages.torch" or "devices.0.arch"
    a: Any
    b: Any
    contract: bool  # True: results from a and b are not comparable
    reason: str

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


Verdict = tuple[bool, str]
Classifier = Callable[[Any, Any, dict, dict], Verdict]


def _info(reason: str) -> Classifier:
    return lambda a, b, fa, fb: (False, reason)


def _contract(reason: str) -> Classifier:
    return lambda a, b, fa, fb: (True, reason)


def _by_parts(parts: int, what: str) -> Classifier:
    """Contract-breaking when the first ``parts`` numbers of two versions differ."""

    def classify(a: Any, b: Any, fa: dict, fb: dict) -> Verdict:
        head_a, head_b = version_tuple(a, parts), version_tuple(b, parts)
        if head_a is not None and head_a == head_b:
            return False, f"same {what} ({short_version(a, parts)}); only the build differs"
        return True, f"{what} differs"

    return classify


def _cpu_as_device(a: Any, b: Any, fa: dict, fb: dict) -> Verdict:
    """Without GPUs the CPU is the device: its model and core count are then the contract."""
    if fa.get("accelerator") == "cpu" and fb.get("accelerator") == "cpu":
        return True, "CPU-only runs: the CPU is the device"
    return False, "host CPU (the GPU is the device)"


def _float8_recipe(a: Any, b: Any, fa: dict, fb: dict) -> Verdict:
    """The FP8 recipe of a run's linear GEMMs; a fingerprint without numerics (``env
    capture``, or a receipt written before runs recorded them) ran bf16."""
    if (a or "off") == (b or "off"):
        return False, "same matmul precision (bf16: no numerics recorded means off)"
    return True, "FP8 recipe of the linear GEMMs (off = bf16)"


_INFORMATIONAL_ENV = (
    "NCCL_DEBUG",
    "NCCL_DEBUG_SUBSYS",
    "NCCL_DEBUG_FILE",
    "NCCL_VERSION",
    "TRITON_CACHE_DIR",
    "TRITON_HOME",
    "TORCHINDUCTOR_CACHE_DIR",
)

# First matching pattern wins; "*" matches across dots.
_FIELD_RULES: list[tuple[str, Classifier]] = [
    ("schema*", _contract("fingerprint schema")),
    ("captured_at", _info("capture time")),
    ("host.cpu_model", _cpu_as_device),
    ("host.cpu_count", _cpu_as_device),
    ("host.*", _info("host detail")),
    ("python.version", _by_parts(2, "Python major.minor")),
    ("python.*", _info("interpreter path")),
    ("torch.cuda", _by_parts(2, "CUDA runtime major.minor")),
    ("torch.hip", _by_parts(2, "HIP runtime major.minor")),
    ("torch.*", _info("torch build detail (cuDNN, NCCL, git revision)")),
    ("triton.*.version", _contract("Triton's ptxas version")),
    ("triton.*", _info("ptxas location")),
    ("driver.*", _info("driver (compatibility is checked by preflight rule cuda-driver)")),
    ("toolchain.nvcc", _by_parts(2, "nvcc (CUDA toolkit) major.minor")),
    ("toolchain.gcc", _by_parts(1, "gcc major")),
    ("toolchain.gxx", _by_parts(1, "g++ major")),
    ("toolchain.*", _info("system ptxas (it matters only when routed, see env)")),
    ("accelerator", _contract("accelerator kind")),
    ("devices.*.total_memory_bytes", _info("device memory size")),
    ("devices.*.l2_cache_bytes", _info("L2 cache size")),
    ("devices.*.index", _info("device index")),
    ("devices.*", _contract("device (name, arch, SM count, shared memory, count)")),
    ("packages.torch", _by_parts(2, "torch minor version")),
    ("packages.triton", _by_parts(2, "Triton minor version")),
    ("packages.*", _contract("contract package version")),
    *(
        (f"env.{name}", _info("diagnostic / cache location variable"))
        for name in _INFORMATIONAL_ENV
    ),
    ("env.*", _contract("kernel-affecting environment variable")),
    ("git.*", _info("git state (comparing commits is what receipts are for)")),
    ("patches", _contract("applied patches")),
    ("numerics.float8", _float8_recipe),
    ("numerics.*", _contract("the library that runs the FP8 GEMMs")),
    ("sandbox.*", _info("what the C++ sandbox can rely on (preflight rule sandbox-host)")),
    ("*", _contract("field unknown to this megacpp (fail closed)")),
]


def diff_fingerprints(a: dict[str, Any], b: dict[str, Any]) -> list[Difference]:
    """Every field that differs between ``a`` and ``b``, classified; sorted by field."""
    check_fingerprint(a, source="fingerprint A")
    check_fingerprint(b, source="fingerprint B")
    flat_a, flat_b = _flatten(a), _flatten(b)
    differences = []
    for field in sorted(flat_a.keys() | flat_b.keys()):
        value_a, value_b = flat_a.get(field), flat_b.get(field)
        if value_a != value_b:
            contract, reason = _classify(field)(value_a, value_b, a, b)
            differences.append(Difference(field, value_a, value_b, contract, reason))
    return differences


def contract_differences(a: dict[str, Any], b: dict[str, Any]) -> list[Difference]:
    """Only the contract-breaking differences (the drift that refuses a comparison)."""
    return [d for d in diff_fingerprints(a, b) if d.contract]


def _classify(field: str) -> Classifier:
    return next(rule for pattern, rule in _FIELD_RULES if fnmatchcase(field, pattern))


def _flatten(value: Any, prefix: str = "") -> dict[str, Any]:
    """Nested dicts/lists -> ``{"devices.0.arch": "sm_90", ...}``; patches by sorted name."""
    if prefix == "patches":
        return {prefix: sorted(p.get("name", "?") for p in value or [])}
    if isinstance(value, dict):
        flat: dict[str, Any] = {}
        for key, item in value.items():
            flat.update(_flatten(item, f"{prefix}.{key}" if prefix else str(key)))
        return flat
    if isinstance(value, list) and prefix == "devices":
        flat = {f"{prefix}.count": len(value)}
        for index, item in enumerate(value):
            flat.update(_flatten(item, f"{prefix}.{index}"))
        return flat
    return {prefix: value}
