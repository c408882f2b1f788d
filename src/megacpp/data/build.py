"""``megacpp data build``: sources -> curated documents -> tokenizer -> structure ids -> packed
parquet shards, as one command.

Stages, each counted in the manifest (``stages``):

1. curation (:func:`megacpp.data.curate.curate_stream`): sources walk, binary/decode/size/
   generated/license filters, exact and near dedup -- in the main process; every batch of
   kept documents is handed at once to the worker pool for tree-sitter ``structure`` labels
   (so parsing overlaps curation) and, when a tokenizer is given, token ids too;
2. ``split``: train/validation by content hash, or by source tree (``packing.val_sources``:
   those trees are curated first, so exact and near duplicates of their documents are dropped
   from the train trees), then the seeded shuffle;
3. the tokenizer: the one given, or one trained on (a capped sample of) the train split;
4. ``tokenize`` (a trained tokenizer only): in the worker pool, 64 documents a task; the main
   process maps the tokens onto the structure labels and
5. ``pack``s rows of ``seq_len + 1`` tokens, written to shards as they fill (parquet encoding
   and compression on a writer thread, :class:`megacpp.data.shards.WriteBehind`).

When curation ends, the worker chunks not started yet are resubmitted in packing order
(:meth:`_StructureJobs.prioritize`), so packing overlaps the workers' last chunks.

The output does not depend on the number of workers.

Crash safety: everything is written into ``.<out>.partial`` next to ``out`` under an exclusive
lock (``.<out>.lock``); the manifest and then the ``_COMPLETE`` marker are written last, and
only then is the directory renamed to ``out``. A build killed at any point leaves no ``out``
(or the previous complete one); the next build removes the stale ``.partial`` and starts over.
"""

from __future__ import annotations

import dataclasses
import fcntl
import json
import os
import shutil
import tempfile
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import Executor, Future
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from rich.console import Console
from rich.progress import (
    BarColumn,
    DownloadColumn,
    Progress,
    SpinnerColumn,
    TextColumn,
    TimeElapsedColumn,
    TransferSpeedColumn,
)

from megacpp import __version__, configs
from megacpp._config import build_section, check_keys, parse_toml, read_toml
from megacpp._io import fsync_path, sha256_file
from megacpp.data.config import CorpusConfig
from megacpp.data.curate import curate_stream, curation_steps
from megacpp.data.dedup import ExactDedup, NearDedup
from megacpp.data.document import Document
from megacpp.data.encode import (
    EncodedDoc,
    LabelRuns,
    encode_chunk,
    ordered_map,
    structure_chunk,
    tokenize_chunk,
    worker_pool,
)
from megacpp.data.fim import FimConfig, FimIds, FimPlan, arrange, piece_structure, plan_fim
from megacpp.data.packing import (
    SPLITS,
    TRAIN,
    VALIDATION,
    PackedDocument,
    RowPacker,
    shuffle_key,
    split_of,
    with_bos_eos,
)
from megacpp.data.pipeline import StageStats
from megacpp.data.shards import (
    DATASET_FORMAT,
    DOCUMENTS_FILE,
    MANIFEST,
    MARKER,
    SCHEMA_VERSION,
    TOKENIZER_FILE,
    DocumentsWriter,
    ShardWriter,
    WriteBehind,
    write_manifest_and_marker,
)
from megacpp.data.sources import check_roots
from megacpp.data.structure import NUM_STRUCTURE_IDS, Structure
from megacpp.data.tokenizer import CppTokenizer, iter_capped, train_tokenizer
from megacpp.errors import ConfigError, MegaCppError

# ---- configuration -------------------------------------------------------------------------


@dataclass
class TokenizerConfig:
    """``[tokenizer]``: training knobs (ignored when a tokenizer file is given)."""

    vocab_size: int = 32768
    min_frequency: int = 2
    reserve: bool = True  # reserve C++ keywords/operators/std names as single tokens
    max_train_bytes: int = 32 << 20  # train on at most this much of the train split

    def validate(self) -> None:
        _require(264 <= self.vocab_size <= 1 << 20, "tokenizer.vocab_size",
                 "an integer in 264..1048576")
        _require(1 <= self.min_frequency <= 1 << 31, "tokenizer.min_frequency",
                 "an integer in 1..2^31")
        _require(1 <= self.max_train_bytes <= 1 << 40, "tokenizer.max_train_bytes",
                 "an integer in 1..2^40")


