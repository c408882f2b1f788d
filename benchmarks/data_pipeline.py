"""Data pipeline throughput: every stage and the whole build, on real C++ headers.

Run (docs/data.md quotes its numbers on a 2-core machine)::

    PYTHONPATH=src python benchmarks/data_pipeline.py \\
        --sources /usr/include/c++/12 /usr/include/boost

It writes ``data_pipeline.json`` and ``command.txt`` to ``--out`` (default
``benchmarks/results/data_pipeline/cpu``: the build runs on the CPU).

Stages (MB = 10^6 bytes of source as read from disk, wall-clock seconds):

* ``curation``: sources walk + every curation step (``curate_stream``), one core.
  "MB of source" everywhere is the size of the C/C++ files the walk picked;
* ``tokenizer train``: BPE training on the train split, capped at ``--train-mb``;
* ``encode (HF encode_batch_fast)``: HF tokenizers with rust parallelism; and
  ``encode (HF encode_batch)``, the same with offsets;
* ``encode (megacpp, 1 process)``: :meth:`CppTokenizer.encode_batch` (same ids), warm cache;
  and ``encode (megacpp, N processes)``: in the build's worker pool (process start included);
* ``structure ids (1 process)``: tree-sitter parse + query + token mapping;
* ``tokenize + structure (N processes)``: what the build runs in its worker pool when the
  tokenizer is given (:func:`megacpp.data.encode.encode_chunk`: ids and per-token structure ids);
* ``pack + write shards``: packing into rows and writing parquet, from encoded documents;
* ``end to end, tokenizer given`` / ``end to end, tokenizer trained``: ``build_dataset``.

The two stages with a target (encode in N processes, end to end with the tokenizer given) run
``--repeats`` times (default 3) and report the median run, with every run's wall clock in
``runs_seconds``. The machine may be shared: the load average before and after is recorded with the numbers,
and every stage also reports MB per CPU-second (user + system time of this process, its
threads and its finished worker processes), which other users' load disturbs much less;
``cpu_seconds_main`` / ``cpu_seconds_workers`` split it between this process (curation,
packing, writing) and the worker processes (tokenize, tree-sitter).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

# megacpp/tokenizers/rich are imported inside the functions: the build's spawned workers
# import this script as their __main__, and should not pay for the whole pipeline's imports.
MB = 1e6
TARGETS = {
    "end to end, tokenizer given": 5.0,
    "encode (HF encode_batch_fast)": 20.0,
    "encode (megacpp, 2 processes)": 20.0,
}


SELF, CHILDREN = resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN


def timed(fn: Callable[[], Any]) -> tuple[tuple[float, float, float], Any]:
    """((wall seconds, CPU seconds of this process, CPU seconds of its finished children),
    result)."""
    start, own, children = time.perf_counter(), _cpu_seconds(SELF), _cpu_seconds(CHILDREN)
    result = fn()
    wall = time.perf_counter() - start
    return (wall, _cpu_seconds(SELF) - own, _cpu_seconds(CHILDREN) - children), result


def timed_median(fn: Callable[[int], Any], repeats: int) -> tuple[tuple[float, float, float], dict]:
    """``fn(i)`` run ``repeats`` times: the times of the median run (by wall clock) and
    ``{"runs_seconds": [...]}`` (every run's wall clock, in order) for the record."""
    runs = [timed(lambda i=i: fn(i))[0] for i in range(repeats)]
    median = sorted(runs)[(len(runs) - 1) // 2]
    return median, {"runs_seconds": [round(r[0], 3) for r in runs]}


def _cpu_seconds(who: int) -> float:
    usage = resource.getrusage(who)
    return usage.ru_utime + usage.ru_stime


def python_loop_seconds() -> float:
    """CPU seconds of a fixed pure-Python loop: how fast this (virtual) CPU is right now.
    Recorded before and after: on a shared host it drifts by tens of percent."""
    start = time.process_time()
    total = 0
    for i in range(5_000_000):
        total += i
    return time.process_time() - start


def chunked(texts: list[str], size: int = 256) -> list[list[str]]:
    return [texts[i : i + size] for i in range(0, len(texts), size)]


def main() -> None:
    import tokenizers
    from rich.console import Console

    from megacpp.data.build import BuildConfig, build_dataset, plan_documents
    from megacpp.data.config import CorpusConfig
    from megacpp.data.curate import curate_stream
    from megacpp.data.encode import encode_chunk, ordered_map, tokenize_chunk, worker_pool
    from megacpp.data.native import native_status
    from megacpp.data.structure import StructureLabeler, token_ends
    from megacpp.data.tokenizer import CppTokenizer, iter_capped, train_tokenizer
    from megacpp.receipts.results import begin, results_dir

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--sources",
        nargs="+",
        type=Path,
        default=[Path("/usr/include/c++/12"), Path("/usr/include/boost")],
    )
    parser.add_argument("--vocab-size", type=int, default=32768)
    parser.add_argument("--train-mb", type=float, default=32 * 1.048576)
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--out", type=Path,
                        default=results_dir("data_pipeline", "cpu", ROOT / "benchmarks" / "results"),
                        help="results folder (default: benchmarks/results/data_pipeline/cpu)")
    parser.add_argument(
        "--repeats", type=int, default=3,
        help="runs of the stages with a target (the median is reported; the VM's speed drifts)",
    )
    args = parser.parse_args()
    missing = [str(s) for s in args.sources if not s.exists()]
    if missing:
        sys.exit(f"missing sources: {', '.join(missing)} (apt-get install -y g++ libboost-dev)")
    begin(args.out, "data_pipeline", "data_pipeline")

    console = Console(stderr=True)
    load_before = os.getloadavg()
    loop_before = python_loop_seconds()
    rows: list[dict[str, Any]] = []

    def record(stage: str, times: tuple[float, float, float], nbytes: int, **extra: Any) -> None:
        wall, cpu_main, cpu_workers = times
        cpu = cpu_main + cpu_workers
        rows.append(
            {
                "stage": stage,
                "mb": round(nbytes / MB, 2),
                "seconds": round(wall, 3),
                "mb_per_s": round(nbytes / MB / wall, 2),
                "cpu_seconds": round(cpu, 3),
                "mb_per_cpu_s": round(nbytes / MB / cpu, 2),
                "cpu_seconds_main": round(cpu_main, 3),
                "cpu_seconds_workers": round(cpu_workers, 3),
                **extra,
            }
        )
        console.print(f"{stage}: {nbytes / MB / wall:.2f} MB/s, {nbytes / MB / cpu:.2f} MB/CPU-s")

    stream, stage_stats = curate_stream(args.sources, CorpusConfig())
    seconds, docs = timed(lambda: list(stream))
    source_bytes = stage_stats[0].bytes_out  # the C/C++ files the walk picked
    record("curation", seconds, source_bytes, documents_kept=len(docs))

    cfg = BuildConfig.from_dict(
        {"tokenizer": {"vocab_size": args.vocab_size, "max_train_bytes": int(args.train_mb * MB)}}
    )
    planned, _ = plan_documents(docs, cfg.packing)
    texts = [p.doc.text for p in planned]
    text_bytes = sum(len(t.encode("utf-8")) for t in texts)
    train_texts = list(
        iter_capped(
            (p.doc.text for p in planned if p.split == "train"), cfg.tokenizer.max_train_bytes
        )
    )
    train_bytes = sum(len(t.encode("utf-8")) for t in train_texts)
    seconds, hf = timed(lambda: train_tokenizer(train_texts, args.vocab_size))
    record("tokenizer train", seconds, train_bytes, vocab_size=args.vocab_size)

    work = Path(tempfile.mkdtemp(prefix="megacpp-bench-"))
    try:
        tok_path = work / "tokenizer.json"
        tok = CppTokenizer.from_hf(hf)
        tok.save(tok_path)
        parallelism = os.environ.get("TOKENIZERS_PARALLELISM", "<unset: rust default = on>")
        seconds, _ = timed(lambda: hf.encode_batch_fast(texts, add_special_tokens=False))
        record(
            "encode (HF encode_batch_fast)",
            seconds,
            text_bytes,
            tokenizers_parallelism=parallelism,
            rayon_threads=os.cpu_count(),
        )
        seconds, _ = timed(lambda: hf.encode_batch(texts, add_special_tokens=False))
        record("encode (HF encode_batch)", seconds, text_bytes)

        fast = CppTokenizer.load(tok_path)
        seconds, _ = timed(lambda: [fast.encode_batch(c) for c in chunked(texts)])
        record("encode (megacpp, 1 process, cold cache)", seconds, text_bytes)
        seconds, encoded = timed(
            lambda: [ids for c in chunked(texts) for ids in fast.encode_batch(c)]
        )
        record("encode (megacpp, 1 process)", seconds, text_bytes)

        def pool_encode(_run: int) -> None:
            with worker_pool(args.workers) as pool:
                for _ in ordered_map(
                    pool, tokenize_chunk, chunked(texts, 64), str(tok_path), ahead=4
                ):
                    pass

        seconds, runs = timed_median(pool_encode, args.repeats)
        record(f"encode (megacpp, {args.workers} processes)", seconds, text_bytes, **runs)

        labeler = StructureLabeler()
        seconds, labels = timed(
            lambda: [
                labeler.token_labels(t.encode("utf-8"), token_ends(ids, fast.token_nbytes))[0]
                for t, ids in zip(texts, encoded)
            ]
        )
        record("structure ids (1 process)", seconds, text_bytes)

        def pool_run() -> None:
            with worker_pool(args.workers) as pool:
                chunks = chunked(texts, 64)
                for _ in ordered_map(pool, encode_chunk, chunks, str(tok_path), 5.0, ahead=8):
                    pass

        seconds, _ = timed(pool_run)
        record(f"tokenize + structure ({args.workers} processes)", seconds, text_bytes)

        seconds, _ = timed(lambda: _pack_and_write(work / "pack", planned, encoded, labels, fast))
        record("pack + write shards", seconds, text_bytes)

        def build_given(run: int) -> None:
            out = work / f"ds1_{run}"
            build_dataset(args.sources, out, cfg, tokenizer_path=tok_path, workers=args.workers)
            shutil.rmtree(out)

        seconds, runs = timed_median(build_given, args.repeats)
        record("end to end, tokenizer given", seconds, source_bytes, **runs)
        seconds, _ = timed(
            lambda: build_dataset(args.sources, work / "ds2", cfg, workers=args.workers)
        )
        record("end to end, tokenizer trained", seconds, source_bytes)
    finally:
        shutil.rmtree(work, ignore_errors=True)

    result = {
        "benchmark": "data_pipeline",
        "sources": [str(s) for s in args.sources],
        "source_mb": round(source_bytes / MB, 2),
        "curated_documents": len(docs),
        "curated_mb": round(text_bytes / MB, 2),
        "vocab_size": args.vocab_size,
        "workers": args.workers,
        "machine": {
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
            "python": platform.python_version(),
            "tokenizers": tokenizers.__version__,
            "megacpp_encoder": native_status(),
            "loadavg_before": [round(x, 2) for x in load_before],
            "loadavg_after": [round(x, 2) for x in os.getloadavg()],
            "python_loop_s_before": round(loop_before, 3),
            "python_loop_s_after": round(python_loop_seconds(), 3),
        },
        "targets_mb_per_s": TARGETS,
        "stages": rows,
    }
    out = args.out / "data_pipeline.json"
    out.write_text(json.dumps(result, indent=2) + "\n")
    _print_table(rows, Console())
    print(f"wrote {out}")


