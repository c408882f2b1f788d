"""Write, read and bless receipts. Writes are atomic; reads validate everything."""

from __future__ import annotations

import dataclasses
import datetime as dt
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from megacpp._io import JSON_LIMIT, atomic_write_json, read_json_bounded, sha256_file
from megacpp.contract.diff import contract_differences
from megacpp.contract.fingerprint import capture_fingerprint
from megacpp.contract.integrity import describe_problems, verify_site
from megacpp.contract.preflight import PreflightReport
from megacpp.receipts.schema import (
    KINDS,
    Artifact,
    Receipt,
    ReceiptError,
    check_metrics,
    config_sha256,
    receipt_from_dict,
    split_fingerprint,
)


def write_receipt(
    path: str | os.PathLike[str],
    kind: str,
    config: dict[str, Any],
    metrics: dict[str, float],
    artifacts: Iterable[str | os.PathLike[str]] = (),
    *,
    kernels: dict[str, str] | None = None,
    preflight: PreflightReport | dict[str, Any] | None = None,
    fingerprint: dict[str, Any] | None = None,
    golden: bool = False,
    packages: Iterable[str] | None = None,
    project_root: str | os.PathLike[str] | None = None,
) -> Receipt:
    """Capture the environment (unless ``fingerprint`` is given) and write a receipt.

    ``artifacts`` are files the run produced; each is hashed now. ``preflight`` is the
    report of :func:`megacpp.contract.require_preflight` (its skipped rules are kept).
    ``golden=True`` is refused unless the git tree is clean and every installed contract
    package verifies against its RECORD.
    """
    path = Path(path)
    if kind not in KINDS:
        raise ReceiptError(f"receipt kind {kind!r} is not one of {', '.join(KINDS)}")
    source = f"receipt {path}"
    metrics = check_metrics(metrics, source)
    if fingerprint is None:
        fingerprint = capture_fingerprint(packages=packages, project_root=project_root)
    if golden:
        _require_golden_environment(fingerprint)
    stored_fingerprint, git, patches = split_fingerprint(fingerprint)
    receipt = Receipt(
        kind=kind,
        created=dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        fingerprint=stored_fingerprint,
        git=git,
        patches=patches,
        config=config,
        config_sha256=config_sha256(config),
        kernels=dict(kernels or {}),
        preflight=preflight.to_dict() if isinstance(preflight, PreflightReport) else preflight,
        metrics=metrics,
        artifacts=[_hash_artifact(Path(a), path.parent) for a in artifacts],
        golden=golden,
    )
    receipt_from_dict(receipt.to_dict(), source=source)  # what we write, we can read back
    atomic_write_json(path, receipt.to_dict())
    return receipt


def read_receipt(path: str | os.PathLike[str]) -> Receipt:
    """Read and validate a receipt file; every problem is a one-line :class:`ReceiptError`."""
    data = read_json_bounded(path, JSON_LIMIT, what="receipt file", error=ReceiptError)
    return receipt_from_dict(data, source=str(path))


def _hash_artifact(file: Path, receipt_dir: Path) -> Artifact:
    if not file.is_file():
        raise ReceiptError(f"artifact {file} does not exist (or is not a file)")
    resolved, base = file.resolve(), receipt_dir.resolve()
    stored = (
        resolved.relative_to(base).as_posix() if resolved.is_relative_to(base) else str(resolved)
    )
    return Artifact(path=stored, sha256=sha256_file(resolved), bytes=resolved.stat().st_size)


def verify_artifacts(receipt: Receipt, receipt_path: str | os.PathLike[str]) -> dict[str, str]:
    """``{artifact path: "ok" | "missing" | "modified"}`` against the files on disk now."""
    base = Path(receipt_path).resolve().parent
    status = {}
    for artifact in receipt.artifacts:
        file = base / artifact.path
        if not file.is_file():
            status[artifact.path] = "missing"
        elif file.stat().st_size != artifact.bytes or sha256_file(file) != artifact.sha256:
            status[artifact.path] = "modified"
        else:
            status[artifact.path] = "ok"
    return status


def golden_problems(fingerprint: dict[str, Any]) -> list[str]:
    """Why this environment may not produce a golden receipt (empty: it may).

    The git state is checked first; the (slower) package hashing only runs on a clean tree.
    """
    git = fingerprint.get("git")
    if not git or not git.get("sha"):
        return [
            ("no git commit is known for the project (not a git checkout, no git, or a copy "
             "without history)")
        ]
    if git.get("dirty") is not False:
        return [
            (f"the git tree at {git.get('root')} has uncommitted changes (diff sha256 "
             f"{git.get('diff_sha256')})")
        ]
    problems = []
    installed = [name for name, version in (fingerprint.get("packages") or {}).items() if version]
    for report in verify_site(installed, installed_only=True):
        if not report.ok:
            problems.append(
                f"contract package {report.name} does not verify: {describe_problems(report)}"
            )
    return problems


def _require_golden_environment(fingerprint: dict[str, Any]) -> None:
    problems = golden_problems(fingerprint)
    if problems:
        raise ReceiptError("cannot mark the receipt golden: " + "; ".join(problems))


def mark_golden(
    path: str | os.PathLike[str], project_root: str | os.PathLike[str] | None = None
) -> Receipt:
    """Mark an existing receipt golden, from the environment that produced it.

    Refused unless this machine matches the receipt on every contract field, sits at the
    receipt's (clean) git commit, and its contract packages verify.
    """
    receipt = read_receipt(path)
    if receipt.golden:
        return receipt
    live = capture_fingerprint(
        packages=list(receipt.fingerprint.get("packages") or {}), project_root=project_root
    )
    live["patches"] = receipt.patches  # patches are per process; the receipt's stand
    drift = contract_differences(receipt.full_fingerprint, live)
    if drift:
        fields = ", ".join(d.field for d in drift)
        raise ReceiptError(
            f"cannot mark {path} golden from this environment: it differs on "
            f"contract fields ({fields}); run `megacpp env diff` for details"
        )
    if not receipt.git or receipt.git.get("dirty") is not False:
        raise ReceiptError(
            f"cannot mark {path} golden: it was written from a dirty or unknown git tree"
        )
    if (live.get("git") or {}).get("sha") != receipt.git.get("sha"):
        raise ReceiptError(
            f"cannot mark {path} golden: the checkout is not at the receipt's "
            f"commit {receipt.git.get('sha')}"
        )
    _require_golden_environment(live)
    blessed = dataclasses.replace(receipt, golden=True)
    atomic_write_json(Path(path), blessed.to_dict())
    return blessed
