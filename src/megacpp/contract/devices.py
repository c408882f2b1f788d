"""Device profiles (``devices.toml``) and model-FLOPs utilisation against the right peak.

A live device that is not in the table gets a profile built from what was queried (SM
count, shared memory, arch) whose peaks are unknown: MFU is then n/a, never computed
against another device's peak (the trap of dividing GB10 throughput by an H100 peak).
"""

from __future__ import annotations

import functools
import math
import tomllib
from dataclasses import dataclass, field
from importlib import resources
from typing import Any

from megacpp.contract.triton_ptxas import cuda_arch
from megacpp.errors import MegaCppError

DTYPES = ("bf16", "fp8", "fp4")


@dataclass(frozen=True)
class DeviceProfile:
    """What a device can do, with the source of every figure."""

    key: str
    name: str
    arch_family: str
    compute_capability: str | None = None
    compile_targets: tuple[str, ...] = ()
    sm_count: int | None = None
    max_smem_per_block_bytes: int | None = None
    memory_bandwidth_gbs: float | None = None
    peak_dense_tflops: dict[str, float] = field(default_factory=dict)
    sources: dict[str, str] = field(default_factory=dict)
    match: tuple[str, ...] = ()
    known: bool = True  # False: built from a live query, peaks unknown

    @property
    def arch(self) -> str | None:
        return cuda_arch(self.compute_capability) if self.compute_capability else None

    def peak(self, dtype: str) -> float | None:
        """Dense peak TFLOP/s for ``dtype``; ``None`` when unknown or unsupported."""
        return self.peak_dense_tflops.get(dtype)

    def to_dict(self) -> dict[str, Any]:
        return {
            "key": self.key,
            "name": self.name,
            "known": self.known,
            "arch_family": self.arch_family,
            "compute_capability": self.compute_capability,
            "arch": self.arch,
            "compile_targets": list(self.compile_targets),
            "sm_count": self.sm_count,
            "max_smem_per_block_bytes": self.max_smem_per_block_bytes,
            "memory_bandwidth_gbs": self.memory_bandwidth_gbs,
            "peak_dense_tflops": dict(self.peak_dense_tflops),
            "sources": dict(self.sources),
        }


@functools.cache
def known_profiles() -> tuple[DeviceProfile, ...]:
    """Every profile in ``devices.toml``, in file order."""
    text = resources.files("megacpp.contract").joinpath("devices.toml").read_text("utf-8")
    return tuple(_profile_from_row(row) for row in tomllib.loads(text)["device"])


def _profile_from_row(row: dict[str, Any]) -> DeviceProfile:
    return DeviceProfile(
        key=row["key"],
        name=row["name"],
        arch_family=row["arch_family"],
        compute_capability=row.get("compute_capability"),
        compile_targets=tuple(row.get("compile_targets", ())),
        sm_count=row.get("sm_count"),
        max_smem_per_block_bytes=row.get("max_smem_per_block_bytes"),
        memory_bandwidth_gbs=row.get("memory_bandwidth_gbs"),
        peak_dense_tflops=dict(row.get("peak_dense_tflops", {})),
        sources=dict(row.get("sources", {})),
        match=tuple(row.get("match", ())),
    )


def device_profile(name_or_facts: str | dict[str, Any] | None) -> DeviceProfile:
    """The profile for a table key / device name, or for a captured device entry.

    ``None`` or ``"cpu"`` -> the CPU profile. A string that names no known device is an
    error listing the keys. A device dict (an entry of a fingerprint's ``devices``) that
    matches no profile yields a live profile with unknown peaks.
    """
    if name_or_facts is None:
        return _by_key("cpu")
    if isinstance(name_or_facts, str):
        return _by_name(name_or_facts)
    matched = _match_live(name_or_facts)
    return matched if matched is not None else _live_profile(name_or_facts)


def profile_for_fingerprint(fingerprint: dict[str, Any], index: int = 0) -> DeviceProfile:
    """The profile of device ``index`` in a fingerprint (the CPU profile when it has none)."""
    devices = fingerprint.get("devices") or []
    return device_profile(devices[index]) if index < len(devices) else device_profile(None)


def _by_key(key: str) -> DeviceProfile:
    return next(p for p in known_profiles() if p.key == key)


def _by_name(text: str) -> DeviceProfile:
    wanted = text.strip().lower()
    for profile in known_profiles():
        if wanted in (profile.key, profile.name.lower()) or any(
            m.lower() in wanted for m in profile.match
        ):
            return profile
    keys = ", ".join(p.key for p in known_profiles())
    raise MegaCppError(f"unknown device {text!r}; known devices: {keys}")


def _match_live(device: dict[str, Any]) -> DeviceProfile | None:
    name = str(device.get("name", "")).lower()
    for profile in known_profiles():
        if not any(m.lower() in name for m in profile.match):
            continue
        same_cc = device.get("compute_capability") in (None, profile.compute_capability)
        same_sms = device.get("sm_count") in (None, profile.sm_count)
        if same_cc and same_sms:
            return profile
    return None


def _live_profile(device: dict[str, Any]) -> DeviceProfile:
    name = str(device.get("name") or "unknown device")
    return DeviceProfile(
        key="live",
        name=name,
        arch_family="unknown",
        compute_capability=device.get("compute_capability"),
        sm_count=device.get("sm_count"),
        max_smem_per_block_bytes=device.get("smem_per_block_optin_bytes"),
        sources={"*": "queried from the live device; not in devices.toml, so no peaks are known"},
        known=False,
    )


@dataclass(frozen=True)
class MfuResult:
    """Model-FLOPs utilisation, or why it cannot be computed."""

    mfu: float | None  # fraction of peak (0.41 = 41%); None = n/a
    achieved_tflops: float
    peak_tflops: float | None
    peak_source: str
    device: str
    dtype: str

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


def mfu(
    flops_per_token: float,
    tokens_per_s: float,
    profile: DeviceProfile,
    dtype: str = "bf16",
    peak_tflops: float | None = None,
    peak_source: str | None = None,
) -> MfuResult:
    """``flops_per_token * tokens_per_s / peak``; n/a when the device's peak is unknown.

    The one MFU formula of the project (``megacpp env mfu``, the trainer, the benchmarks).
    ``peak_tflops`` overrides the table: a peak measured on the device
    (:func:`megacpp.train.metrics.bf16_matmul_peak`), named by ``peak_source``, or one the
    user gave (the default source).
    """
    if dtype not in DTYPES:
        raise MegaCppError(f"unknown dtype {dtype!r}; MFU peaks exist for: {', '.join(DTYPES)}")
    for label, value in (("flops per token", flops_per_token), ("tokens per second", tokens_per_s)):
        if not math.isfinite(value) or value <= 0:
            raise MegaCppError(f"{label} must be a positive finite number, got {value}")
    if peak_tflops is not None and (not math.isfinite(peak_tflops) or peak_tflops <= 0):
        raise MegaCppError(f"--peak must be a positive number of TFLOP/s, got {peak_tflops}")
    achieved = flops_per_token * tokens_per_s / 1e12
    if peak_tflops is not None:
        peak, source = peak_tflops, peak_source or "given by the user (--peak)"
    else:
        peak = profile.peak(dtype)
        source = profile.sources.get("peak_dense_tflops") or profile.sources.get("*", "")
        if peak is None:
            source = f"no published dense {dtype} peak for {profile.name}: MFU is n/a. {source}"
    return MfuResult(
        mfu=achieved / peak if peak else None,
        achieved_tflops=achieved,
        peak_tflops=peak,
        peak_source=source,
        device=profile.name,
        dtype=dtype,
    )
