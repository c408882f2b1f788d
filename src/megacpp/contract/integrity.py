"""Site-packages integrity: compare installed files with the hashes in their ``RECORD``.

A wheel installer writes ``<dist>.dist-info/RECORD``: one CSV row per installed file with
``sha256=<urlsafe base64, no padding>`` and its size. A file edited in place after install
(the "library patched inside site-packages" trap) no longer matches. Reported per
distribution:

- ``modified``: content (or size) differs from RECORD;
- ``missing``: listed in RECORD, gone from disk;
- ``unexpected``: present inside the distribution's own top-level directories but listed
  in no RECORD of that site directory (``__pycache__`` and ``*.pyc`` are ignored);
- ``unverifiable``: RECORD rows whose hash algorithm is not a safe hashlib algorithm.

Rows without a hash (RECORD itself, byte-compiled ``.pyc``) are counted, not checked.
Rows pointing outside the site directory (``../../bin/tool``) are checked like the others.
"""

from __future__ import annotations

import base64
import csv
import hashlib
import io
import os
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any

from megacpp.contract.fingerprint import normalize_package
from megacpp.errors import MegaCppError

_CHUNK = 1 << 20
_WEAK_HASHES = {"md5", "sha1"}
_MAX_LISTED = 20  # per category in messages; the report keeps them all

# Called after each checked file with (distribution name, files done, files total).
ProgressFn = Callable[[str, int, int], None]


@dataclass
class IntegrityReport:
    """The verification of one installed distribution."""

    name: str
    version: str
    site_dir: str
    checked: int = 0
    unhashed: int = 0
    modified: list[str] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)
    unverifiable: list[str] = field(default_factory=list)
    error: str | None = None  # e.g. no RECORD: nothing could be verified

    @property
    def ok(self) -> bool:
        return self.error is None and not (
            self.modified or self.missing or self.unexpected or self.unverifiable
        )

    def summary(self) -> str:
        if self.error:
            return self.error
        if self.ok:
            return f"{self.checked} files verified"
        parts = [f"{len(v)} {k}" for k, v in self._problems().items() if v]
        return ", ".join(parts)

    def _problems(self) -> dict[str, list[str]]:
        return {
            "modified": self.modified,
            "missing": self.missing,
            "unexpected": self.unexpected,
            "unverifiable": self.unverifiable,
        }

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "ok": self.ok}


@dataclass(frozen=True)
class _RecordRow:
    path: str  # as written in RECORD (forward slashes, relative to the site dir)
    algorithm: str | None
    digest: str | None
    size: int | None


def verify_site(
    names: Iterable[str] | None = None,
    *,
    path: str | os.PathLike[str] | None = None,
    installed_only: bool = False,
    progress: ProgressFn | None = None,
) -> list[IntegrityReport]:
    """Verify distributions against their RECORD files.

    ``names`` selects distributions (``None``: every distribution found); ``path`` is a
    site directory to search instead of ``sys.path``. A named distribution that is not
    installed is an error, unless ``installed_only`` (then it is skipped).
    """
    found = _distributions(path)
    if names is None:
        selected = list(found.values())
    else:
        wanted = [normalize_package(n) for n in names]
        absent = [n for n in wanted if n not in found]
        if absent and not installed_only:
            where = str(path) if path is not None else "sys.path"
            raise MegaCppError(f"not installed in {where}: {', '.join(absent)}")
        selected = [found[n] for n in wanted if n in found]
    return [verify_distribution(dist, progress=progress) for dist in selected]


def _distributions(path: str | os.PathLike[str] | None) -> dict[str, metadata.Distribution]:
    """First distribution of each name, in import order (the one ``import`` would use)."""
    if path is not None and not Path(path).is_dir():
        raise MegaCppError(f"--path {path} is not a directory")
    search = [str(path)] if path is not None else None
    found: dict[str, metadata.Distribution] = {}
    for dist in metadata.distributions(path=search) if search else metadata.distributions():
        name = dist.metadata["Name"]
        if name:
            found.setdefault(normalize_package(name), dist)
    return found


