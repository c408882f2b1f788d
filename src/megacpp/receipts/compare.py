"""Compare two receipts: metric ratios only when their environments agree on the contract."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from megacpp.contract.diff import Difference, contract_differences
from megacpp.errors import MegaCppError
from megacpp.receipts.schema import Receipt


class DriftError(MegaCppError):
    """The receipts come from environments that differ on contract fields."""

    exit_code = 1

    def __init__(self, drift: list[Difference]) -> None:
        self.drift = drift
        lines = [f"{d.field}: {d.a!r} -> {d.b!r} ({d.reason})" for d in drift]
        super().__init__(
            "refusing to compare: the receipts' environments differ on contract fields:\n  "
            + "\n  ".join(lines)
            + "\n(--allow-drift compares anyway and stamps the output as drifted)"
        )


@dataclass(frozen=True)
class MetricRow:
    name: str
    a: float
    b: float

    @property
    def ratio(self) -> float | None:
        """``b / a``; ``None`` when ``a`` is zero."""
        return self.b / self.a if self.a else None


@dataclass(frozen=True)
class Comparison:
    """Metric rows plus what else differs; ``drift`` is non-empty only when it was allowed."""

    rows: list[MetricRow]
    drift: list[Difference] = field(default_factory=list)
    drift_allowed: bool = False
    notes: list[str] = field(default_factory=list)  # config/kernel/git differences

    def to_dict(self) -> dict[str, Any]:
        return {
            "drift_allowed": self.drift_allowed,
            "drift": [d.to_dict() for d in self.drift],
            "notes": list(self.notes),
            "metrics": [
                {"name": r.name, "a": r.a, "b": r.b, "ratio_b_over_a": r.ratio} for r in self.rows
            ],
        }


def compare_receipts(
    a: Receipt, b: Receipt, metric: str | None = None, allow_drift: bool = False
) -> Comparison:
    """Ratios ``b / a`` of shared metrics (or of ``metric``).

    Raises :class:`DriftError` when the fingerprints differ on contract fields, unless
    ``allow_drift`` -- then the drift is returned with the rows, to be shown with them.
    """
    if a.kind != b.kind:
        raise MegaCppError(f"cannot compare a {a.kind} receipt with a {b.kind} receipt")
    drift = contract_differences(a.full_fingerprint, b.full_fingerprint)
    if drift and not allow_drift:
        raise DriftError(drift)
    return Comparison(
        rows=_rows(a, b, metric), drift=drift, drift_allowed=bool(drift), notes=_notes(a, b)
    )


def _rows(a: Receipt, b: Receipt, metric: str | None) -> list[MetricRow]:
    if metric is not None:
        absent = [label for label, r in (("A", a), ("B", b)) if metric not in r.metrics]
        if absent:
            shared = ", ".join(sorted(a.metrics.keys() & b.metrics.keys())) or "none"
            raise MegaCppError(
                f"metric {metric!r} is not in receipt {' and '.join(absent)}; "
                f"metrics in both: {shared}"
            )
        return [MetricRow(metric, a.metrics[metric], b.metrics[metric])]
    shared = sorted(a.metrics.keys() & b.metrics.keys())
    if not shared:
        raise MegaCppError("the receipts have no metric in common")
    return [MetricRow(name, a.metrics[name], b.metrics[name]) for name in shared]


def _notes(a: Receipt, b: Receipt) -> list[str]:
    notes = []
    if a.config_sha256 != b.config_sha256:
        notes.append("configs differ (config_sha256)")
    if a.kernels != b.kernels:
        notes.append(f"kernel backends differ: {a.kernels} -> {b.kernels}")
    if (a.git or {}).get("sha") != (b.git or {}).get("sha"):
        notes.append(
            f"git commits differ: {(a.git or {}).get('sha')} -> {(b.git or {}).get('sha')}"
        )
    declared = [(r.git or {}).get("declared_commit") for r in (a, b)]
    if any(declared) and declared[0] != declared[1]:
        notes.append(f"declared source commits differ: {declared[0]} -> {declared[1]}")
    if a.preflight_skipped or b.preflight_skipped:
        notes.append(f"skipped preflight rules: A {a.preflight_skipped}, B {b.preflight_skipped}")
    return notes
