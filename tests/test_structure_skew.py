"""benchmarks/structure_skew.py: the build's structure ids against the ids decoding computes."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

from megacpp.data.structure import Structure
from megacpp.data.tokenizer import CppTokenizer, train_tokenizer
from megacpp.infer.structure import StructureIds

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "structure_skew.py"
DOC = ("#include <vector>\n// a comment that closes\nnamespace n {\nclass C {\n  int x;\n};\n"
       "int add_one(int value) {\n  return value + 1;\n}\n}  // namespace n\n")


def _module():
    spec = importlib.util.spec_from_file_location("structure_skew", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_an_unfinished_body_is_other_when_decoding_and_a_closed_comment_agrees():
    tok = CppTokenizer.from_hf(train_tokenizer([DOC * 20], vocab_size=300))
    ids = [int(i) for i in tok.encode(DOC)]
    pairs = _module().build_and_decode_ids(StructureIds(tok), ids, 0, len(ids))
    assert len(pairs) == len(ids)
    ends = []  # each token's end offset in DOC
    for t in range(len(ids)):
        ends.append(len(tok.decode(ids[: t + 1])))
    body = DOC.index("return value") + len("return")  # inside add_one's body, not yet closed
    t_body = next(t for t, e in enumerate(ends) if e >= body)
    assert pairs[t_body] == (Structure.FUNCTION_BODY, Structure.OTHER)
    comment = DOC.index("closes\n") + len("closes\n")  # the newline ends the // comment
    t_comment = next(t for t, e in enumerate(ends) if e >= comment - 2)
    assert pairs[t_comment] == (Structure.COMMENT, Structure.COMMENT)


def test_the_benchmark_writes_its_results(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    for i in range(2):
        (src / f"f{i}.hpp").write_text(DOC * 30)
    out = tmp_path / "out"
    run = subprocess.run([sys.executable, str(SCRIPT), "--sources", str(src), "--files", "2",
                          "--positions", "20", "--out", str(out)], capture_output=True,
                         text=True, check=False, cwd=ROOT)
    assert run.returncode == 0, run.stderr
    result = json.loads((out / "structure_skew.json").read_text())
    assert result["files"] == 2 and result["tokens"] == 40
    assert result["differ"] == sum(p["tokens"] for p in result["pairs"]
                                   if p["build"] != p["decode"])
    assert 0.0 <= result["differ_rate"] <= 1.0
    assert (out / "receipts" / "structure_skew" / "structure_skew.json").is_file()
    assert "structure_skew.py" in (out / "command.txt").read_text()


def test_bad_arguments_are_one_line_errors(tmp_path):
    for args, needle in ((["--sources", str(tmp_path / "nope")], "no such path"),
                         (["--sources", str(tmp_path)], "no C++ file"),
                         (["--files", "0"], "must be >= 1")):
        run = subprocess.run([sys.executable, str(SCRIPT), *args, "--out", str(tmp_path / "o")],
                             capture_output=True, text=True, check=False, cwd=ROOT)
        assert run.returncode == 2 and needle in run.stderr, run.stderr