@dataclass
class StructureConfig:
    """``[structure]``: tree-sitter structure ids."""

    enabled: bool = True  # False: every token gets Structure.OTHER
    timeout_s: float = 5.0  # per-document parse deadline; past it the document gets OTHER

    def validate(self) -> None:
        _require(0 < self.timeout_s <= 3600, "structure.timeout_s",
                 "a number of seconds in (0, 3600]")


MAX_SEQ_LEN = 1 << 20  # tokens per packed row at most
MAX_WORKERS = 256  # worker processes of a build at most


@dataclass
class PackingConfig:
    """``[packing]``: rows, split, shuffle and shard sizes."""

    seq_len: int = 2048  # rows hold seq_len + 1 tokens
    seed: int = 0
    val_permille: int = 20  # documents with hash % 1000 < val_permille go to validation
    # non-empty: split by source tree instead -- the documents of the source roots with these
    # names (the root directory's name, e.g. "leveldb") are the validation split, all others
    # train; val_permille is then not used
    val_sources: tuple[str, ...] = ()
    rows_per_shard: int = 4096
    rows_per_group: int = 64  # parquet row group = the loader's unit of reading/shuffling

    def validate(self) -> None:
        _require(1 <= self.seq_len <= MAX_SEQ_LEN, "packing.seq_len",
                 f"an integer in 1..{MAX_SEQ_LEN}")
        _require(0 <= self.seed < 1 << 63, "packing.seed", "an integer in 0..2^63-1")
        _require(0 <= self.val_permille <= 1000, "packing.val_permille", "an integer in 0..1000")
        _require(all(isinstance(v, str) and v for v in self.val_sources),
                 "packing.val_sources", "a list of source root names (non-empty strings)")
        _require(1 <= self.rows_per_shard <= 1 << 24, "packing.rows_per_shard",
                 "an integer in 1..2^24")
        _require(1 <= self.rows_per_group <= 1 << 20, "packing.rows_per_group",
                 "an integer in 1..2^20")


