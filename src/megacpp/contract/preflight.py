"""Preflight: check known device and toolchain traps before work starts.

Each rule reads only :class:`PreflightInputs` (a fingerprint plus a few extra facts), so
every rule runs on a CPU with injected facts. Training and benchmarks call
:func:`require_preflight`: an ``error`` finding refuses to start unless the user names the
rule in ``skip``; skipped rules are part of the report that goes into the receipt.
"""

from __future__ import annotations

import datetime as dt
import json
import os
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

from megacpp._io import atomic_write_json, sha256_bytes
from megacpp.contract.compat import (
    cuda_supported_by_driver,
    min_driver_for_cuda,
    newest_tabled_cuda,
)
from megacpp.contract.config import ContractConfig, KernelSmem
from megacpp.contract.devices import profile_for_fingerprint
from megacpp.contract.integrity import IntegrityReport, describe_problems, verify_site
from megacpp.contract.patches import INDUCTOR_MIN_SMS
from megacpp.contract.sandbox_host import CGROUP_ENV
from megacpp.contract.triton_ptxas import PTXAS_ENV_VARS, PtxasRouting, ptxas_routing
from megacpp.contract.versions import short_version, version_at_least, version_tuple
from megacpp.errors import MegaCppError

Severity = Literal["error", "warning", "info", "pass", "n/a"]
ROUTING_FILE = "megacpp-ptxas-routings.json"


@dataclass(frozen=True)
class Finding:
    """One result of one rule."""

    rule: str
    severity: Severity
    message: str
    fix: str = ""


@dataclass
class PreflightInputs:
    """Everything the rules read. Build with :func:`gather_inputs`, or directly in tests."""

    facts: dict[str, Any]  # a fingerprint (capture_fingerprint) -- live or injected
    kernels: list[KernelSmem] = field(default_factory=list)
    integrity: list[IntegrityReport] | None = None  # None: rule f reports it did not run
    cache_routings: list[dict[str, Any]] | None = None  # None: no routing record found


@dataclass(frozen=True)
class Rule:
    id: str
    title: str
    check: Callable[[PreflightInputs], list[Finding]]


@dataclass
class PreflightReport:
    """Findings of the rules that ran, and the rules the user chose to skip."""

    findings: list[Finding]
    skipped: list[str]

    @property
    def errors(self) -> list[Finding]:
        return [f for f in self.findings if f.severity == "error"]

    @property
    def warnings(self) -> list[Finding]:
        return [f for f in self.findings if f.severity == "warning"]

    @property
    def ok(self) -> bool:
        return not self.errors

    def to_dict(self) -> dict[str, Any]:
        """The form stored in receipts."""
        return {
            "ok": self.ok,
            "skipped": list(self.skipped),
            "findings": [asdict(f) for f in self.findings],
        }


# --- helpers ----------------------------------------------------------------------------------


def _gpus(inputs: PreflightInputs) -> list[dict[str, Any]]:
    return list(inputs.facts.get("devices") or [])


def _na(rule: str, why: str) -> list[Finding]:
    return [Finding(rule, "n/a", why)]


def _kib(n: int) -> str:
    return f"{n / 1024:g} KiB"


def _device_label(device: dict[str, Any]) -> str:
    return f"{device.get('name', 'GPU')} ({device.get('arch', '?')})"


# --- (a) kernel shared memory -------------------------------------------------------------------


def check_kernel_smem(inputs: PreflightInputs) -> list[Finding]:
    rule = "kernel-smem"
    if not inputs.kernels:
        return _na(rule, "no kernel shared-memory needs were declared")
    if not _gpus(inputs):
        return _na(rule, "no CUDA device")
    findings = []
    for index, device in enumerate(_gpus(inputs)):
        limit = (
            device.get("smem_per_block_optin_bytes")
            or profile_for_fingerprint(inputs.facts, index).max_smem_per_block_bytes
        )
        if limit is None:
            findings.append(
                Finding(
                    rule,
                    "warning",
                    f"{_device_label(device)}: per-block "
                    "shared-memory limit unknown; kernel needs not checked",
                )
            )
            continue
        for kernel in inputs.kernels:
            if kernel.smem_bytes > limit:
                findings.append(
                    Finding(
                        rule,
                        "error",
                        f"kernel {kernel.name!r} declares {_kib(kernel.smem_bytes)} of shared "
                        f"memory per block; {_device_label(device)} allows at most "
                        f"{_kib(limit)} per block",
                        f"choose a variant of {kernel.name!r} with smaller tiles "
                        f"(<= {_kib(limit)}) or another backend for this device",
                    )
                )
    return findings


