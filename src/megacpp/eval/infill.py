"""Infilling on held-out C++: cut a middle span out of a file, ask the model to fill it from
the text before and after it, and score exact match.

Tasks (:func:`make_tasks`): from each document, ``spans_per_document`` spans of whole lines,
chosen by a generator seeded with ``seed`` and the document's text (the same files and seed
give the same tasks):

* ``line``: one non-blank line;
* ``block``: 2..``max_lines`` consecutive lines starting at a non-blank line.

The prefix is the text before the span (it ends at a line start), the suffix the text after
it; each is cut to at most ``prefix_chars`` / ``suffix_chars`` characters at a line boundary
so prompts fit the model's context.

Scores (:func:`score`): lines compare after trailing whitespace is dropped (indentation
counts), and blank lines at either end of the span or the generated text are ignored.

* ``exact_match``: the generated lines equal the span's lines;
* ``line_exact_match``: the share of the span's lines that the generated text has, the same,
  at the same position (partial credit for blocks; equal to ``exact_match`` for lines).

Documents come from a dataset's validation split (``megacpp data build`` output, never
FIM-transformed) or from C/C++ files under a directory.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from megacpp._io import TEXT_LIMIT, atomic_write_json, atomic_write_text, read_bounded
from megacpp.data.fim import seed_words
from megacpp.errors import MegaCppError
from megacpp.receipts import write_receipt

SPAN_KINDS = ("line", "block")
SAMPLES_FILE, SUMMARY_FILE, RECEIPT_FILE = "infill.jsonl", "summary.json", "receipt.json"
DEFAULT_EXTENSIONS = (".c", ".cc", ".cpp", ".cxx", ".h", ".hh", ".hpp", ".hxx", ".inl", ".ipp",
                      ".tcc")


@dataclass(frozen=True)
class Document:
    name: str  # a path relative to the source, or the dataset's rel_path
    text: str


@dataclass(frozen=True)
class InfillTask:
    task_id: str  # "<document>:<first line>"
    document: str
    kind: str  # "line" | "block"
    first_line: int  # 1-based line number of the span in the document
    num_lines: int
    prefix: str
    middle: str
    suffix: str


@dataclass(frozen=True)
class Filled:
    """One generated middle."""

    text: str
    finish_reason: str | None


@dataclass
class InfillReport:
    exact_match: float
    line_exact_match: float
    tasks: int
    files: dict[str, Path]


# ---- documents --------------------------------------------------------------------------------


def load_documents(source: Path, extensions: Sequence[str] = DEFAULT_EXTENSIONS
                   ) -> tuple[list[Document], dict[str, Any]]:
    """The documents of ``source`` and where they came from: a dataset directory (its
    validation split), a directory of C/C++ files (searched recursively, by extension) or
    one file. Files that are not UTF-8 text are skipped and counted."""
    source = Path(source)
    if not source.exists():
        raise MegaCppError(f"{source} does not exist; give a dataset directory, a directory of "
                           "C/C++ files or one file")
    if source.is_dir() and (source / "manifest.json").is_file():
        return _dataset_documents(source)
    paths = [source] if source.is_file() else sorted(
        p for p in source.rglob("*") if p.is_file() and p.suffix.lower() in extensions)
    documents, skipped = [], 0
    for path in paths:
        try:
            text = read_bounded(path, TEXT_LIMIT, what="C++ source").decode("utf-8")
        except UnicodeDecodeError:
            skipped += 1
            continue
        name = path.name if path == source else path.relative_to(source).as_posix()
        documents.append(Document(name, text))
    if not documents:
        raise MegaCppError(f"{source} holds no C/C++ text files (extensions "
                           f"{', '.join(extensions)})")
    return documents, {"kind": "files", "path": str(source.resolve()), "files": len(paths),
                       "skipped_not_utf8": skipped}


def _dataset_documents(root: Path) -> tuple[list[Document], dict[str, Any]]:
    import pyarrow.compute as pc

    from megacpp.data.packing import VALIDATION
    from megacpp.data.shards import ShardedDataset

    dataset = ShardedDataset.open(root, verify=False)
    table = dataset.documents(["split", "rel_path", "text"])
    # only the validation rows become Python strings (the train split's text is most of it)
    held_out = table.filter(pc.equal(table["split"], VALIDATION))
    documents = [Document(d["rel_path"], d["text"])
                 for d in held_out.select(["rel_path", "text"]).to_pylist()]
    if not documents:
        raise MegaCppError(f"the dataset {root} has no validation documents to hold out")
    return documents, {"kind": "dataset", "path": str(root.resolve()), "split": VALIDATION,
                       "manifest_sha256": dataset.manifest_sha256}


# ---- tasks ------------------------------------------------------------------------------------


def make_tasks(documents: Sequence[Document], kind: str = "line", *, spans_per_document: int = 1,
               max_lines: int = 5, seed: int = 0, prefix_chars: int = 2048,
               suffix_chars: int = 1024, limit: int | None = None) -> list[InfillTask]:
    """Infilling tasks cut from ``documents`` (see the module docstring), at most ``limit``."""
    if kind not in SPAN_KINDS:
        raise MegaCppError(f"span kind {kind!r}: expected one of {', '.join(SPAN_KINDS)}")
    if spans_per_document < 1:
        raise MegaCppError(f"spans per file {spans_per_document}: expected >= 1")
    if kind == "block" and max_lines < 2:
        raise MegaCppError(f"max lines {max_lines}: a block has 2 lines or more")
    if prefix_chars < 0 or suffix_chars < 0:
        raise MegaCppError("prefix and suffix characters must be >= 0")
    if limit is not None and limit < 1:
        raise MegaCppError(f"limit {limit}: expected >= 1")
    tasks = []
    for doc in documents:
        tasks += cut_spans(doc, kind, spans_per_document, max_lines, seed, prefix_chars,
                           suffix_chars)
        if limit is not None and len(tasks) >= limit:
            return tasks[:limit]
    return tasks


def cut_spans(doc: Document, kind: str, count: int, max_lines: int, seed: int,
              prefix_chars: int, suffix_chars: int) -> list[InfillTask]:
    """Up to ``count`` spans of ``doc`` (fewer when it has fewer candidate lines)."""
    lines = doc.text.splitlines(keepends=True)
    rng = np.random.default_rng(_seed_words(seed, doc.text))
    sizes = [1] * len(lines) if kind == "line" else [
        int(rng.integers(2, max_lines + 1)) for _ in lines]
    starts = [i for i, line in enumerate(lines)
              if line.strip() and i + sizes[i] <= len(lines)]
    if not starts:
        return []
    chosen = sorted(rng.choice(starts, size=min(count, len(starts)), replace=False).tolist())
    tasks = []
    for start in chosen:
        end = start + sizes[start]
        prefix = _tail_lines("".join(lines[:start]), prefix_chars)
        suffix = _head_lines("".join(lines[end:]), suffix_chars)
        tasks.append(InfillTask(f"{doc.name}:{start + 1}", doc.name, kind, start + 1,
                                end - start, prefix, "".join(lines[start:end]), suffix))
    return tasks


def _seed_words(seed: int, text: str) -> list[int]:
    return seed_words(f"infill:{seed}:".encode() + text.encode("utf-8", "replace"))


def _tail_lines(text: str, limit: int) -> str:
    """The end of ``text``, at most ``limit`` characters, starting at a line start."""
    if len(text) <= limit:
        return text
    tail = text[len(text) - limit:]
    cut = tail.find("\n")
    return "" if cut < 0 else tail[cut + 1:]


def _head_lines(text: str, limit: int) -> str:
    """The start of ``text``, at most ``limit`` characters, ending after a newline."""
    if len(text) <= limit:
        return text
    head = text[:limit]
    return head[: head.rfind("\n") + 1]


# ---- scoring ----------------------------------------------------------------------------------


def _lines(text: str) -> list[str]:
    lines = [line.rstrip() for line in text.splitlines()]
    while lines and not lines[0]:
        lines.pop(0)
    while lines and not lines[-1]:
        lines.pop()
    return lines


def score(expected: str, generated: str) -> dict[str, Any]:
    """Exact match and line exact match of ``generated`` against the removed ``expected``."""
    want, got = _lines(expected), _lines(generated)
    same = sum(a == b for a, b in zip(want, got))
    return {"exact_match": want == got,
            "line_exact_match": same / len(want) if want else float(want == got),
            "expected_lines": len(want), "generated_lines": len(got)}


# ---- the run ----------------------------------------------------------------------------------


def evaluate_infill(
    tasks: Sequence[InfillTask],
    fill: Callable[[Sequence[InfillTask]], Sequence[Filled]],
    *,
    out_dir: Path,
    model: dict[str, Any],
    settings: dict[str, Any],
    source: dict[str, Any],
) -> InfillReport:
    """Fill every task with ``fill`` (all at once, in task order), score each, and write
    ``infill.jsonl``, ``summary.json`` and an eval receipt to ``out_dir``."""
    if not tasks:
        raise MegaCppError("no infilling tasks: the documents have no non-blank lines to cut")
    started = time.monotonic()
    filled = list(fill(tasks))
    if len(filled) != len(tasks):
        raise MegaCppError(f"the model returned {len(filled)} middles for {len(tasks)} tasks")
    wall_s = time.monotonic() - started
    records = [{**asdict(task), "generated": f.text, "finish_reason": f.finish_reason,
                **score(task.middle, f.text)} for task, f in zip(tasks, filled)]
    exact = sum(r["exact_match"] for r in records) / len(records)
    line_exact = sum(r["line_exact_match"] for r in records) / len(records)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    samples = atomic_write_text(out_dir / SAMPLES_FILE,
                                "".join(json.dumps(r) + "\n" for r in records))
    config = {"model": model, "settings": settings, "source": source}
    summary = atomic_write_json(out_dir / SUMMARY_FILE, {
        "exact_match": exact, "line_exact_match": line_exact, "tasks": len(records),
        "documents": len({t.document for t in tasks}), "wall_s": round(wall_s, 3), **config})
    write_receipt(out_dir / RECEIPT_FILE, "eval", config=config,
                  metrics={"exact_match": exact, "line_exact_match": line_exact,
                           "tasks": float(len(records))},
                  artifacts=[samples, summary])
    return InfillReport(exact, line_exact, len(records),
                        {"samples": samples, "summary": summary, "receipt": out_dir / RECEIPT_FILE})
