"""The HumanEval-X C++ loader on the real file, and its failures on broken ones."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

from megacpp._io import sha256_file
from megacpp.eval import (
    ProblemSetError,
    humaneval_build_options,
    load_problems,
    locate_problems,
    select_problems,
)
from megacpp.eval.problems import DATA_ENV, default_problems_path

# Recorded in src/megacpp/eval/data/README.md.
DATA_SHA256 = "dcf2e280a1e91bbc3c5f90edb41397e8a9ac1ccc9f5d2b70082f0b0fbfb6dbb0"


def test_the_default_file_is_the_documented_one():
    path = default_problems_path()
    assert path.name == "humaneval-x-cpp.jsonl.gz" and path.parent.name == "data"
    assert path.parent.parent.name == "eval"
    assert sha256_file(path) == DATA_SHA256


def test_all_164_problems_load_in_order(problems):
    assert [p.task_id for p in problems] == [f"CPP/{i}" for i in range(164)]
    first = problems[0]
    assert first.prompt.rstrip().endswith("{")
    assert first.canonical_solution.rstrip().endswith("}")
    assert "int main()" in first.test and "#undef NDEBUG" in first.test


def test_program_assembly_is_prompt_completion_newline_test(problems):
    problem = problems[3]
    program = problem.program("return 0;}")
    assert program == problem.prompt + "return 0;}" + "\n" + problem.test
    assert problem.reference_program == problem.program(problem.canonical_solution)


def test_location_order_explicit_then_env_then_default(monkeypatch, tmp_path):
    copy = tmp_path / "copy.jsonl.gz"
    copy.write_bytes(default_problems_path().read_bytes())
    monkeypatch.setenv(DATA_ENV, str(copy))
    assert locate_problems() == copy
    assert locate_problems(default_problems_path()) == default_problems_path()
    monkeypatch.delenv(DATA_ENV)
    assert locate_problems() == default_problems_path()


@pytest.mark.parametrize("via_env", [False, True])
def test_a_missing_file_is_a_clear_error(monkeypatch, tmp_path, via_env):
    missing = tmp_path / "absent.jsonl.gz"
    if via_env:
        monkeypatch.setenv(DATA_ENV, str(missing))
    with pytest.raises(ProblemSetError, match=f"not found at {missing}.*--problems"):
        locate_problems(None if via_env else missing)


def _gzip_lines(path: Path, lines: list[str]) -> Path:
    with gzip.open(path, "wt", encoding="utf-8") as out:
        out.write("\n".join(lines) + "\n")
    return path


GOOD = {"task_id": "CPP/0", "prompt": "p", "canonical_solution": "s", "test": "t"}


@pytest.mark.parametrize(("lines", "message"), [
    (["{not json"], ":1: not valid JSON"),
    (["[1, 2]"], "JSON object per line"),
    ([json.dumps({**GOOD, "test": None})], "non-string field.*test"),
    ([json.dumps({k: v for k, v in GOOD.items() if k != "prompt"})], "prompt"),
    ([json.dumps(GOOD), json.dumps(GOOD)], "appears twice"),
    ([json.dumps({**GOOD, "declaration": 3})], "declaration must be a string"),
    ([""], "holds no problems"),
])
def test_malformed_files_are_refused(tmp_path, lines, message):
    path = _gzip_lines(tmp_path / "bad.jsonl.gz", lines)
    with pytest.raises(ProblemSetError, match=message):
        load_problems(path, layout="humanevalx")


def test_a_file_that_is_not_gzip_is_refused(tmp_path):
    path = tmp_path / "plain.jsonl.gz"
    path.write_text(json.dumps(GOOD))
    with pytest.raises(ProblemSetError, match="gzip-compressed JSON Lines"):
        load_problems(path)


def test_selection_by_task_or_limit(problems):
    assert [p.task_id for p in select_problems(problems, ["CPP/5", "CPP/1"])] == ["CPP/5", "CPP/1"]
    assert len(select_problems(problems, limit=7)) == 7
    assert len(select_problems(problems)) == 164
    with pytest.raises(ProblemSetError, match="CPP/999"):
        select_problems(problems, ["CPP/999"])
    with pytest.raises(ProblemSetError, match="--limit"):
        select_problems(problems, limit=0)


def test_humaneval_build_options_link_crypto():
    options = humaneval_build_options(linker=None)
    assert options.libs == ("crypto",) and options.std == "c++17" and options.linker is None