@dataclass
class BuildConfig:
    """The whole build: ``[corpus]`` (see :class:`CorpusConfig`), ``[tokenizer]``,
    ``[structure]``, ``[packing]`` and ``[fim]`` (see :class:`FimConfig`) tables of a TOML
    file."""

    corpus: CorpusConfig = field(default_factory=CorpusConfig)
    tokenizer: TokenizerConfig = field(default_factory=TokenizerConfig)
    structure: StructureConfig = field(default_factory=StructureConfig)
    packing: PackingConfig = field(default_factory=PackingConfig)
    fim: FimConfig = field(default_factory=FimConfig)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> BuildConfig:
        """Validate ``data`` (unknown tables/keys and bad values raise :class:`ConfigError`)."""
        check_keys(data, ("corpus", "tokenizer", "structure", "packing", "fim"),
                   "the build config")
        return cls(
            corpus=CorpusConfig.from_dict(data.get("corpus", {})),
            tokenizer=_section(TokenizerConfig, data, "tokenizer"),
            structure=_section(StructureConfig, data, "structure"),
            packing=_section(PackingConfig, data, "packing"),
            fim=_section(FimConfig, data, "fim"),
        )

    @classmethod
    def from_toml(cls, path: str | Path) -> BuildConfig:
        """A TOML file, or the name of one shipped in ``megacpp/configs/data/`` (``tiny``)."""
        if not configs.is_path(path):
            text = configs.shipped("data", path)
            if text is None:
                raise configs.unknown("data", path)
            return cls.from_dict(parse_toml(text, f"shipped build config {path!r}"))
        return cls.from_dict(read_toml(path, "build config"))

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready, and accepted back by :meth:`from_dict`."""
        return {
            "corpus": self.corpus.to_dict(),
            **{
                name: {key: list(value) if isinstance(value, tuple) else value
                       for key, value in dataclasses.asdict(getattr(self, name)).items()}
                for name in ("tokenizer", "structure", "packing", "fim")
            },
        }


def _require(ok: bool, name: str, accepted: str) -> None:
    if not ok:
        raise ConfigError(f"{name}: expected {accepted}")


def _section(cls: type, data: dict[str, Any], name: str) -> Any:
    """Build dataclass ``cls`` from table ``data[name]``, checking keys and value types."""
    section = build_section(cls, data.get(name, {}), name)
    section.validate()
    return section


# ---- curation ------------------------------------------------------------------------------


def curate_documents(
    sources: Sequence[Path],
    corpus: CorpusConfig,
    progress: Progress,
    on_batch: Callable[[list[Document]], None] | None = None,
    steps: Sequence[Any] | None = None,
) -> tuple[list[Document], list[StageStats]]:
    """Run the curation pipeline (:func:`megacpp.data.curate.curate_stream`) over ``sources``
    with a live counter; returns the kept documents and the per-stage stats. ``on_batch``
    receives the kept documents a batch at a time, as they come (to start work early);
    ``steps``: the curation steps to run (default ``curation_steps(corpus)``)."""
    stream, stats = curate_stream([Path(s).absolute() for s in sources], corpus, steps)
    task = progress.add_task("curating", total=None)
    kept: list[Document] = []
    kept_bytes = 0
    for batch in _batches(stream):
        kept += batch
        kept_bytes += sum(d.size for d in batch)
        if on_batch is not None:
            on_batch(batch)
        progress.update(task, completed=kept_bytes, description=f"curating ({len(kept)} kept)")
    progress.update(task, total=kept_bytes)
    return kept, stats


def _batches(
    docs: Iterable[Document], max_bytes: int = 1 << 20, max_docs: int = 64
) -> Iterator[list[Document]]:
    batch: list[Document] = []
    size = 0
    for doc in docs:
        batch.append(doc)
        size += doc.size
        if size >= max_bytes or len(batch) >= max_docs:
            yield batch
            batch, size = [], 0
    if batch:
        yield batch


@dataclass
class _Planned:
    """A curated document with its split and final index."""

    doc: Document
    split: str
    key: str


def plan_documents(
    docs: Sequence[Document], packing: PackingConfig, val_roots: Sequence[Path] = ()
) -> tuple[list[_Planned], StageStats]:
    """Assign splits and order documents: all train documents (shuffled), then validation.
    With ``val_roots`` (absolute), a document is validation iff it comes from one of them;
    else by its content hash (``packing.val_permille``)."""
    val_root_names = {str(root) for root in val_roots}

    def split(doc: Document) -> str:
        if val_roots:
            return VALIDATION if doc.source_root in val_root_names else TRAIN
        return split_of(doc.sha256, packing.val_permille)

    planned = [_Planned(d, split(d), shuffle_key(d.sha256, packing.seed)) for d in docs]
    planned.sort(key=lambda p: (SPLITS.index(p.split), p.key))
    stats = StageStats("split", seen=len(docs), kept=len(docs))
    stats.bytes_in = stats.bytes_out = sum(d.size for d in docs)
    for p in planned:
        stats.notes[p.split] += 1
    return planned, stats


# ---- the build -----------------------------------------------------------------------------


@dataclass
class BuildResult:
    out: Path
    manifest: dict[str, Any]


def build_dataset(
    sources: Sequence[str | Path],
    out: str | Path,
    cfg: BuildConfig | None = None,
    *,
    tokenizer_path: str | Path | None = None,
    workers: int | None = None,
    overwrite: bool = False,
    console: Console | None = None,
) -> BuildResult:
    """Build a packed dataset from ``sources`` into ``out`` (see the module docstring)."""
    cfg = cfg or BuildConfig()
    out = Path(out).absolute()
    workers = workers if workers is not None else min(os.cpu_count() or 1, 8)
    if not 0 <= workers <= MAX_WORKERS:
        raise MegaCppError(f"workers = {workers}: expected 0..{MAX_WORKERS} (0 or 1: no worker "
                           "processes)")
    console = console or Console(stderr=True, quiet=True)
    check_roots(sources)  # refuse missing sources and a foreign tokenizer before any work
    if tokenizer_path is not None:
        CppTokenizer.load(tokenizer_path)
    with _build_lock(out):
        _check_out(out, overwrite)
        staging = out.parent / f".{out.name}.partial"
        if staging.exists():
            shutil.rmtree(staging)  # left by an interrupted build
        staging.mkdir(parents=True)
        try:
            with _progress(console) as progress:
                manifest = _build_into(
                    staging, [Path(s) for s in sources], cfg, tokenizer_path, workers, progress
                )
        except Exception:
            shutil.rmtree(staging, ignore_errors=True)
            raise
        _publish(staging, out)
    return BuildResult(out, manifest)


def validation_roots(sources: Sequence[Path], names: Sequence[str]) -> list[Path]:
    """The source roots (absolute) that ``packing.val_sources`` names: each name must be the
    directory name of exactly one root."""
    by_name: dict[str, list[Path]] = {}
    for source in sources:
        by_name.setdefault(Path(source).name, []).append(Path(os.path.abspath(source)))
    roots = []
    for name in names:
        found = by_name.get(name, [])
        if len(found) != 1:
            problem = "names no source root" if not found else f"names {len(found)} roots"
            raise ConfigError(
                f"packing.val_sources: {name!r} {problem}; it must be the directory name of "
                f"exactly one source root: {', '.join(sorted(by_name))}"
            )
        if not found[0].is_dir():
            raise ConfigError(f"packing.val_sources: {name!r} is a file; name source directories")
        roots.append(found[0])
    return roots


def _validation_first(sources: Sequence[Path], val_roots: Sequence[Path]) -> list[Path]:
    """``sources`` with the validation roots first (dedup keeps the first copy it sees)."""
    val = {str(root) for root in val_roots}
    rest = [s for s in sources if os.path.abspath(s) not in val]
    return [*val_roots, *rest]


def _count_cross_split(steps: Sequence[Any], val_roots: Sequence[Path], stats: StageStats) -> None:
    """Note the train documents the dedup steps dropped as copies of validation documents."""
    prefixes = tuple(str(root).rstrip("/") + "/" for root in val_roots)
    for step in steps:
        if isinstance(step, (ExactDedup, NearDedup)):
            kind = "exact" if isinstance(step, ExactDedup) else "near"
            for record in step.duplicates:
                if record.kept.startswith(prefixes) and not record.dropped.startswith(prefixes):
                    stats.notes[f"train_dropped_as_{kind}_duplicate_of_validation"] += 1


def _build_into(
    staging: Path,
    sources: list[Path],
    cfg: BuildConfig,
    tokenizer_path: str | Path | None,
    workers: int,
    progress: Progress,
) -> dict[str, Any]:
    given = _copy_given_tokenizer(staging, tokenizer_path)
    val_roots = validation_roots(sources, cfg.packing.val_sources)
    sources = _validation_first(sources, val_roots)
    steps = curation_steps(cfg.corpus)
    with worker_pool(workers) as pool:
        structure = _StructureJobs(pool, cfg.structure, progress, given)
        docs, stages = curate_documents(sources, cfg.corpus, progress, structure.submit, steps)
        planned, split_stats = plan_documents(docs, cfg.packing, val_roots)
        _count_cross_split(steps, val_roots, split_stats)
        del docs
        structure.prioritize([p.doc for p in planned])
        if not any(p.split == TRAIN for p in planned):
            rule = (f"val_sources={cfg.packing.val_sources}" if val_roots
                    else f"val_permille={cfg.packing.val_permille}")
            raise MegaCppError(
                f"no training documents: curation kept {len(planned)} document(s) and "
                f"{rule} sent all of them to validation"
            )
        if val_roots and not any(p.split == VALIDATION for p in planned):
            raise MegaCppError(f"no validation documents: curation kept none from "
                               f"val_sources={cfg.packing.val_sources}")
        tokenizer = _prepare_tokenizer(staging, planned, cfg.tokenizer, given, progress)
        encode_stats, structure_stats, fim_stats, pack_stats = (
            StageStats("tokenize"),
            StageStats("structure"),
            StageStats("fim"),
            StageStats("pack"),
        )
        with WriteBehind() as io:  # parquet compression overlaps the packing on another core
            splits = _pack_all(
                staging,
                planned,
                tokenizer,
                cfg,
                pool,
                structure,
                progress,
                (encode_stats, structure_stats, fim_stats, pack_stats),
                io,
            )
    stages = [*stages, split_stats, encode_stats, structure_stats, fim_stats, pack_stats]
    manifest = _manifest(staging, sources, cfg, tokenizer, len(planned), splits, stages)
    write_manifest_and_marker(staging, manifest)
    return manifest


class _StructureJobs:
    """Structure labelling (and, with a ``tokenizer`` file known up front, tokenization)
    submitted to the worker pool while curation is still running.

    Packing needs the documents in the shuffled ``planned`` order, which is only known once
    curation ends; by then the workers usually still have a backlog (about a third of the
    chunks on 2 cores). :meth:`prioritize` resubmits the backlog in the planned order, so
    packing overlaps the workers' last chunks instead of waiting for all of them. Results do
    not depend on how documents are grouped into chunks."""

    def __init__(
        self, pool: Executor, cfg: StructureConfig, progress: Progress, tokenizer: Path | None
    ) -> None:
        self._pool = pool
        self._cfg = cfg
        self._progress = progress
        self.tokenizer = tokenizer
        what = "structure ids (tree-sitter)" + (" + tokenize" if tokenizer else "")
        self._task = progress.add_task(what, total=0)
        self._submitted_bytes = 0
        self._where: dict[int, tuple[Future, int]] = {}  # id(document) -> (chunk, position)
        self._chunks: dict[Future, list[Document]] = {}  # submitted, maybe not started

    def submit(self, docs: list[Document]) -> None:
        nbytes = sum(d.size for d in docs)
        self._submitted_bytes += nbytes
        self._progress.update(self._task, total=self._submitted_bytes)
        self._submit(docs, nbytes)

    def prioritize(self, order: Sequence[Document]) -> int:
        """Cancel the chunks no worker has started and resubmit their documents sorted by
        their position in ``order`` (every submitted document is in it). Returns how many
        documents moved."""
        position = {id(doc): i for i, doc in enumerate(order)}
        waiting = [doc for future, docs in self._chunks.items() if future.cancel() for doc in docs]
        self._chunks.clear()
        waiting.sort(key=lambda doc: position[id(doc)])
        for batch in _batches(waiting):
            self._submit(batch, sum(d.size for d in batch))
        return len(waiting)

    def _submit(self, docs: list[Document], nbytes: int) -> None:
        texts = [d.text for d in docs]
        timeout_s, enabled = self._cfg.timeout_s, self._cfg.enabled
        if self.tokenizer is None:
            future = self._pool.submit(structure_chunk, texts, timeout_s, enabled)
        else:
            future = self._pool.submit(encode_chunk, texts, str(self.tokenizer), timeout_s, enabled)
        future.add_done_callback(
            lambda f: f.cancelled() or self._progress.update(self._task, advance=nbytes)
        )
        self._chunks[future] = docs
        for i, doc in enumerate(docs):
            self._where[id(doc)] = (future, i)

    def runs(self, doc: Document) -> LabelRuns:
        """The label runs of ``doc`` (waits for its chunk); no ``tokenizer`` given."""
        future, i = self._where.pop(id(doc))
        return future.result()[i]

    def encoded(self, doc: Document) -> EncodedDoc:
        """The tokens and structure ids of ``doc`` (waits for its chunk); ``tokenizer`` given."""
        future, i = self._where.pop(id(doc))
        return future.result()[i]


def _copy_given_tokenizer(staging: Path, given: str | Path | None) -> Path | None:
    """The given tokenizer file copied into the dataset (workers load this copy), or None."""
    if given is None:
        return None
    target = staging / TOKENIZER_FILE
    shutil.copyfile(given, target)
    return target


def _prepare_tokenizer(
    staging: Path,
    planned: Sequence[_Planned],
    cfg: TokenizerConfig,
    given: Path | None,
    progress: Progress,
) -> CppTokenizer:
    if given is not None:  # already copied into staging by _copy_given_tokenizer
        return CppTokenizer.load(given)
    target = staging / TOKENIZER_FILE
    task = progress.add_task(f"training tokenizer (vocab {cfg.vocab_size})", total=None)
    texts = iter_capped((p.doc.text for p in planned if p.split == TRAIN), cfg.max_train_bytes)
    hf = train_tokenizer(
        texts, cfg.vocab_size, min_frequency=cfg.min_frequency, reserve=cfg.reserve
    )
    CppTokenizer.from_hf(hf).save(target)
    progress.update(task, total=1, completed=1)
    return CppTokenizer.load(target)


def _pack_all(
    staging: Path,
    planned: Sequence[_Planned],
    tokenizer: CppTokenizer,
    cfg: BuildConfig,
    pool: Executor,
    structure: _StructureJobs,
    progress: Progress,
    stats: tuple[StageStats, StageStats, StageStats, StageStats],
    io: WriteBehind,
) -> dict[str, dict[str, Any]]:
    encode_stats, structure_stats, fim_stats, pack_stats = stats
    pk = cfg.packing
    packers = {s: RowPacker(pk.seq_len + 1, tokenizer.pad_id) for s in SPLITS}
    writers = {
        s: ShardWriter(
            staging,
            s,
            pk.seq_len + 1,
            rows_per_shard=pk.rows_per_shard,
            rows_per_group=pk.rows_per_group,
            io=io,
        )
        for s in SPLITS
    }
    documents = DocumentsWriter(staging / DOCUMENTS_FILE, io)
    totals = {s: {"documents": 0, "tokens": 0, "bytes": 0} for s in SPLITS}
    task = progress.add_task("tokenize + pack", total=sum(p.doc.size for p in planned))
    chunks = [
        [planned[i] for i in range(start, min(start + 64, len(planned)))]
        for start in range(0, len(planned), 64)
    ]
    encoded = _encoded_chunks(chunks, pool, structure, tokenizer)
    next_index = 0
    for chunk, chunk_encoded in zip(chunks, encoded):
        records = []
        rearranged = _fim_chunk(chunk, chunk_encoded, tokenizer, cfg.fim, fim_stats)
        for p, enc, fim in zip(chunk, chunk_encoded, rearranged):
            _count_encoded(p.doc, enc.ids, enc.outcome, encode_stats, structure_stats)
            ids, doc_structure = (enc.ids, enc.structure_ids) if fim is None else fim[1:]
            tokens, struct_ids = with_bos_eos(
                ids, doc_structure, tokenizer.bos_id, tokenizer.eos_id
            )
            packed = PackedDocument(next_index, p.doc.rel_path, p.doc.sha256, tokens, struct_ids)
            for row in packers[p.split].add(packed):
                writers[p.split].write(row)
            totals[p.split]["documents"] += 1
            totals[p.split]["tokens"] += len(tokens)
            totals[p.split]["bytes"] += p.doc.size
            records.append(_document_record(next_index, p, len(ids),
                                            None if fim is None else fim[0]))
            next_index += 1
        documents.write(records)
        progress.update(task, advance=sum(p.doc.size for p in chunk))
    documents.close()
    return _finish_splits(packers, writers, totals, pack_stats)


def _fim_chunk(
    chunk: list[_Planned],
    encoded: list[EncodedDoc],
    tokenizer: CppTokenizer,
    cfg: FimConfig,
    stats: StageStats,
) -> list[tuple[FimPlan, np.ndarray, np.ndarray] | None]:
    """For each document of a chunk: its FIM plan, token ids and structure ids when it is a
    train document drawn for FIM (:mod:`megacpp.data.fim`), else None. The pieces of all
    the chunk's FIM documents are tokenized in one batch."""
    plans = [
        plan_fim(p.doc.text, p.doc.sha256, cfg) if p.split == TRAIN else None for p in chunk
    ]
    for p, plan in zip(chunk, plans):
        stats.seen += 1
        stats.kept += 1
        stats.bytes_in += p.doc.size
        stats.bytes_out += p.doc.size
        stats.notes["left_to_right" if plan is None else plan.order] += 1
    if not any(plans):
        return [None] * len(chunk)
    fim_ids = FimIds.of(tokenizer)
    texts = [piece for p, plan in zip(chunk, plans) if plan for piece in plan.pieces(p.doc.text)]
    piece_ids = iter(tokenizer.encode_batch(texts))
    out: list[tuple[FimPlan, np.ndarray, np.ndarray] | None] = []
    for p, enc, plan in zip(chunk, encoded, plans):
        if plan is None:
            out.append(None)
            continue
        pieces = (next(piece_ids), next(piece_ids), next(piece_ids))
        labels = piece_structure(enc.ids, enc.structure_ids, tokenizer.token_nbytes, plan,
                                 p.doc.text, pieces)
        out.append((plan, *arrange(plan, pieces, labels, fim_ids)))
    return out


