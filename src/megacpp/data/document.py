"""The unit that flows through the corpus pipeline."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(slots=True)
class Document:
    """One C/C++ source file with its provenance.

    ``raw`` holds the file's bytes until the decode step turns them into ``text`` (and drops
    ``raw`` to keep memory flat). ``sha256`` is of the raw bytes as read from disk.
    """

    source_root: str  # the SRC directory given on the command line (absolute)
    rel_path: str  # path relative to source_root, POSIX separators
    size: int  # bytes on disk
    sha256: str  # of the raw bytes
    raw: bytes | None = None
    text: str | None = None
    license: str | None = None  # SPDX id / expression, "unknown" when none detected
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def doc_id(self) -> str:
        """Stable identity of the content (used for train/validation splitting)."""
        return self.sha256
