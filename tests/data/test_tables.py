"""Document tables as sources: real parquet written by pyarrow and real JSONL (plain, gzip,
zstd), streamed row by row, bad rows counted by reason, provenance and licence columns kept."""

from __future__ import annotations

import gzip
import json
import os
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from megacpp.cli.main import main
from megacpp.data.config import CorpusConfig
from megacpp.data.curate import curate_stream
from megacpp.data.pipeline import StageStats
from megacpp.data.shards import ShardedDataset
from megacpp.data.sources import iter_sources
from megacpp.errors import MegaCppError
from megacpp.train.config import to_toml
from tests.data.packed_fixtures import SYNTHETIC, real_texts, require_libstdcxx, tiny_config_dict


@pytest.fixture(scope="module")
def CPP() -> list[str]:
    """Distinct C++ files that survive curation: the synthetic ones and real headers."""
    require_libstdcxx()
    return list(SYNTHETIC.values()) + real_texts()


def _parquet(path: Path, rows: list[dict], batch_rows: int = 2) -> Path:
    table = pa.Table.from_pylist(rows, schema=pa.schema([
        ("content", pa.large_string()), ("path", pa.string()), ("repo", pa.string()),
        ("licenses", pa.list_(pa.string()))]))
    pq.write_table(table, path, row_group_size=batch_rows)
    return path


def _jsonl(path: Path, lines: list[str]) -> Path:
    data = "".join(line + "\n" for line in lines).encode()
    if path.name.endswith(".gz"):
        data = gzip.compress(data)
    elif path.name.endswith(".zst"):
        data = pa.Codec("zstd").compress(data, asbytes=True)
    path.write_bytes(data)
    return path


def _read(*roots: Path, cfg: CorpusConfig | None = None):
    stats = StageStats("sources")
    docs = list(iter_sources(roots, cfg or CorpusConfig(), stats))
    return docs, stats


def test_parquet_rows_become_documents_with_provenance(tmp_path, CPP):
    rows = [
        {"content": CPP[0], "path": "src/a.cpp", "repo": "org/lib", "licenses": ["MIT"]},
        {"content": None, "path": "src/b.cpp", "repo": "org/lib", "licenses": None},
        {"content": "# notes", "path": "README.md", "repo": "org/lib", "licenses": None},
        {"content": "#pragma once\nint f();\n", "path": "include/lib", "repo": None,
         "licenses": ["Apache-2.0", "MIT"]},
        {"content": "x" * 5000, "path": "big.h", "repo": "org/lib", "licenses": None},
        {"content": CPP[1], "path": None, "repo": None, "licenses": None},
    ]
    table = _parquet(tmp_path / "stack.parquet", rows)
    docs, stats = _read(table, cfg=CorpusConfig(max_bytes=4096))
    assert [d.rel_path for d in docs] == ["org/lib/src/a.cpp", "include/lib", "row_5"]
    assert all(d.source_root == os.path.abspath(table) for d in docs)
    assert docs[0].raw == CPP[0].encode() and docs[0].meta == {
        "row": 0, "repo": "org/lib", "path": "src/a.cpp", "license_column": "(MIT)",
        "declared_license": "(MIT)"}
    assert docs[1].meta["declared_license"] == "(Apache-2.0) AND (MIT)"
    assert stats.seen == 6 and stats.kept == 3
    assert stats.dropped == {"missing_content": 1, "not_source": 1, "too_large": 1}


def test_jsonl_plain_gzip_and_zstd_count_bad_rows(tmp_path, CPP):
    lines = [
        json.dumps({"content": CPP[2], "path": "x.hpp", "licence": "BSD-3-Clause"}),
        "{not json",
        "[1, 2]",
        json.dumps({"path": "y.cpp"}),
        json.dumps({"content": 42}),
        json.dumps({"content": CPP[3], "repo": ["not", "a", "string"]}),
        json.dumps({"content": CPP[4], "license": "not a licence ((("}),
        "[" * 100_000 + "]" * 100_000,
        "",
        json.dumps({"content": CPP[5]}),
    ]
    for name in ("rows.jsonl", "rows.jsonl.gz", "rows.jsonl.zst"):
        docs, stats = _read(_jsonl(tmp_path / name, lines))
        assert [d.raw.decode() for d in docs] == [CPP[2], CPP[4], CPP[5]], name
        assert [d.rel_path for d in docs] == ["x.hpp", "line_7", "line_10"]
        assert docs[0].meta["declared_license"] == "BSD-3-Clause"
        assert "declared_license" not in docs[1].meta
        assert docs[1].meta["license_column"] == "not a licence ((("
        assert stats.notes["unparsed_license_column"] == 1
        assert stats.dropped == {"bad_json": 2, "not_an_object": 1, "missing_content": 1,
                                 "bad_field": 2}
        assert stats.seen == 9 and stats.kept == 3


