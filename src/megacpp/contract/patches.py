"""The patch lane: explicit, revertible, in-memory fixes for known stack problems.

A patch is never a file edit in site-packages (that is what ``verify-site`` catches). It
replaces a module attribute or sets an environment variable *of this process*, remembers
what was there, and puts it back on :meth:`AppliedPatch.revert`. Each patch says where it
applies (a predicate over the captured facts) and why; every applied patch is listed by
:func:`applied_patches` and so lands in the fingerprint and in every receipt.

Apply patches before the first Triton compile / ``torch.compile`` of the process: both
cache decisions the patches change.
"""

from __future__ import annotations

import datetime as dt
import importlib
import os
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from megacpp.contract.triton_ptxas import ptxas_routing, system_ptxas
from megacpp.contract.versions import version_at_least
from megacpp.errors import MegaCppError

INDUCTOR_MIN_SMS = 68  # torch._inductor.utils.is_big_gpu: "min_sms = ... 68  # 3080"


@dataclass(frozen=True)
class Applicability:
    """Whether a patch applies to these facts, and why (or why not)."""

    applies: bool
    reason: str


@dataclass
class AppliedPatch:
    """A patch in effect in this process; :meth:`revert` undoes it exactly."""

    name: str
    target: str
    detail: dict[str, Any]
    applied_at: str
    _undo: Callable[[], None] = field(repr=False)
    reverted: bool = False

    def revert(self) -> None:
        """Restore what the patch replaced. Reverting twice is an error."""
        if self.reverted:
            raise MegaCppError(f"patch {self.name!r} was already reverted")
        self._undo()
        self.reverted = True
        _APPLIED.pop(self.name, None)

    def record(self) -> dict[str, Any]:
        """The JSON form stored in fingerprints and receipts."""
        return {
            "name": self.name,
            "target": self.target,
            "applied_at": self.applied_at,
            **self.detail,
        }


@dataclass(frozen=True)
class Patch:
    """One entry of the inventory."""

    name: str
    target: str  # "module.attribute" or "env:VARIABLE"
    reason: str
    upstream: str
    predicate: Callable[[dict[str, Any]], Applicability]
    apply_fn: Callable[[dict[str, Any]], tuple[dict[str, Any], Callable[[], None]]]

    def applicability(self, facts: dict[str, Any]) -> Applicability:
        return self.predicate(facts)


_APPLIED: dict[str, AppliedPatch] = {}


# --- triton-system-ptxas --------------------------------------------------------------------


def _ptxas_plan(facts: dict[str, Any]) -> tuple[Applicability, str | None, dict | None]:
    """(applicability, env var to set, system ptxas) for the first device that needs it."""
    if not facts.get("triton"):
        return Applicability(False, "not applicable: Triton is not installed"), None, None
    devices = facts.get("devices") or []
    if not devices:
        return Applicability(False, "not applicable: no CUDA device"), None, None
    ptxas = system_ptxas(facts)
    for device in devices:
        routing = ptxas_routing(facts, device)
        if routing is None or routing.supported is not False:
            continue
        if ptxas is None:
            return (
                Applicability(
                    False,
                    f"{routing.describe()} cannot assemble {routing.target}, "
                    "and no system ptxas was found (install the CUDA "
                    f"toolkit >= {routing.needed_cuda})",
                ),
                None,
                None,
            )
        if not version_at_least(ptxas["version"], routing.needed_cuda or ""):
            return (
                Applicability(
                    False,
                    f"system ptxas {ptxas['path']} is CUDA "
                    f"{ptxas['version']}; {routing.target} needs >= "
                    f"{routing.needed_cuda}",
                ),
                None,
                None,
            )
        return (
            Applicability(
                True,
                f"{routing.describe()} cannot assemble {routing.target}; "
                f"route {routing.env_var} to {ptxas['path']} (CUDA "
                f"{ptxas['version']})",
            ),
            routing.env_var,
            ptxas,
        )
    return Applicability(False, "not needed: Triton's ptxas supports every device here"), None, None


def _apply_system_ptxas(facts: dict[str, Any]) -> tuple[dict[str, Any], Callable[[], None]]:
    applicability, env_var, ptxas = _ptxas_plan(facts)
    if env_var is None or ptxas is None:
        raise MegaCppError(f"patch 'triton-system-ptxas' does not apply: {applicability.reason}")
    previous = os.environ.get(env_var)
    os.environ[env_var] = ptxas["path"]
    _forget_triton_ptxas_version()

    def undo() -> None:
        if previous is None:
            os.environ.pop(env_var, None)
        else:
            os.environ[env_var] = previous
        _forget_triton_ptxas_version()

    detail = {
        "env_var": env_var,
        "value": ptxas["path"],
        "previous": previous,
        "ptxas_version": ptxas["version"],
    }
    return detail, undo


def _forget_triton_ptxas_version() -> None:
    """Triton caches ``ptxas --version`` per process; drop it if Triton is already loaded."""
    compiler = sys.modules.get("triton.backends.nvidia.compiler")
    cached = getattr(compiler, "get_ptxas_version", None)
    if cached is not None and hasattr(cached, "cache_clear"):
        cached.cache_clear()


# --- inductor-big-gpu -----------------------------------------------------------------------

_INDUCTOR_UTILS = "torch._inductor.utils"