def verify_distribution(
    dist: metadata.Distribution, progress: ProgressFn | None = None
) -> IntegrityReport:
    """Check every RECORD row of one distribution and look for unexpected files."""
    site_dir = Path(str(dist.locate_file(""))).resolve()
    name = normalize_package(dist.metadata["Name"])
    report = IntegrityReport(name=name, version=dist.version, site_dir=str(site_dir))
    record_text = dist.read_text("RECORD")
    if record_text is None:
        report.error = (
            f"{name} {dist.version} has no RECORD file (not installed by a wheel "
            "installer), so its files cannot be verified"
        )
        return report
    rows = _parse_record(record_text)
    for done, row in enumerate(rows, 1):
        _check_row(site_dir, row, report)
        if progress is not None:
            progress(name, done, len(rows))
    report.unexpected = _unexpected_files(site_dir, rows)
    return report


def _parse_record(text: str) -> list[_RecordRow]:
    rows = []
    for fields in csv.reader(io.StringIO(text)):
        if not fields or not fields[0]:
            continue
        path, hash_spec, size = [*fields, "", ""][:3]
        algorithm, _, digest = hash_spec.partition("=")
        rows.append(
            _RecordRow(
                path=path,
                algorithm=algorithm.lower() or None if hash_spec else None,
                digest=digest or None,
                size=int(size) if size.strip().isdigit() else None,
            )
        )
    return rows


def _check_row(site_dir: Path, row: _RecordRow, report: IntegrityReport) -> None:
    if row.algorithm is None:
        report.unhashed += 1
        return
    if row.algorithm in _WEAK_HASHES or row.algorithm not in hashlib.algorithms_guaranteed:
        report.unverifiable.append(f"{row.path} (hash {row.algorithm})")
        return
    file = Path(os.path.normpath(site_dir / row.path))
    report.checked += 1
    if not file.is_file():
        report.missing.append(row.path)
    elif (row.size is not None and file.stat().st_size != row.size) or (
        _record_digest(file, row.algorithm) != row.digest
    ):
        report.modified.append(row.path)


def _record_digest(file: Path, algorithm: str) -> str:
    """RECORD's hash form: urlsafe base64 of the raw digest, ``=`` padding stripped."""
    digest = hashlib.new(algorithm)
    with open(file, "rb") as handle:
        while chunk := handle.read(_CHUNK):
            digest.update(chunk)
    return base64.urlsafe_b64encode(digest.digest()).rstrip(b"=").decode("ascii")


def _unexpected_files(site_dir: Path, rows: list[_RecordRow]) -> list[str]:
    """Files under the distribution's own top-level directories that no RECORD lists."""
    own = {_site_relative(r.path) for r in rows}
    top_dirs = {p.split("/", 1)[0] for p in own if p and "/" in p and not p.startswith("..")}
    candidates = []
    for top in sorted(top_dirs):
        for root, dirs, files in os.walk(site_dir / top):
            dirs[:] = sorted(d for d in dirs if d != "__pycache__")
            for filename in sorted(files):
                rel = Path(root, filename).relative_to(site_dir).as_posix()
                if not filename.endswith(".pyc") and rel not in own:
                    candidates.append(rel)
    if not candidates:
        return []
    claimed = _claimed_by_any_distribution(site_dir)
    return [rel for rel in candidates if rel not in claimed]


def _site_relative(record_path: str) -> str:
    return os.path.normpath(record_path).replace(os.sep, "/")


def _claimed_by_any_distribution(site_dir: Path) -> set[str]:
    """Every path listed in any RECORD under ``site_dir`` (shared namespace directories)."""
    claimed: set[str] = set()
    for dist in metadata.distributions(path=[str(site_dir)]):
        text = dist.read_text("RECORD") or ""
        claimed.update(_site_relative(row.path) for row in _parse_record(text))
    return claimed


def describe_problems(report: IntegrityReport) -> str:
    """One line per problem category, listing up to a few files each."""
    lines = []
    for kind, files in report._problems().items():
        if files:
            shown = ", ".join(files[:_MAX_LISTED])
            more = f" (+{len(files) - _MAX_LISTED} more)" if len(files) > _MAX_LISTED else ""
            lines.append(f"{kind}: {shown}{more}")
    return "; ".join(lines) or report.summary()