def _encoded_chunks(
    chunks: list[list[_Planned]],
    pool: Executor,
    structure: _StructureJobs,
    tokenizer: CppTokenizer,
) -> Iterator[list[EncodedDoc]]:
    """Each document encoded, chunk by chunk: from the structure jobs when they tokenized
    too, else tokenized now in the pool (a few chunks ahead) and mapped onto the labels."""
    if structure.tokenizer is not None:
        for chunk in chunks:
            yield [structure.encoded(p.doc) for p in chunk]
        return
    texts = ([p.doc.text for p in chunk] for chunk in chunks)
    encoded = ordered_map(pool, tokenize_chunk, texts, tokenizer.path, ahead=4)
    for chunk, chunk_ids in zip(chunks, encoded):
        yield [
            EncodedDoc.from_runs(ids, structure.runs(p.doc), tokenizer.token_nbytes)
            for p, ids in zip(chunk, chunk_ids)
        ]


def _count_encoded(
    doc: Document,
    ids: np.ndarray,
    outcome: str,
    encode_stats: StageStats,
    structure_stats: StageStats,
) -> None:
    for s in (encode_stats, structure_stats):
        s.seen += 1
        s.kept += 1
        s.bytes_in += doc.size
        s.bytes_out += doc.size
    encode_stats.notes["tokens"] += len(ids)
    structure_stats.notes[outcome] += 1


