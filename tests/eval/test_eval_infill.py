"""``megacpp eval infill``: spans cut from held-out C++ (seeded), the FIM prompt, exact-match
scoring on known cases, the CLI with a local checkpoint (tiny preset, random init: scores are
about 0, the mechanics are what is checked) and with a real ``megacpp serve`` on loopback,
and one ``error:`` line for misuse."""

from __future__ import annotations

import json

import pytest
import torch

from megacpp.data.fim import FimIds, psm_prompt
from megacpp.eval.infill import (
    RECEIPT_FILE,
    SAMPLES_FILE,
    SUMMARY_FILE,
    Document,
    InfillTask,
    load_documents,
    make_tasks,
    score,
)
from megacpp.infer.batch import BatchRequest, run_batch
from megacpp.infer.engine import Engine, EngineConfig
from megacpp.infer.generate import TextGenerator
from megacpp.infer.sampling import SamplingParams
from tests.eval.cli_helpers import error_line, run_eval
from tests.infer.server_helpers import save_checkpoint, serve_process, tiny_model, tiny_tokenizer

SOURCE = """#include <vector>

int sum(const std::vector<int>& xs) {
    int total = 0;
    for (int x : xs) {
        total += x;
    }
    return total;
}

int twice(int x) {
    return 2 * x;
}
"""
NON_BLANK = [i for i, line in enumerate(SOURCE.splitlines()) if line.strip()]