def test_a_stream_that_breaks_midway_keeps_the_rows_before_it(tmp_path):
    rng_lines = [json.dumps({"content": f"int v{i} = {i};\n" + os.urandom(600).hex()})
                 for i in range(300)]
    whole = _jsonl(tmp_path / "whole.jsonl.gz", rng_lines).read_bytes()
    cut = tmp_path / "cut.jsonl.gz"
    cut.write_bytes(whole[: len(whole) // 2])
    docs, stats = _read(cut)
    assert 0 < len(docs) < 300 and stats.dropped["table_read_error"] == 1
    assert [d.rel_path for d in docs] == [f"line_{i + 1}" for i in range(len(docs))]


def test_unreadable_tables_are_user_errors_before_anything_runs(tmp_path):
    no_content = tmp_path / "no_content.parquet"
    pq.write_table(pa.table({"text": ["int x;"], "path": ["a.c"]}), no_content)
    with pytest.raises(MegaCppError, match=r"no 'content' column \(columns: text, path\)"):
        _read(no_content)
    garbage = tmp_path / "garbage.parquet"
    garbage.write_bytes(b"not parquet at all")
    with pytest.raises(MegaCppError, match="is not a readable parquet file"):
        _read(garbage)
    bad_zst = tmp_path / "bad.jsonl.zst"
    bad_zst.write_bytes(b"not zstd")
    with pytest.raises(MegaCppError, match="cannot read .*bad.jsonl.zst"):
        _read(bad_zst)


def test_a_declared_licence_drives_the_licence_policy(tmp_path, CPP):
    mit_text = "// SPDX-License-Identifier: MIT\n" + CPP[0]
    table = _parquet(tmp_path / "t.parquet", [
        {"content": mit_text, "path": "a.cpp", "repo": "r", "licenses": ["GPL-3.0-only"]},
        {"content": mit_text.replace("MIT", "MIT "), "path": "b.cpp", "repo": "r",
         "licenses": None},
    ])
    cfg = CorpusConfig(license_deny=("GPL-3.0-only",), near_dedup=False)
    stream, stats = curate_stream([table], cfg)
    kept = list(stream)
    assert [d.rel_path for d in kept] == ["r/b.cpp"] and kept[0].license == "MIT"
    license_stats = next(s for s in stats if s.name == "license")
    assert license_stats.dropped == {"license_denied": 1}


def test_data_build_cli_reads_parquet_and_jsonl(tmp_path, capsys, CPP):
    parquet = _parquet(tmp_path / "part.parquet", [
        {"content": text, "path": f"src/f{i}.cpp", "repo": "org/repo", "licenses": ["MIT"]}
        for i, text in enumerate(CPP[:6])] + [
        {"content": None, "path": "src/gone.cpp", "repo": "org/repo", "licenses": None}])
    jsonl = _jsonl(tmp_path / "part.jsonl.zst", [json.dumps({"content": t}) for t in CPP[6:]]
                   + ["{broken"])
    config = tmp_path / "build.toml"
    config.write_text(to_toml(tiny_config_dict(val_permille=200)))
    out = tmp_path / "ds"
    try:
        main(["data", "build", str(parquet), str(jsonl), "--out", str(out), "--config",
              str(config), "--workers", "1"])
    except SystemExit as exc:
        assert exc.code == 0, capsys.readouterr().err
    dataset = ShardedDataset.open(out)
    sources = next(s for s in dataset.manifest["stages"] if s["name"] == "sources")
    assert sources["seen"] == len(CPP) + 2 and sources["kept"] == len(CPP)
    assert sources["dropped"] == {"bad_json": 1, "missing_content": 1}
    documents = pq.read_table(out / "documents.parquet").to_pylist()
    # every kept row, named by its provenance (SYNTHETIC's hostile.cpp, row 4, is minified:
    # the generated filter drops it)
    assert {d["rel_path"] for d in documents} == {
        f"org/repo/src/f{i}.cpp" for i in (0, 1, 2, 3, 5)} | {
        f"line_{n}" for n in range(1, len(CPP) - 6 + 1)}
    for doc in documents:
        meta = json.loads(doc["meta"])
        if doc["rel_path"].startswith("org/repo/"):
            assert meta["repo"] == "org/repo" and doc["license"] == "(MIT)"
            assert doc["source_root"] == str(parquet)
        else:
            assert meta == {"line": int(doc["rel_path"].removeprefix("line_"))}
            assert doc["source_root"] == str(jsonl)