def _finish_splits(
    packers: dict[str, RowPacker],
    writers: dict[str, ShardWriter],
    totals: dict[str, dict[str, Any]],
    pack_stats: StageStats,
) -> dict[str, dict[str, Any]]:
    splits = {}
    for split in SPLITS:
        for row in packers[split].finish():
            writers[split].write(row)
            padding = packers[split].row_len - row.num_tokens
            pack_stats.notes["padding_tokens"] += padding
        shards = writers[split].close()
        rows = sum(s.rows for s in shards)
        pack_stats.notes[f"rows_{split}"] += rows
        pack_stats.notes["documents_split_across_rows"] += packers[split].split_documents
        pack_stats.seen += totals[split]["documents"]
        pack_stats.kept += totals[split]["documents"]
        pack_stats.bytes_in += totals[split]["bytes"]
        pack_stats.bytes_out += totals[split]["bytes"]
        splits[split] = {**totals[split], "rows": rows, "shards": [s.to_dict() for s in shards]}
    return splits


def _document_record(
    index: int, p: _Planned, num_tokens: int, fim: FimPlan | None
) -> dict[str, Any]:
    d = p.doc
    meta = d.meta if fim is None else {
        **d.meta, "fim": {"order": fim.order, "start": fim.start, "end": fim.end}}
    return {
        "doc_index": index,
        "split": p.split,
        "source_root": d.source_root,
        "rel_path": d.rel_path,
        "sha256": d.sha256,
        "size": d.size,
        "license": d.license,
        "num_tokens": num_tokens,
        "text": d.text,
        "meta": json.dumps(meta, sort_keys=True, default=str),
    }