# --- (b) Triton's ptxas vs the device arch -----------------------------------------------------


def check_triton_ptxas(inputs: PreflightInputs) -> list[Finding]:
    rule = "triton-ptxas-arch"
    if not inputs.facts.get("triton"):
        return _na(rule, "Triton is not installed")
    if not _gpus(inputs):
        return _na(rule, "no CUDA device")
    findings = []
    for device in _gpus(inputs):
        routing = ptxas_routing(inputs.facts, device)
        if routing is not None:
            findings += _ptxas_findings(rule, inputs.facts, device, routing)
    return findings


def _ptxas_findings(
    rule: str, facts: dict[str, Any], device: dict[str, Any], routing: PtxasRouting
) -> list[Finding]:
    findings = _ignored_override(rule, facts, routing)
    if routing.needed_cuda is None:
        unknown_arch = (
            f"{routing.target} ({_device_label(device)}) is not in megacpp's arch table; "
            f"cannot tell whether {routing.describe()} supports it"
        )
        return [*findings, Finding(rule, "warning", unknown_arch)]
    if routing.supported is None:
        unknown_version = (
            f"cannot determine the version of {routing.describe()}; {routing.target} needs "
            f"CUDA >= {routing.needed_cuda}"
        )
        return [*findings, Finding(rule, "warning", unknown_version)]
    if routing.supported:
        return findings
    system = (facts.get("toolchain") or {}).get("ptxas") or {}
    usable = version_at_least(system.get("version"), routing.needed_cuda)
    fix = (
        f"export {routing.env_var}={system['path']} (CUDA {system['version']}), or apply "
        "patch 'triton-system-ptxas'"
        if usable
        else f"install a CUDA toolkit >= {routing.needed_cuda} and point {routing.env_var} at its "
        "ptxas, or upgrade Triton"
    )
    unsupported = (
        f"{_device_label(device)}: Triton will assemble {routing.target} with "
        f"{routing.describe()}, which does not know {routing.target} (needs CUDA >= "
        f"{routing.needed_cuda})"
    )
    return [*findings, Finding(rule, "error", unsupported, fix)]


def _ignored_override(rule: str, facts: dict[str, Any], routing: PtxasRouting) -> list[Finding]:
    """TRITON_PTXAS_PATH set while Triton >= 3.6 uses ptxas-blackwell: a silent no-op."""
    if routing.tool != "ptxas-blackwell" or not (facts.get("env") or {}).get("TRITON_PTXAS_PATH"):
        return []
    return [
        Finding(
            rule,
            "warning",
            f"TRITON_PTXAS_PATH is set, but Triton {facts.get('packages', {}).get('triton')} "
            f"assembles {routing.target} with ptxas-blackwell, which only "
            f"{PTXAS_ENV_VARS['ptxas-blackwell']} overrides: TRITON_PTXAS_PATH has no effect here",
            f"set {PTXAS_ENV_VARS['ptxas-blackwell']} instead (or unset TRITON_PTXAS_PATH)",
        )
    ]


# --- (c) Inductor's big-GPU gate ----------------------------------------------------------------


def check_inductor_gate(inputs: PreflightInputs) -> list[Finding]:
    rule = "inductor-big-gpu-gate"
    small = [d for d in _gpus(inputs) if (d.get("sm_count") or INDUCTOR_MIN_SMS) < INDUCTOR_MIN_SMS]
    if not small:
        return _na(
            rule,
            "no CUDA device" if not _gpus(inputs) else f"every GPU has >= {INDUCTOR_MIN_SMS} SMs",
        )
    lifted = any(p.get("name") == "inductor-big-gpu" for p in inputs.facts.get("patches") or [])
    findings = []
    for device in small:
        sms = device["sm_count"]
        if lifted:
            findings.append(
                Finding(
                    rule,
                    "info",
                    f"{_device_label(device)} has {sms} SMs; patch 'inductor-big-gpu' lifts "
                    f"Inductor's {INDUCTOR_MIN_SMS}-SM gate, so max-autotune also tries Triton "
                    f"GEMM templates. The hardware is unchanged: still {sms} SMs.",
                )
            )
        else:
            findings.append(
                Finding(
                    rule,
                    "warning",
                    f"{_device_label(device)} has {sms} SMs (< {INDUCTOR_MIN_SMS}): "
                    "TorchInductor's max-autotune keeps its Triton GEMM templates off here "
                    "(torch._inductor.utils.is_big_gpu) and uses ATen/cuBLAS GEMMs only",
                    "apply patch 'inductor-big-gpu' to let autotuning consider the templates; "
                    f"lifting the gate does not change the hardware ({sms} SMs stay {sms} SMs)",
                )
            )
    return findings