def _pack_and_write(root: Path, planned, encoded, labels, tok) -> None:
    from megacpp.data.packing import PackedDocument, RowPacker, with_bos_eos
    from megacpp.data.shards import ShardWriter, WriteBehind

    packer = RowPacker(2049, tok.pad_id)
    with WriteBehind() as io:  # as the build does: parquet writes on a second thread
        writer = ShardWriter(root, "train", 2049, rows_per_shard=4096, rows_per_group=64, io=io)
        for i, (p, ids, structure) in enumerate(zip(planned, encoded, labels)):
            tokens, struct_ids = with_bos_eos(ids, structure, tok.bos_id, tok.eos_id)
            doc = PackedDocument(i, p.doc.rel_path, p.doc.sha256, tokens, struct_ids)
            for row in packer.add(doc):
                writer.write(row)
        for row in packer.finish():
            writer.write(row)
        writer.close()


def _print_table(rows: list[dict[str, Any]], console) -> None:
    from rich.table import Table

    table = Table(
        title="Data pipeline throughput (MB of source per second: wall clock, and "
        "per CPU-second of this process and its workers)"
    )
    for col in ("stage", "MB", "seconds", "MB/s", "target", "CPU s", "MB/CPU-s"):
        table.add_column(col, justify="left" if col == "stage" else "right")
    for r in rows:
        target = TARGETS.get(r["stage"])
        table.add_row(
            r["stage"],
            f"{r['mb']:.1f}",
            f"{r['seconds']:.1f}",
            f"{r['mb_per_s']:.2f}",
            f">= {target:g}" if target else "",
            f"{r['cpu_seconds']:.1f}",
            f"{r['mb_per_cpu_s']:.2f}",
        )
    console.print(table)


if __name__ == "__main__":
    main()