def _small_gpus(facts: dict[str, Any]) -> list[dict[str, Any]]:
    return [
        d
        for d in facts.get("devices") or []
        if d.get("sm_count") is not None and d["sm_count"] < INDUCTOR_MIN_SMS
    ]


def _big_gpu_applicability(facts: dict[str, Any]) -> Applicability:
    small = _small_gpus(facts)
    if not small:
        gpus = facts.get("devices") or []
        return Applicability(
            False,
            "not applicable: no CUDA device"
            if not gpus
            else f"not needed: every GPU has >= {INDUCTOR_MIN_SMS} SMs",
        )
    if _inductor_gate() is None:
        return Applicability(
            False, f"not applicable: this torch has no {_INDUCTOR_UTILS}.is_big_gpu"
        )
    names = ", ".join(f"{d.get('name')} ({d['sm_count']} SMs)" for d in small)
    return Applicability(True, f"Inductor gates max-autotune GEMM templates off on {names}")


def _inductor_gate() -> Callable[..., bool] | None:
    try:
        utils = importlib.import_module(_INDUCTOR_UTILS)
    except ImportError:
        return None
    return getattr(utils, "is_big_gpu", None)


def _apply_big_gpu(facts: dict[str, Any]) -> tuple[dict[str, Any], Callable[[], None]]:
    applicability = _big_gpu_applicability(facts)
    if not applicability.applies:
        raise MegaCppError(f"patch 'inductor-big-gpu' does not apply: {applicability.reason}")
    import torch

    utils = importlib.import_module(_INDUCTOR_UTILS)
    original = utils.is_big_gpu

    def is_big_gpu(index_or_device: int | torch.device = 0) -> bool:
        """megacpp patch 'inductor-big-gpu': CUDA GPUs count as big; others as before."""
        device_type = (
            index_or_device.type
            if isinstance(index_or_device, torch.device)
            else utils.get_gpu_type()
        )
        return True if device_type == "cuda" else original(index_or_device)

    utils.is_big_gpu = is_big_gpu

    def undo() -> None:
        utils.is_big_gpu = original

    detail = {
        "replaced": f"{_INDUCTOR_UTILS}.is_big_gpu",
        "sm_counts": sorted({d["sm_count"] for d in _small_gpus(facts)}),
    }
    return detail, undo


# --- the inventory ---------------------------------------------------------------------------

PATCHES: dict[str, Patch] = {
    patch.name: patch
    for patch in (
        Patch(
            name="triton-system-ptxas",
            target="env:TRITON_PTXAS_PATH / env:TRITON_PTXAS_BLACKWELL_PATH",
            reason="Triton's bundled ptxas does not know this device's arch (sm_121a on GB10 "
            "before Triton 3.6: \"Value 'sm_121a' is not defined for option "
            "'gpu-name'\"); route Triton to the CUDA toolkit's ptxas for this process.",
            upstream="https://github.com/triton-lang/triton/issues/8539",
            predicate=lambda facts: _ptxas_plan(facts)[0],
            apply_fn=_apply_system_ptxas,
        ),
        Patch(
            name="inductor-big-gpu",
            target=f"{_INDUCTOR_UTILS}.is_big_gpu",
            reason=f"TorchInductor disables its Triton GEMM templates for max-autotune on GPUs "
            f"with fewer than {INDUCTOR_MIN_SMS} SMs (GB10 has 48). Lifting the gate lets "
            "autotuning consider them; it does not change the hardware.",
            upstream="https://github.com/pytorch/pytorch/blob/main/torch/_inductor/utils.py "
            "(is_big_gpu)",
            predicate=_big_gpu_applicability,
            apply_fn=_apply_big_gpu,
        ),
    )
}


def get_patch(name: str) -> Patch:
    """The inventory entry named ``name`` (a clear error listing the names otherwise)."""
    try:
        return PATCHES[name]
    except KeyError:
        raise MegaCppError(f"unknown patch {name!r}; known patches: {', '.join(PATCHES)}") from None


def apply_patch(name: str, facts: dict[str, Any]) -> AppliedPatch:
    """Apply one patch if its predicate holds for ``facts``; error if not or if applied."""
    patch = get_patch(name)
    if name in _APPLIED:
        raise MegaCppError(f"patch {name!r} is already applied in this process")
    detail, undo = patch.apply_fn(facts)
    applied = AppliedPatch(
        name=name,
        target=patch.target,
        detail=detail,
        applied_at=dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        _undo=undo,
    )
    _APPLIED[name] = applied
    return applied


def apply_applicable(facts: dict[str, Any]) -> list[AppliedPatch]:
    """Apply every inventory patch whose predicate holds (and is not applied yet)."""
    return [
        apply_patch(name, facts)
        for name, patch in PATCHES.items()
        if name not in _APPLIED and patch.applicability(facts).applies
    ]


def applied_patches() -> list[dict[str, Any]]:
    """Records of the patches in effect now, for fingerprints and receipts."""
    return [applied.record() for applied in _APPLIED.values()]


def revert_all() -> None:
    """Revert every applied patch, newest first."""
    for applied in reversed(list(_APPLIED.values())):
        applied.revert()


@contextmanager
def patched(names: list[str], facts: dict[str, Any]) -> Iterator[list[AppliedPatch]]:
    """Apply ``names`` for the duration of a ``with`` block, then revert them."""
    applied: list[AppliedPatch] = []
    try:
        for name in names:
            applied.append(apply_patch(name, facts))
        yield applied
    finally:
        for patch in reversed(applied):
            patch.revert()
