"""A corpus pipeline is a list of small steps over a stream of documents.

Each step reads a stream of :class:`Document` and yields the ones it keeps; every drop is
counted under a reason. The counters end up in the dataset manifest, so a reader can see what
each stage removed and why (datatrove's lesson).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from megacpp.data.document import Document


@dataclass
class StageStats:
    """What one stage saw, kept and dropped (by reason)."""

    name: str
    seen: int = 0
    kept: int = 0
    bytes_in: int = 0
    bytes_out: int = 0
    dropped: Counter[str] = field(default_factory=Counter)
    notes: Counter[str] = field(default_factory=Counter)  # non-dropping events (e.g. replaced)

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "seen": self.seen,
            "kept": self.kept,
            "bytes_in": self.bytes_in,
            "bytes_out": self.bytes_out,
            "dropped": dict(sorted(self.dropped.items())),
            "notes": dict(sorted(self.notes.items())),
        }


class Drop(str):
    """A drop reason returned by :meth:`Step.process` instead of a document."""


def require_text(doc: Document, step: str) -> str:
    """``doc.text``, or a clear error when a text step runs before decoding (a bug in the
    step order, not user input)."""
    if doc.text is None:
        raise ValueError(
            f"step {step!r} needs decoded text: put DecodeStep before it ({doc.rel_path})"
        )
    return doc.text


class Step:
    """One pipeline stage. Subclasses override :meth:`process` (per document) or, for stages
    that need the whole stream (e.g. dedup with look-back), :meth:`run`."""

    name: str = "step"

    def process(self, doc: Document, stats: StageStats) -> Document | Drop:
        raise NotImplementedError

    def run(self, docs: Iterable[Document], stats: StageStats) -> Iterator[Document]:
        for doc in docs:
            stats.seen += 1
            stats.bytes_in += doc.size
            out = self.process(doc, stats)
            if isinstance(out, Drop):
                stats.dropped[str(out)] += 1
                continue
            stats.kept += 1
            stats.bytes_out += out.size
            yield out


def run_steps(
    docs: Iterable[Document], steps: Sequence[Step]
) -> tuple[Iterator[Document], list[StageStats]]:
    """Chain ``steps`` lazily over ``docs``. The stats fill in as the stream is consumed."""
    stats: list[StageStats] = []
    stream: Iterable[Document] = docs
    for step in steps:
        s = StageStats(step.name)
        stats.append(s)
        stream = step.run(stream, s)
    return iter(stream), stats
