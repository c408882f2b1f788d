"""Per-document filters: binary, encoding, size, generated/minified.

Each is a :class:`~megacpp.data.pipeline.Step` that keeps or drops one document under a
named reason (the reasons end up in the manifest).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from megacpp.data.config import NON_UTF8_POLICIES
from megacpp.data.document import Document
from megacpp.data.pipeline import Drop, StageStats, Step, require_text

_BOM = "\ufeff"
MARKER_WINDOW_CHARS = 2048  # generator markers are looked for in the file's head
# Deleting these bytes leaves only the ASCII non-alphanumerics (non-ASCII letters count
# as alphanumeric: identifiers and comments in other scripts are text, not noise).
_ALNUM_BYTES = bytes(c for c in range(256) if chr(c).isascii() and chr(c).isalnum() or c >= 0x80)
_SPACE_BYTES = b" \t\n\r\x0b\x0c"


class BinaryFilter(Step):
    """Drops files containing a NUL byte (``binary``): no C/C++ source has one."""

    name = "binary"

    def process(self, doc: Document, stats: StageStats) -> Document | Drop:
        if doc.raw is not None:
            return Drop("binary") if b"\0" in doc.raw else doc
        return Drop("binary") if "\0" in require_text(doc, self.name) else doc


class DecodeStep(Step):
    """Decodes ``doc.raw`` as UTF-8 into ``doc.text`` and frees ``raw``.

    ``policy="drop"`` drops invalid UTF-8 (``non_utf8``); ``"replace"`` keeps it with U+FFFD
    for each bad sequence (note ``replaced_invalid_utf8``). A leading UTF-8 byte order mark
    is removed (note ``bom_stripped``): it is an encoding artifact, not source text.
    """

    name = "decode"

    def __init__(self, policy: str = "drop") -> None:
        if policy not in NON_UTF8_POLICIES:
            raise ValueError(f"non-UTF-8 policy must be one of {NON_UTF8_POLICIES}, got {policy!r}")
        self.policy = policy

    def process(self, doc: Document, stats: StageStats) -> Document | Drop:
        if doc.raw is None:
            raise ValueError(f"decode needs raw bytes ({doc.rel_path}): was it decoded twice?")
        try:
            text = doc.raw.decode("utf-8")
        except UnicodeDecodeError:
            if self.policy == "drop":
                return Drop("non_utf8")
            text = doc.raw.decode("utf-8", errors="replace")
            stats.notes["replaced_invalid_utf8"] += 1
        if text.startswith(_BOM):
            text = text[1:]
            stats.notes["bom_stripped"] += 1
        doc.text, doc.raw = text, None
        return doc


class SizeFilter(Step):
    """Drops files under ``min_bytes`` (``too_small``), over ``max_bytes`` (``too_large``) or
    with nothing but whitespace (``blank``). Sizes are bytes on disk (``doc.size``)."""

    name = "size"

    def __init__(self, min_bytes: int, max_bytes: int) -> None:
        self.min_bytes, self.max_bytes = min_bytes, max_bytes

    def process(self, doc: Document, stats: StageStats) -> Document | Drop:
        if doc.size < self.min_bytes:
            return Drop("too_small")
        if doc.size > self.max_bytes:
            return Drop("too_large")
        if doc.text is not None and (not doc.text or doc.text.isspace()):
            return Drop("blank")
        return doc


class GeneratedFilter(Step):
    """Drops machine-made files.

    * ``generated_marker``: a marker ("do not edit", "@generated"...) in the first
      :data:`MARKER_WINDOW_CHARS` characters (case-insensitive);
    * ``minified``: a line longer than ``max_line_length`` or a mean line length over
      ``max_mean_line_length`` (minified code, embedded data blobs);
    * ``low_alnum``: fewer than ``min_alnum_ratio`` of the non-whitespace UTF-8 bytes
      alphanumeric (ASCII art, binary dumps as text, tables of punctuation); whitespace is
      left out so that aligned macro continuations and indentation are not penalized.

    Line lengths are in characters.
    """

    name = "generated"

    def __init__(
        self,
        max_line_length: int,
        max_mean_line_length: int,
        min_alnum_ratio: float,
        markers: Sequence[str] = (),
    ) -> None:
        self.max_line_length = max_line_length
        self.max_mean_line_length = max_mean_line_length
        self.min_alnum_ratio = min_alnum_ratio
        self.markers = tuple(m.lower() for m in markers)

    def process(self, doc: Document, stats: StageStats) -> Document | Drop:
        text = require_text(doc, self.name)
        head = text[:MARKER_WINDOW_CHARS].lower()
        if any(marker in head for marker in self.markers):
            return Drop("generated_marker")
        if self._minified(text):
            return Drop("minified")
        data = text.encode("utf-8", "surrogatepass")
        visible = len(data.translate(None, _SPACE_BYTES))  # indentation/alignment never counts
        alnum = len(data) - len(data.translate(None, _ALNUM_BYTES))
        if alnum < self.min_alnum_ratio * visible:
            return Drop("low_alnum")
        return doc

    def _minified(self, text: str) -> bool:
        num_lines = text.count("\n") + 1
        if len(text) > self.max_mean_line_length * num_lines:
            return True
        if len(text) <= self.max_line_length:
            return False
        if not text.isascii():  # characters != bytes: measure the lines themselves
            return max(map(len, text.split("\n"))) > self.max_line_length
        newline = np.flatnonzero(np.frombuffer(text.encode("ascii"), dtype=np.uint8) == 0x0A)
        bounds = np.concatenate(([-1], newline, [len(text)]))  # line i is (bounds[i], bounds[i+1])
        return int(np.diff(bounds).max()) - 1 > self.max_line_length