def _manifest(
    staging: Path,
    sources: Sequence[Path],
    cfg: BuildConfig,
    tokenizer: CppTokenizer,
    n_documents: int,
    splits: dict[str, dict[str, Any]],
    stages: Sequence[StageStats],
) -> dict[str, Any]:
    return {
        "format": DATASET_FORMAT,
        "schema_version": SCHEMA_VERSION,
        "megacpp_version": __version__,
        "seq_len": cfg.packing.seq_len,
        "row_len": cfg.packing.seq_len + 1,
        "sources": [str(Path(s).resolve()) for s in sources],
        "config": cfg.to_dict(),
        "tokenizer": {
            "file": TOKENIZER_FILE,
            "sha256": tokenizer.sha256,
            "vocab_size": tokenizer.vocab_size,
            "special_ids": {
                "pad": tokenizer.pad_id,
                "bos": tokenizer.bos_id,
                "eos": tokenizer.eos_id,
                "doc_sep": tokenizer.doc_sep_id,
                "fim_prefix": tokenizer.fim_prefix_id,
                "fim_middle": tokenizer.fim_middle_id,
                "fim_suffix": tokenizer.fim_suffix_id,
            },
        },
        "structure_ids": {str(int(s)): s.name for s in Structure},
        "num_structure_ids": NUM_STRUCTURE_IDS,
        "documents": {
            "file": DOCUMENTS_FILE,
            "count": n_documents,
            "sha256": sha256_file(staging / DOCUMENTS_FILE),
        },
        "splits": splits,
        "stages": [s.to_dict() for s in stages],
    }