# --- (d) one Triton cache shared between ptxas routings ------------------------------------------


def triton_cache_dir(facts: dict[str, Any]) -> Path:
    """``$TRITON_CACHE_DIR``, else ``$TRITON_HOME/.triton/cache`` (Triton's default)."""
    env = facts.get("env") or {}
    if env.get("TRITON_CACHE_DIR"):
        return Path(env["TRITON_CACHE_DIR"]).expanduser()
    home = env.get("TRITON_HOME") or os.path.expanduser("~")
    return Path(home, ".triton", "cache")


def current_routings(facts: dict[str, Any]) -> list[dict[str, Any]]:
    """The (target, ptxas path, ptxas version) routing of each distinct device target."""
    routings = {}
    for device in facts.get("devices") or []:
        routing = ptxas_routing(facts, device)
        if routing is not None:
            routings[routing.target] = {
                "target": routing.target,
                "tool": routing.tool,
                "ptxas_path": routing.path,
                "ptxas_version": routing.version,
            }
    return list(routings.values())


def routing_id(routing: dict[str, Any]) -> str:
    key = json.dumps([routing["target"], routing["ptxas_path"], routing["ptxas_version"]])
    return sha256_bytes(key.encode())[:12]


def read_cache_routings(facts: dict[str, Any]) -> list[dict[str, Any]] | None:
    """The routings recorded in this Triton cache dir; ``None`` when none were recorded."""
    path = triton_cache_dir(facts) / ROUTING_FILE
    try:
        data = json.loads(path.read_text("utf-8"))
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise MegaCppError(
            f"cannot read Triton cache routing record {path}: {exc}; "
            "delete it to start a new record"
        ) from None
    return list(data.get("routings", [])) if isinstance(data, dict) else None


def record_cache_routings(facts: dict[str, Any]) -> Path | None:
    """Add this run's routings to the cache dir's record (done after preflight passes)."""
    routings = current_routings(facts)
    if not routings:
        return None
    known = read_cache_routings(facts) or []
    seen = {routing_id(r) for r in known}
    host = (facts.get("host") or {}).get("hostname")
    now = dt.datetime.now(dt.UTC).isoformat(timespec="seconds")
    new = [
        {**r, "id": routing_id(r), "host": host, "first_seen": now}
        for r in routings
        if routing_id(r) not in seen
    ]
    if not new:
        return None
    return atomic_write_json(triton_cache_dir(facts) / ROUTING_FILE, {"routings": known + new})


def check_cache_routing(inputs: PreflightInputs) -> list[Finding]:
    """Triton keys cached kernels on ``ptxas --version`` of the arch's tool (3.6:
    ``CUDABackend.hash``), but reads that version once per process (``lru_cache``): a
    process whose routing changes after its first compile files new kernels under the
    old assembler's key, and every later process sharing the directory reuses them.
    Hence one cache directory per routing."""
    rule = "triton-cache-routing"
    routings = current_routings(inputs.facts)
    if not routings:
        return _na(rule, "Triton or a CUDA device is absent")
    if not inputs.cache_routings:
        return []
    cache = triton_cache_dir(inputs.facts)
    findings = []
    for routing in routings:
        rivals = [
            r
            for r in inputs.cache_routings
            if r.get("target") == routing["target"] and r.get("id") != routing_id(routing)
        ]
        for rival in rivals:
            findings.append(
                Finding(
                    rule,
                    "warning",
                    f"Triton cache {cache} is shared between ptxas routings for "
                    f"{routing['target']}: now {routing['ptxas_path']} (CUDA "
                    f"{routing['ptxas_version']}), earlier {rival.get('ptxas_path')} (CUDA "
                    f"{rival.get('ptxas_version')}) on host {rival.get('host')}. Triton keys "
                    "kernels on the ptxas version it read first in a process, so a routing "
                    "switched mid-process files kernels under the other "
                    "assembler's key",
                    f"export TRITON_CACHE_DIR={cache.parent / ('cache-' + routing_id(routing))} "
                    "(one cache per routing)",
                )
            )
    return findings


# --- (e) CUDA runtime vs driver ------------------------------------------------------------------


