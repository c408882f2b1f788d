"""The CPU-heavy per-document work of a build, in a pool of worker processes.

Two kinds of task, so the expensive one can start early:

* :func:`structure_chunk` -- tree-sitter byte labels, returned run-length encoded. It needs no
  tokenizer, so the build submits it while curation is still running (curation on the main
  core, parsing on the others).
* :func:`tokenize_chunk` -- token ids with the (trained) tokenizer; the main process then maps
  token ends onto the label runs (:class:`EncodedDoc.from_runs`).

A tokenizer given up front is known before curation ends, so the build submits one task per
batch instead (:func:`encode_chunk`): token ids and per-token structure ids, all computed in
the worker (the text crosses once, the byte labels never). Either way the main process packs
and writes. With ``workers <= 1`` everything runs inline, with identical results.
"""

from __future__ import annotations

import os
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Executor, Future, ProcessPoolExecutor
from dataclasses import dataclass
from multiprocessing import get_context
from typing import Any

import numpy as np

from megacpp.data.structure import StructureLabeler, token_ends
from megacpp.data.tokenizer import CppTokenizer

STRUCTURE_DISABLED = "disabled"


@dataclass(frozen=True, slots=True)
class LabelRuns:
    """Run-length encoded byte labels of one document and its parse outcome."""

    starts: np.ndarray  # int64[k] first byte of each run (starts[0] == 0 when k > 0)
    values: np.ndarray  # uint8[k] structure id of each run
    outcome: str

    @classmethod
    def encode(cls, labels: np.ndarray, outcome: str) -> LabelRuns:
        starts = np.flatnonzero(np.diff(labels, prepend=np.int16(-1)))  # [k] run starts
        return cls(starts.astype(np.int64), labels[starts], outcome)


@dataclass(frozen=True, slots=True)
class EncodedDoc:
    """One document's token ids, the structure id of each token and the parse outcome."""

    ids: np.ndarray  # int32[n]
    structure_ids: np.ndarray  # uint8[n]
    outcome: str

    @classmethod
    def from_runs(cls, ids: np.ndarray, runs: LabelRuns, token_nbytes: np.ndarray) -> EncodedDoc:
        """Map the tokens ``ids`` onto byte-label ``runs`` (``token_nbytes``: the tokenizer's)."""
        return cls(ids, token_structure(runs, token_ends(ids, token_nbytes)), runs.outcome)


def token_structure(runs: LabelRuns, token_ends: np.ndarray) -> np.ndarray:
    """uint8[n] structure id of each token: the label of its last byte (see structure.py)."""
    if len(token_ends) == 0 or len(runs.starts) == 0:
        return np.zeros(len(token_ends), dtype=np.uint8)
    run = np.searchsorted(runs.starts, np.asarray(token_ends) - 1, side="right") - 1
    return runs.values[run]


# ---- worker-side state (one tokenizer and one parser per process) ---------------------------

_STATE: dict[str, Any] = {}


def _init_worker() -> None:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def _labeler(timeout_s: float) -> StructureLabeler:
    labeler = _STATE.get("labeler")
    if labeler is None or labeler.timeout_s != timeout_s:
        labeler = _STATE["labeler"] = StructureLabeler(timeout_s)
    return labeler


def _tokenizer(path: str) -> CppTokenizer:
    if _STATE.get("tokenizer_path") != path:
        _STATE["tokenizer"], _STATE["tokenizer_path"] = CppTokenizer.load(path), path
    return _STATE["tokenizer"]


def structure_chunk(texts: list[str], timeout_s: float, enabled: bool = True) -> list[LabelRuns]:
    """Byte-label runs of each text (all OTHER, outcome ``disabled``, when not ``enabled``)."""
    if not enabled:
        return [
            LabelRuns(np.zeros(1, np.int64), np.zeros(1, np.uint8), STRUCTURE_DISABLED)
            for _ in texts
        ]
    labeler = _labeler(timeout_s)
    return [LabelRuns.encode(*labeler.byte_labels(t.encode("utf-8"))) for t in texts]


def tokenize_chunk(texts: list[str], tokenizer_path: str) -> list[np.ndarray]:
    """int32 token ids of each text."""
    return _tokenizer(tokenizer_path).encode_batch(texts)


def encode_chunk(
    texts: list[str], tokenizer_path: str, timeout_s: float, enabled: bool = True
) -> list[EncodedDoc]:
    """Token ids and per-token structure ids of each text in one task (when the tokenizer is
    known up front: the texts cross to the worker once, and the labels never leave it)."""
    tokenizer = _tokenizer(tokenizer_path)
    encoded = tokenizer.encode_batch(texts)
    if not enabled:
        return [
            EncodedDoc(ids, np.zeros(len(ids), np.uint8), STRUCTURE_DISABLED) for ids in encoded
        ]
    labeler, nbytes = _labeler(timeout_s), tokenizer.token_nbytes
    return [
        EncodedDoc(ids, *labeler.token_labels(text.encode("utf-8"), token_ends(ids, nbytes)))
        for text, ids in zip(texts, encoded)
    ]


# ---- executors -------------------------------------------------------------------------------


class InlineExecutor(Executor):
    """Runs each task at submit time, in this process (``workers <= 1``)."""

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future:
        future: Future = Future()
        future.set_result(fn(*args, **kwargs))
        return future

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        _STATE.clear()  # the tokenizer's piece cache and the parser


def worker_pool(workers: int) -> Executor:
    """``workers`` spawned processes (never a fork of a process whose tokenizers threads
    ran), or inline. Spawned workers import the caller's ``__main__`` module (Python's rule):
    keep scripts that build datasets light at import time."""
    if workers <= 1:
        return InlineExecutor()
    return ProcessPoolExecutor(workers, get_context("spawn"), _init_worker)


def ordered_map(
    pool: Executor, fn: Callable[..., Any], items: Iterable[Any], *args: Any, ahead: int
) -> Iterator[Any]:
    """``fn(item, *args)`` for each item, in order, with at most ``ahead`` in flight."""
    pending: deque[Future] = deque()
    for item in items:
        pending.append(pool.submit(fn, item, *args))
        if len(pending) >= ahead:
            yield pending.popleft().result()
    while pending:
        yield pending.popleft().result()