@pytest.fixture(autouse=True)
def one_thread():
    """One intra-op thread (the CPU is shared); restored after."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def megacpp(capsys, *args: str) -> tuple[int, str, str]:
    return run_eval(capsys, "infill", *args)


def test_line_spans_are_whole_non_blank_lines_and_reproducible():
    doc = Document("a.cpp", SOURCE)
    tasks = make_tasks([doc], "line", spans_per_document=4, seed=1)
    assert len(tasks) == 4 and len({t.first_line for t in tasks}) == 4
    lines = SOURCE.splitlines(keepends=True)
    for t in tasks:
        assert t.prefix + t.middle + t.suffix == SOURCE
        assert t.num_lines == 1 and t.middle == lines[t.first_line - 1] and t.middle.strip()
        assert t.first_line - 1 in NON_BLANK and t.task_id == f"a.cpp:{t.first_line}"
        assert t.prefix == "".join(lines[: t.first_line - 1])
    assert make_tasks([doc], "line", spans_per_document=4, seed=1) == tasks
    others = [make_tasks([doc], "line", spans_per_document=4, seed=s) for s in range(2, 8)]
    assert any(o != tasks for o in others)
    # more spans asked than lines: every non-blank line once
    every = make_tasks([doc], "line", spans_per_document=100)
    assert sorted(t.first_line - 1 for t in every) == NON_BLANK


def test_block_spans_and_context_cuts():
    tasks = make_tasks([Document("a.cpp", SOURCE)], "block", spans_per_document=3, max_lines=4,
                       seed=5)
    lines = SOURCE.splitlines(keepends=True)
    for t in tasks:
        assert 2 <= t.num_lines <= 4 and t.prefix + t.middle + t.suffix == SOURCE
        assert t.middle == "".join(lines[t.first_line - 1: t.first_line - 1 + t.num_lines])
    (cut,) = make_tasks([Document("a.cpp", SOURCE)], "line", seed=0, prefix_chars=30,
                        suffix_chars=20)
    full = SOURCE.split(cut.middle, 1)
    assert len(cut.prefix) <= 30 and full[0].endswith(cut.prefix)
    assert cut.prefix == "" or full[0][-len(cut.prefix) - 1] == "\n"
    assert len(cut.suffix) <= 20 and full[1].startswith(cut.suffix)
    assert cut.suffix == "" or cut.suffix.endswith("\n")
    assert len(make_tasks([Document("a", SOURCE), Document("b", SOURCE)], limit=1)) == 1


def test_exact_match_on_known_cases():
    assert score("    return 2 * x;\n", "    return 2 * x;")["exact_match"]
    assert score("    return 2 * x;\n", "    return 2 * x;   \n\n")["exact_match"]
    assert not score("    return 2 * x;\n", "return 2 * x;")["exact_match"]  # indentation
    assert not score("    return 2 * x;\n", "    return 2*x;")["exact_match"]
    block = "    int total = 0;\n    for (int x : xs) {\n        total += x;\n"
    partial = score(block, "    int total = 0;\n    for (int y : xs) {\n        total += x;")
    assert not partial["exact_match"] and partial["line_exact_match"] == pytest.approx(2 / 3)
    assert score(block, "")["line_exact_match"] == 0.0
    assert score(block, block + "    }\n") == {
        "exact_match": False, "line_exact_match": 1.0, "expected_lines": 3,
        "generated_lines": 4}


def test_the_engine_gets_the_psm_prompt():
    tok = tiny_tokenizer()
    model = tiny_model(tok.vocab_size)
    params = SamplingParams(temperature=0, max_new_tokens=6)
    prefix, suffix = "int twice(int x) {\n    return ", ";\n}\n"
    (middle,) = TextGenerator(model, tok).infill_all([(prefix, suffix)], params)
    ids = [tok.bos_id, tok.fim_prefix_id, *tok.encode(prefix).tolist(), tok.fim_suffix_id,
           *tok.encode(suffix).tolist(), tok.fim_middle_id]
    assert ids == [tok.bos_id, *psm_prompt(tok.encode(prefix).tolist(),
                                           tok.encode(suffix).tolist(), FimIds.of(tok))]
    engine = Engine(model, tok, EngineConfig(max_num_seqs=1, max_model_len=len(ids) + 6))
    direct = run_batch(engine, [BatchRequest("0", ids, params)])["0"]
    assert middle.text == direct.text


def test_many_middles_go_through_one_engine_with_progress(monkeypatch):
    """More pairs than one engine batch (64 rows): one engine for all of them, each pair's
    completion reported as it finishes, in the same order as returned."""
    tok = tiny_tokenizer()
    generator = TextGenerator(tiny_model(tok.vocab_size), tok)
    engines = []
    real_engine = TextGenerator._engine
    monkeypatch.setattr(TextGenerator, "_engine", lambda self, *a: (
        engines.append(a), real_engine(self, *a))[1])
    pairs = [(f"int f{i}(int x) {{\n    return ", ";\n}\n") for i in range(70)]
    seen = {}
    middles = generator.infill_all(pairs, SamplingParams(temperature=0, max_new_tokens=2),
                                   on_finish=lambda i, c: seen.setdefault(i, c))
    assert len(engines) == 1 and len(middles) == 70
    assert sorted(seen) == list(range(70))
    assert all(seen[i].text == m.text for i, m in enumerate(middles))


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("infill")
    save_checkpoint(tmp / "run", seed=0)
    tokenizer = tiny_tokenizer().save(tmp / "tokenizer.json")
    files = tmp / "heldout"
    (files / "src").mkdir(parents=True)
    (files / "src" / "a.cpp").write_text(SOURCE)
    (files / "b.hpp").write_text("#pragma once\nstruct P {\n    int x;\n    int y;\n};\n")
    (files / "notes.txt").write_text("not C++\n")
    (files / "bad.cc").write_bytes(b"int \xff\xfe x;\n")
    return tmp / "run", tokenizer, files


def _local(capsys, checkpoint, out, *extra):
    run, tokenizer, files = checkpoint
    return megacpp(capsys, str(files), "--checkpoint", str(run), "--tokenizer", str(tokenizer),
                   "--out", str(out), "--max-new-tokens", "4", "--spans-per-file", "2",
                   "--device", "cpu", *extra)


def test_cli_with_a_local_checkpoint_writes_scores_and_a_receipt(checkpoint, tmp_path, capsys):
    out = tmp_path / "eval"
    code, stdout, err = _local(capsys, checkpoint, out)
    assert code == 0, err
    assert "exact match" in stdout and "filling 4 line span(s) from 2 file(s)" in stdout
    records = [json.loads(line) for line in (out / SAMPLES_FILE).read_text().splitlines()]
    assert [r["document"] for r in records] == ["b.hpp", "b.hpp", "src/a.cpp", "src/a.cpp"]
    for r in records:
        assert r["prefix"] + r["middle"] + r["suffix"] == (
            SOURCE if r["document"] == "src/a.cpp" else (checkpoint[2] / "b.hpp").read_text())
        assert r["exact_match"] == score(r["middle"], r["generated"])["exact_match"]
        assert r["finish_reason"] in ("eos", "length", "stop")
    summary = json.loads((out / SUMMARY_FILE).read_text())
    assert summary["exact_match"] == sum(r["exact_match"] for r in records) / 4
    assert summary["source"]["kind"] == "files" and summary["source"]["skipped_not_utf8"] == 1
    receipt = json.loads((out / RECEIPT_FILE).read_text())
    assert receipt["kind"] == "eval" and receipt["metrics"]["tasks"] == 4.0
    assert receipt["config"]["settings"]["span"] == "line"


@pytest.mark.slow
def test_cli_through_megacpp_serve_fills_the_same_middles(checkpoint, tmp_path, capsys):
    run, tokenizer, files = checkpoint
    local_out, served_out = tmp_path / "local", tmp_path / "served"
    assert _local(capsys, checkpoint, local_out, "--span", "block")[0] == 0
    with serve_process("--checkpoint", f"tiny={run}", "--tokenizer", str(tokenizer),
                       "--max-num-seqs", "4", "--max-model-len", "1024") as (url, _):
        code, _, err = megacpp(capsys, str(files), "--endpoint", url, "--model", "tiny",
                                    "--out", str(served_out), "--max-new-tokens", "4",
                                    "--spans-per-file", "2", "--span", "block",
                                    "--concurrency", "2")
    assert code == 0, err
    local = [json.loads(line) for line in (local_out / SAMPLES_FILE).read_text().splitlines()]
    served = [json.loads(line) for line in (served_out / SAMPLES_FILE).read_text().splitlines()]
    assert [r["generated"] for r in served] == [r["generated"] for r in local]
    receipt = json.loads((served_out / RECEIPT_FILE).read_text())
    assert receipt["config"]["model"] == {"endpoint": f"{url}/v1/completions",
                                          "requested": "tiny", "name": "tiny"}


def test_dataset_source_is_its_validation_split(tmp_path):
    from megacpp.data.build import BuildConfig, build_dataset
    from tests.data.packed_fixtures import tiny_config_dict, write_corpus

    out = tmp_path / "dataset"
    build_dataset([write_corpus(tmp_path / "src", real=False)], out,
                  BuildConfig.from_dict(tiny_config_dict(val_permille=300)), workers=1)
    documents, where = load_documents(out)
    from megacpp.data.shards import ShardedDataset

    table = ShardedDataset.open(out).documents(["split", "rel_path"]).to_pylist()
    assert [d.name for d in documents] == [d["rel_path"] for d in table
                                           if d["split"] == "validation"]
    assert where["kind"] == "dataset" and where["split"] == "validation"
    assert isinstance(make_tasks(documents)[0], InfillTask)


@pytest.mark.parametrize("args, needle", [
    (("{tmp}/missing", "--checkpoint", "run"), "does not exist"),
    (("{tmp}",), "give --checkpoint DIR (a local model) or --endpoint URL --model NAME"),
    (("{tmp}", "--endpoint", "http://h/v1", "--model", "m", "--checkpoint", "run"),
     "for a local model"),
    (("{tmp}", "--endpoint", "http://h/v1"), "--endpoint URL and --model NAME go together"),
    (("{tmp}", "--checkpoint", "run"), "holds no C/C++ text files"),
    (("{files}", "--checkpoint", "run", "--span", "word"), "span kind 'word'"),
    (("{files}", "--checkpoint", "run", "--spans-per-file", "0"), "spans per file 0"),
    (("{files}", "--checkpoint", "run", "--span", "block", "--max-lines", "1"),
     "a block has 2 lines"),
    (("{files}", "--checkpoint", "run", "--limit", "0"), "limit 0"),
    (("{files}", "--checkpoint", "run", "--max-new-tokens", "0"), "--max-new-tokens 0"),
    (("{files}", "--checkpoint", "run", "--temperature", "-1"), "--temperature -1"),
])
def test_misuse_is_one_line_and_exit_2(args, needle, tmp_path, capsys):
    files = tmp_path / "files"
    files.mkdir()
    (files / "a.cpp").write_text(SOURCE)
    empty = tmp_path / "empty"
    empty.mkdir()
    argv = [a.format(tmp=empty, files=files) for a in args]
    code, _, err = megacpp(capsys, *argv, "--out", str(tmp_path / "out"))
    assert code == 2 and needle in error_line(err)
    assert not (tmp_path / "out" / RECEIPT_FILE).exists()