def check_cuda_driver(inputs: PreflightInputs) -> list[Finding]:
    rule = "cuda-driver"
    runtime = (inputs.facts.get("torch") or {}).get("cuda")
    driver = inputs.facts.get("driver") or {}
    if runtime is None:
        return _na(rule, "torch is not a CUDA build")
    if not _gpus(inputs) or not driver.get("version"):
        return _na(rule, "no NVIDIA driver / CUDA device")
    supported = driver.get("cuda_version")
    if supported is None:
        if version_tuple(runtime, 2) > version_tuple(newest_tabled_cuda()):
            return [
                Finding(
                    rule,
                    "warning",
                    f"cannot tell whether driver {driver['version']} "
                    f"supports CUDA {runtime} (newer than megacpp's driver table)",
                )
            ]
        supported = cuda_supported_by_driver(driver["version"])
    return _driver_findings(rule, runtime, driver["version"], supported)


def _driver_findings(rule: str, runtime: str, driver: str, supported: str | None) -> list[Finding]:
    need = min_driver_for_cuda(runtime)
    need_text = f" (needs driver >= {need})" if need else ""
    upgrade = f"upgrade the NVIDIA driver to >= {need}" if need else "upgrade the NVIDIA driver"
    if supported is None or version_tuple(runtime, 1) > version_tuple(supported, 1):
        return [
            Finding(
                rule,
                "error",
                f"torch's CUDA runtime {runtime}{need_text} is newer than driver {driver} supports "
                f"(CUDA {supported or 'unknown'}); CUDA calls will fail",
                f"{upgrade}, or install a torch build for CUDA "
                f"{short_version(supported, 2) or 'your driver'}",
            )
        ]
    if version_tuple(runtime, 2) > version_tuple(supported, 2):
        return [
            Finding(
                rule,
                "warning",
                f"torch's CUDA runtime {runtime} is newer than driver {driver} (CUDA {supported}); "
                "it runs through CUDA minor version compatibility, but PTX of the newer ISA cannot "
                "be JIT-compiled by this driver",
                upgrade,
            )
        ]
    return []


# --- (f) contract packages modified in place -----------------------------------------------------


def check_site_integrity(inputs: PreflightInputs) -> list[Finding]:
    rule = "site-integrity"
    if inputs.integrity is None:
        return _na(rule, "integrity of contract packages was not checked")
    findings = []
    for report in inputs.integrity:
        if report.error:
            findings.append(Finding(rule, "warning", f"{report.name}: {report.error}"))
        elif report.modified or report.missing or report.unverifiable:
            findings.append(
                Finding(
                    rule,
                    "error",
                    f"contract package {report.name} {report.version} was modified in place "
                    f"({describe_problems(report)})",
                    f"reinstall it: pip install --force-reinstall --no-deps {report.name}=="
                    f"{report.version}; put runtime fixes in the patch lane (megacpp env patches)",
                )
            )
        elif report.unexpected:
            findings.append(
                Finding(
                    rule,
                    "warning",
                    f"{report.name} {report.version} has files its RECORD does not list "
                    f"({describe_problems(report)})",
                    "remove them, or reinstall the package",
                )
            )
    return findings


# --- (g) device profile known --------------------------------------------------------------------


def check_device_profile(inputs: PreflightInputs) -> list[Finding]:
    rule = "device-profile"
    findings = []
    for index, device in enumerate(_gpus(inputs)):
        if not profile_for_fingerprint(inputs.facts, index).known:
            findings.append(
                Finding(
                    rule,
                    "info",
                    f"{_device_label(device)} is not in "
                    "devices.toml: its peaks are unknown, so MFU will be n/a",
                )
            )
    if not _gpus(inputs):
        return _na(rule, "no CUDA device")
    return findings


# --- (h) what the C++ verifier sandbox can guarantee on this host ----------------------------------


def check_sandbox_host(inputs: PreflightInputs) -> list[Finding]:
    """One warning per guarantee of ``megacpp eval``'s sandbox this host cannot give."""
    rule = "sandbox-host"
    host = inputs.facts.get("sandbox")
    if not isinstance(host, dict):
        return _na(rule, "the fingerprint has no sandbox section")
    findings = []
    if not host.get("seccomp"):
        findings.append(Finding(
            rule, "warning",
            "the kernel takes no seccomp filters: the C++ sandbox cannot deny namespace and "
            "mount calls (under --isolation rlimits a program can mount a tmpfs of its own)",
            "use a kernel with CONFIG_SECCOMP_FILTER, or a container profile that allows "
            "seccomp(2)"))
    if not host.get("memory_cgroup"):
        findings.append(Finding(
            rule, "warning",
            f"no memory cgroup for the C++ sandbox ({host.get('memory_cgroup_note')}): a run's "
            "memory is bounded per process and /tmp by its size cap, not as a whole",
            f"run as root with a writable memory cgroup, or set {CGROUP_ENV} to a delegated "
            "cgroup v2 directory with +memory in its cgroup.subtree_control (docs/eval.md)"))
    if host.get("user_namespaces") == 0:
        findings.append(Finding(
            rule, "warning",
            "user.max_user_namespaces is 0: the C++ sandbox's namespace isolation cannot start",
            "sysctl -w user.max_user_namespaces=15000 (or use --isolation rlimits, which "
            "isolates no files or network)"))
    return findings