# ---- directory handling --------------------------------------------------------------------


def _writable_parent(out: Path) -> None:
    """Create ``out``'s parent directories; a one-line error when ``out`` cannot be written
    there (a parent that is a file, a read-only or virtual file system such as /proc)."""
    for ancestor in out.parents:
        if ancestor.exists() or ancestor.is_symlink():
            if not ancestor.is_dir():
                raise MegaCppError(f"cannot write the dataset {out}: {ancestor} is not a directory")
            break
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise MegaCppError(f"cannot write the dataset {out}: {exc.strerror or exc} "
                           f"({exc.filename or out.parent})") from None
    try:
        tempfile.TemporaryFile(dir=out.parent).close()
    except OSError as exc:
        raise MegaCppError(f"cannot write the dataset {out}: {exc.strerror or exc} "
                           f"({out.parent})") from None


@contextmanager
def _build_lock(out: Path):
    _writable_parent(out)
    lock_path = out.parent / f".{out.name}.lock"
    with open(lock_path, "w") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise MegaCppError(f"another build is writing {out} (lock {lock_path})") from None
        yield


def _check_out(out: Path, overwrite: bool) -> None:
    if not out.exists():
        return
    if out.is_dir() and not any(out.iterdir()):
        return
    is_dataset = out.is_dir() and (out / MANIFEST).is_file()
    if not is_dataset:
        raise MegaCppError(
            f"{out} exists and is not a megacpp dataset; choose an empty or new --out directory"
        )
    if not overwrite:
        state = "complete" if (out / MARKER).is_file() else "incomplete"
        raise MegaCppError(f"{out} already holds a {state} dataset; pass --overwrite to replace it")


def _publish(staging: Path, out: Path) -> None:
    """Move the finished ``staging`` directory to ``out`` (replacing an old dataset)."""
    old = out.parent / f".{out.name}.old"
    if old.exists():
        shutil.rmtree(old)
    if out.exists():
        os.replace(out, old)
    os.replace(staging, out)
    fsync_path(out.parent)
    if old.exists():
        shutil.rmtree(old)


@contextmanager
def _progress(console: Console):
    progress = Progress(
        SpinnerColumn(),
        TextColumn("[progress.description]{task.description}"),
        BarColumn(),
        DownloadColumn(),
        TransferSpeedColumn(),
        TimeElapsedColumn(),
        console=console,
        transient=True,  # the summary replaces it; an error stays one line
    )
    with progress:
        yield progress
