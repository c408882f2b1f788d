"""The receipt: versioned JSON that records a result and the environment that produced it.

```
{
  "schema": "megacpp.receipt", "schema_version": 1,
  "kind": "train" | "bench" | "eval",
  "created": "2026-11-22T05:47:58+00:00",
  "fingerprint": {...},            # capture_fingerprint() minus git and patches
  "git": {...} | null,             # the fingerprint's git state
  "patches": [...],                # patches applied in the process (the patch lane)
  "config": {...}, "config_sha256": "...",   # sha256 of the canonical JSON of config
  "kernels": {"attention": "triton", ...},  # chosen kernel backend per surface
  "preflight": {"ok", "skipped", "findings"} | null,
  "metrics": {"tokens_per_s": 1234.5, ...}, # finite numbers only
  "artifacts": [{"path", "sha256", "bytes"}],
  "golden": false
}
```

Reading validates all of it and fails with one clear line per problem.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any

from megacpp._io import sha256_bytes
from megacpp.contract.fingerprint import check_fingerprint
from megacpp.errors import MegaCppError

RECEIPT_SCHEMA = "megacpp.receipt"
RECEIPT_VERSION = 1
KINDS = ("train", "bench", "eval")
# Promoted out of the fingerprint to the receipt's top level (see fingerprint_of_receipt).
PROMOTED_FIELDS = ("git", "patches")


class ReceiptError(MegaCppError):
    """A receipt file that cannot be used: corrupt, truncated, wrong schema, bad fields."""


@dataclass(frozen=True)
class Artifact:
    """A file a run produced, pinned by content hash."""

    path: str  # relative to the receipt's directory, or absolute
    sha256: str
    bytes: int


@dataclass(frozen=True)
class Receipt:
    """One result with its environment. Build with :func:`megacpp.receipts.write_receipt`."""

    kind: str
    created: str
    fingerprint: dict[str, Any]
    git: dict[str, Any] | None
    patches: list[dict[str, Any]]
    config: dict[str, Any]
    config_sha256: str
    kernels: dict[str, str]
    preflight: dict[str, Any] | None
    metrics: dict[str, float]
    artifacts: list[Artifact] = field(default_factory=list)
    golden: bool = False

    @property
    def full_fingerprint(self) -> dict[str, Any]:
        """The fingerprint with git and patches put back (what diff_fingerprints compares)."""
        return {**self.fingerprint, "git": self.git, "patches": self.patches}

    @property
    def preflight_skipped(self) -> list[str]:
        return list((self.preflight or {}).get("skipped", []))

    def to_dict(self) -> dict[str, Any]:
        return {
            "schema": RECEIPT_SCHEMA,
            "schema_version": RECEIPT_VERSION,
            "kind": self.kind,
            "created": self.created,
            "fingerprint": self.fingerprint,
            "git": self.git,
            "patches": self.patches,
            "config": self.config,
            "config_sha256": self.config_sha256,
            "kernels": self.kernels,
            "preflight": self.preflight,
            "metrics": self.metrics,
            "artifacts": [a.__dict__ for a in self.artifacts],
            "golden": self.golden,
        }


def config_sha256(config: dict[str, Any]) -> str:
    """sha256 of the canonical JSON (sorted keys, no whitespace) of ``config``."""
    try:
        canonical = json.dumps(config, sort_keys=True, separators=(",", ":"), allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise ReceiptError(f"config must be plain JSON data (no NaN): {exc}") from None
    return sha256_bytes(canonical.encode("utf-8"))


def split_fingerprint(fingerprint: dict[str, Any]) -> tuple[dict[str, Any], Any, list]:
    """``(fingerprint without git/patches, git, patches)`` for storing in a receipt."""
    rest = {k: v for k, v in fingerprint.items() if k not in PROMOTED_FIELDS}
    return rest, fingerprint.get("git"), list(fingerprint.get("patches") or [])


def check_metrics(metrics: Any, source: str) -> dict[str, float]:
    """Metrics are a JSON object of finite numbers keyed by non-empty names."""
    if not isinstance(metrics, dict):
        raise ReceiptError(
            f"{source}: 'metrics' must be an object of numbers, got {type(metrics).__name__}"
        )
    for name, value in metrics.items():
        if not name or not isinstance(value, (int, float)) or isinstance(value, bool):
            raise ReceiptError(f"{source}: metric {name!r} must be a number, got {value!r}")
        if not math.isfinite(value):
            raise ReceiptError(
                f"{source}: metric {name!r} is {value}; receipts hold finite "
                "numbers only (record a diverged run as its own flag)"
            )
    return dict(metrics)


_REQUIRED: dict[str, type | tuple[type, ...]] = {
    "kind": str,
    "created": str,
    "fingerprint": dict,
    "git": (dict, type(None)),
    "patches": list,
    "config": dict,
    "config_sha256": str,
    "kernels": dict,
    "preflight": (dict, type(None)),
    "metrics": dict,
    "artifacts": list,
    "golden": bool,
}


def receipt_from_dict(data: Any, *, source: str) -> Receipt:
    """Validate a parsed receipt; every problem names the file and the field."""
    if not isinstance(data, dict):
        raise ReceiptError(f"{source}: a receipt is a JSON object, got {type(data).__name__}")
    if data.get("schema") != RECEIPT_SCHEMA:
        raise ReceiptError(
            f"{source} is not a megacpp receipt (schema={data.get('schema')!r}, "
            f"expected {RECEIPT_SCHEMA!r})"
        )
    if data.get("schema_version") != RECEIPT_VERSION:
        raise ReceiptError(
            f"{source} has receipt schema_version {data.get('schema_version')!r}; "
            f"this megacpp reads version {RECEIPT_VERSION} (upgrade megacpp to "
            "read newer receipts)"
        )
    missing = [name for name in _REQUIRED if name not in data]
    if missing:
        raise ReceiptError(f"{source} is missing field(s): {', '.join(missing)}")
    for name, expected in _REQUIRED.items():
        if not isinstance(data[name], expected):
            raise ReceiptError(f"{source}: field {name!r} has type {type(data[name]).__name__}")
    if data["kind"] not in KINDS:
        raise ReceiptError(f"{source}: kind {data['kind']!r} is not one of {', '.join(KINDS)}")
    check_fingerprint(data["fingerprint"], source=f"{source} (fingerprint)")
    if config_sha256(data["config"]) != data["config_sha256"]:
        raise ReceiptError(
            f"{source}: config does not match config_sha256 (the receipt was "
            "edited after it was written)"
        )
    return Receipt(
        kind=data["kind"],
        created=data["created"],
        fingerprint=data["fingerprint"],
        git=data["git"],
        patches=data["patches"],
        config=data["config"],
        config_sha256=data["config_sha256"],
        kernels=_string_map(data["kernels"], "kernels", source),
        preflight=data["preflight"],
        metrics=check_metrics(data["metrics"], source),
        artifacts=[_artifact(a, source) for a in data["artifacts"]],
        golden=data["golden"],
    )


def _string_map(value: dict[str, Any], name: str, source: str) -> dict[str, str]:
    if not all(isinstance(k, str) and isinstance(v, str) for k, v in value.items()):
        raise ReceiptError(f"{source}: {name!r} must map names to strings")
    return dict(value)


def _artifact(entry: Any, source: str) -> Artifact:
    ok = (
        isinstance(entry, dict)
        and isinstance(entry.get("path"), str)
        and isinstance(entry.get("sha256"), str)
        and isinstance(entry.get("bytes"), int)
    )
    if not ok:
        raise ReceiptError(f"{source}: artifact entry {entry!r} needs path, sha256 and bytes")
    return Artifact(entry["path"], entry["sha256"], entry["bytes"])