RULES: dict[str, Rule] = {
    rule.id: rule
    for rule in (
        Rule(
            "kernel-smem",
            "kernel shared memory fits the device's per-block limit",
            check_kernel_smem,
        ),
        Rule("triton-ptxas-arch", "Triton's ptxas knows the device arch", check_triton_ptxas),
        Rule(
            "inductor-big-gpu-gate",
            "Inductor's max-autotune GEMM gate (>= 68 SMs)",
            check_inductor_gate,
        ),
        Rule("triton-cache-routing", "one Triton cache per ptxas routing", check_cache_routing),
        Rule("cuda-driver", "the driver supports torch's CUDA runtime", check_cuda_driver),
        Rule("site-integrity", "contract packages match their RECORD hashes", check_site_integrity),
        Rule(
            "device-profile", "the device has a known profile (peaks for MFU)", check_device_profile
        ),
        Rule(
            "sandbox-host",
            "the C++ sandbox has seccomp, user namespaces and a memory cgroup",
            check_sandbox_host,
        ),
    )
}


def run_rules(inputs: PreflightInputs, skip: Iterable[str] = ()) -> PreflightReport:
    """Run every rule not in ``skip`` over ``inputs``."""
    skipped = list(dict.fromkeys(skip))
    unknown = [s for s in skipped if s not in RULES]
    if unknown:
        raise MegaCppError(
            f"unknown preflight rule(s) to skip: {', '.join(unknown)}; rules: {', '.join(RULES)}"
        )
    findings = []
    for rule in RULES.values():
        if rule.id not in skipped:
            findings += rule.check(inputs) or [Finding(rule.id, "pass", rule.title)]
    return PreflightReport(findings=findings, skipped=skipped)


def gather_inputs(
    facts: dict[str, Any],
    config: ContractConfig | None = None,
    kernels: Iterable[KernelSmem] = (),
    check_integrity: bool = True,
    progress: Callable[[str, int, int], None] | None = None,
) -> PreflightInputs:
    """Inputs for the live machine: config kernels + ``kernels``, integrity, cache record."""
    config = config or ContractConfig()
    integrity = (
        verify_site(config.packages, installed_only=True, progress=progress)
        if check_integrity
        else None
    )
    return PreflightInputs(
        facts=facts,
        kernels=[*config.kernels, *kernels],
        integrity=integrity,
        cache_routings=read_cache_routings(facts),
    )


def run_preflight(
    facts: dict[str, Any],
    config: ContractConfig | None = None,
    skip: Iterable[str] = (),
    kernels: Iterable[KernelSmem] = (),
    check_integrity: bool = True,
) -> PreflightReport:
    """Gather inputs for ``facts`` and run the rules; ``skip`` adds to the config's skips."""
    config = config or ContractConfig()
    inputs = gather_inputs(facts, config, kernels, check_integrity)
    return run_rules(inputs, skip=[*config.skip, *skip])


class PreflightError(MegaCppError):
    """Preflight found errors the user did not choose to skip."""


def require_preflight(
    facts: dict[str, Any],
    config: ContractConfig | None = None,
    skip: Iterable[str] = (),
    kernels: Iterable[KernelSmem] = (),
) -> PreflightReport:
    """For trainers and benchmarks: run preflight, refuse on errors, record the routing.

    Returns the report (put ``report.to_dict()`` in the receipt). Raises
    :class:`PreflightError` naming each failing rule and how to skip it.
    """
    report = run_preflight(facts, config, skip, kernels)
    if not report.ok:
        lines = [
            f"[{f.rule}] {f.message}" + (f" -- fix: {f.fix}" if f.fix else "")
            for f in report.errors
        ]
        rules = " ".join(
            f"--skip-preflight {r}" for r in dict.fromkeys(f.rule for f in report.errors)
        )
        raise PreflightError(
            "preflight failed:\n  "
            + "\n  ".join(lines)
            + f"\nto run anyway (recorded in the receipt): {rules}"
        )
    record_cache_routings(facts)
    return report
