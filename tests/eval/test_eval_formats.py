"""Problem sets in the HumanEval-X, MultiPL-E and MBXP layouts: detection, ``--format``,
program assembly, suite configs, and real g++ runs of the fixtures' reference solutions."""

from __future__ import annotations

import json
import re

import pytest

from megacpp.eval import (
    ProblemSetError,
    SuiteConfigError,
    load_problem_set,
    reference_samples,
    verify_samples,
)
from megacpp.eval.problems import LAYOUTS, detect_layout
from megacpp.eval.suite import FORMATS, LAYOUT_SUITES, read_suite_config, sidecar_path
from tests.eval.conftest import make_verifier
from tests.eval.problem_sets import HUMANEVALX, MBXP, MBXP_MD5, MULTIPL_E, write_jsonl
from tests.eval.test_eval_cli import megacpp

SETS = {"humanevalx": HUMANEVALX, "multipl-e": MULTIPL_E, "mbxp": MBXP}


@pytest.mark.parametrize("suffix", [".jsonl", ".jsonl.gz"])
@pytest.mark.parametrize("layout", sorted(SETS))
def test_each_layout_is_detected_plain_or_gzip(tmp_path, layout, suffix):
    path = write_jsonl(tmp_path / f"set{suffix}", SETS[layout])
    problem_set = load_problem_set(path)
    assert problem_set.layout == layout and problem_set.path == path
    assert problem_set.suite == LAYOUT_SUITES[layout]
    assert len(problem_set.problems) == 2


def test_fields_map_onto_problems(tmp_path):
    multipl_e = load_problem_set(write_jsonl(tmp_path / "m.jsonl", MULTIPL_E)).problems[0]
    assert multipl_e.task_id == "HumanEval_0_add" and multipl_e.test == MULTIPL_E[0]["tests"]
    assert multipl_e.stop_tokens == ("\n}",) and multipl_e.canonical_solution is None
    mbxp = load_problem_set(write_jsonl(tmp_path / "b.jsonl", MBXP)).problems
    assert [p.has_reference for p in mbxp] == [True, False]  # null: no reference solution
    humanevalx = load_problem_set(write_jsonl(tmp_path / "h.jsonl", HUMANEVALX)).problems[0]
    assert humanevalx.declaration == HUMANEVALX[0]["declaration"] and humanevalx.stop_tokens == ()


def test_multipl_e_programs_cut_the_completion_at_the_first_stop_token(tmp_path):
    problem = load_problem_set(write_jsonl(tmp_path / "m.jsonl", MULTIPL_E)).problems[0]
    body = "    return x + y;"
    closed = body + "\n}\n\nint main() { return 1; }\n"  # the brace and whatever followed it
    assert problem.program(closed) == problem.prompt + body + "\n" + problem.test
    assert problem.program(body) == problem.program(closed)  # an already-cut completion
    assert problem.cut("a\n}b\n}") == "a"
    with pytest.raises(ProblemSetError, match="no reference solution"):
        _ = problem.reference_program


def test_humanevalx_and_mbxp_programs_are_prompt_completion_newline_test(tmp_path):
    for layout in ("humanevalx", "mbxp"):
        problem = load_problem_set(write_jsonl(tmp_path / f"{layout}.jsonl", SETS[layout])
                                   ).problems[0]
        completion = "    return {};\n}\n// a trailing comment\n"
        assert problem.program(completion) == problem.prompt + completion + "\n" + problem.test


def test_shared_fields_without_a_marker_are_ambiguous_until_named(tmp_path):
    bare = [{key: record[key] for key in ("task_id", "prompt", "canonical_solution", "test")}
            for record in MBXP]
    path = write_jsonl(tmp_path / "bare.jsonl", bare)
    with pytest.raises(ProblemSetError, match=r"fit the humanevalx and mbxp layouts.*--format"):
        load_problem_set(path)
    assert load_problem_set(path, layout="mbxp").suite == LAYOUT_SUITES["mbxp"]
    assert load_problem_set(path, layout="humanevalx").suite == LAYOUT_SUITES["humanevalx"]


def test_unknown_fields_and_forced_wrong_layouts_name_what_is_needed(tmp_path):
    with pytest.raises(ProblemSetError, match=r"x\.jsonl:1: cannot tell the problem format from "
                                              r"the fields \(code, id\).*multipl-e needs name, "
                                              r"prompt, tests, stop_tokens.*--format"):
        detect_layout({"id": 1, "code": ""}, "x.jsonl:1")
    path = write_jsonl(tmp_path / "mbxp.jsonl", MBXP)
    with pytest.raises(ProblemSetError, match=r"mbxp\.jsonl:1: missing or non-string field\(s\) "
                                              r"name, tests; multipl-e needs"):
        load_problem_set(path, layout="multipl-e")
    with pytest.raises(ProblemSetError, match="unknown problem format 'mbpp'.*humanevalx, "
                                              "multipl-e, mbxp"):
        load_problem_set(path, layout="mbpp")


@pytest.mark.parametrize(("change", "message"), [
    ({"stop_tokens": []}, "field stop_tokens must be a non-empty list"),
    ({"stop_tokens": ["\n}", 3]}, "field stop_tokens must be a non-empty list"),
    ({"language": "java"}, "language 'java': only C\\+\\+ problem sets"),
    ({"tests": None}, "missing or non-string field\\(s\\) tests"),
])
def test_bad_multipl_e_records_are_refused(tmp_path, change, message):
    path = write_jsonl(tmp_path / "bad.jsonl", [MULTIPL_E[0], {**MULTIPL_E[1], **change}])
    with pytest.raises(ProblemSetError, match=f"bad.jsonl:2: {message}"):
        load_problem_set(path, layout="multipl-e")


def test_only_jsonl_files_are_read(tmp_path):
    path = tmp_path / "set.json"
    path.write_text(json.dumps(MBXP[0]))
    with pytest.raises(ProblemSetError, match=r"expected a \.jsonl or \.jsonl\.gz file"):
        load_problem_set(path)


def test_a_sidecar_suite_config_sets_format_and_build(tmp_path):
    path = write_jsonl(tmp_path / "mine.jsonl.gz", MBXP)
    sidecar = sidecar_path(path)
    assert sidecar == tmp_path / "mine.suite.toml"
    sidecar.write_text('name = "mine"\nformat = "humanevalx"\nstd = "c++20"\nflags = ["-O1"]\n'
                       'libs = ["m"]\nheaders = ["cmath"]\n')
    problem_set = load_problem_set(path)
    assert problem_set.layout == "humanevalx"  # the config's format, not detection
    suite = problem_set.suite
    assert (suite.name, suite.std, suite.flags, suite.libs) == ("mine", "c++20", ("-O1",), ("m",))
    assert load_problem_set(path, layout="mbxp").layout == "mbxp"  # --format wins
    build = suite.build_options(std="c++17", pch=False, linker=None)
    assert (build.std, build.flags, build.libs) == ("c++17", ("-O1",), ("m",))  # --std wins
    explicit = tmp_path / "other.toml"
    explicit.write_text('libs = []\n')
    assert load_problem_set(path, suite_config=explicit).suite.libs == ()


@pytest.mark.parametrize(("text", "message"), [
    ('link = ["m"]\n', "unknown key\\(s\\) link; accepted: name, format"),
    ('libs = "crypto"\n', "libs must be a list of strings"),
    ('libs = ["-lcrypto"]\n', "library name '-lcrypto' is invalid"),
    ('std = "c++98"\n', "C\\+\\+ standard 'c\\+\\+98' is not supported"),
    ('flags = ["-o", "x"]\n', "compiler flag '-o' is not accepted"),
    ('headers = ["../etc/passwd"]\n', "header '../etc/passwd' is not a plain include path"),
    ('format = "apps"\n', "format 'apps' is not one of humanevalx, multipl-e, mbxp"),
    ("libs = [\n", "is not valid TOML"),
])
def test_bad_suite_configs_are_refused(tmp_path, text, message):
    path = tmp_path / "bad.suite.toml"
    path.write_text(text)
    with pytest.raises(SuiteConfigError, match=f"suite config .*bad.suite.toml.*{message}"):
        read_suite_config(path)


def test_layout_defaults_keep_humanevalx_and_link_nothing_else():
    assert tuple(LAYOUTS) == FORMATS == tuple(LAYOUT_SUITES)
    assert LAYOUT_SUITES["humanevalx"].libs == ("crypto",)
    assert LAYOUT_SUITES["humanevalx"].headers == ("boost/any.hpp", "openssl/md5.h")
    for layout in ("multipl-e", "mbxp"):
        assert LAYOUT_SUITES[layout].libs == () and LAYOUT_SUITES[layout].probe_source() is None
    assert LAYOUT_SUITES["multipl-e"].std == "c++17" and LAYOUT_SUITES["mbxp"].std == "gnu++17"


def test_reference_solutions_of_every_layout_pass_in_the_sandbox(tmp_path):
    """Real g++: the two HumanEval-X references and MBXP's one (its second has none)."""
    problems = [*load_problem_set(write_jsonl(tmp_path / "h.jsonl", HUMANEVALX)).problems,
                *load_problem_set(write_jsonl(tmp_path / "b.jsonl", MBXP)).problems]
    samples = reference_samples(problems)
    assert [s.task_id for s in samples] == ["CPP/0", "CPP/1", "MBCPP/1"]
    verifier = make_verifier(**vars(LAYOUT_SUITES["mbxp"].build_options(pch=False, linker=None)))
    results = verify_samples(verifier, problems, samples, workers=2)
    assert [(r.sample.task_id, r.verdict.status.value) for r in results] == [
        ("CPP/0", "passed"), ("CPP/1", "passed"), ("MBCPP/1", "passed")]


def test_verify_reference_skips_and_counts_problems_without_one(capsys, tmp_path):
    path = write_jsonl(tmp_path / "mbcpp.jsonl", MBXP)
    code, out, _ = megacpp(capsys, "verify-reference", "--problems", str(path), "--no-pch")
    assert code == 0, out
    assert "skipped 1 of 2 problems without a reference solution" in out and "1/1 passed" in out
    assert "-std=gnu++17 flags=-O0 libs=-" in out  # MBXP's suite: nothing linked
    multipl_e = write_jsonl(tmp_path / "humaneval-cpp.jsonl", MULTIPL_E)
    code, out, err = megacpp(capsys, "verify-reference", "--problems", str(multipl_e))
    assert code == 2 and "skipped 2 of 2" in out
    assert err.strip().splitlines() == [("error: none of the 2 selected problems has a reference "
                                        "solution (canonical_solution); nothing to verify")]


def test_score_multipl_e_completions_cut_at_the_stop_token(capsys, tmp_path):
    problems = write_jsonl(tmp_path / "humaneval-cpp.jsonl.gz", MULTIPL_E)
    rows = [("HumanEval_0_add", "    return x + y;\n}\n\nint main() { return 1; }\n"),
            ("HumanEval_0_add", "    return x - y;"),
            ("HumanEval_1_sum_vector", ("    long s = 0;\n    for (long x : xs) s += x;\n"
                                       "    return s;"))]
    samples = tmp_path / "samples.jsonl"
    samples.write_text("".join(json.dumps({"task_id": t, "completion": c}) + "\n"
                               for t, c in rows))
    code, out, _ = megacpp(capsys, "score", str(samples), "--problems", str(problems),
                           "--out", str(tmp_path / "scored"), "--no-pch", "--k", "1")
    assert code == 0, out
    results = [json.loads(line) for line in (tmp_path / "scored" / "samples.jsonl").open()]
    assert [r["status"] for r in results] == ["passed", "failed", "passed"]
    assert "Assertion" in results[1]["stderr"]
    summary = json.loads((tmp_path / "scored" / "summary.json").read_text())
    assert summary["build"]["libs"] == [] and summary["build"]["std"] == "c++17"


def test_libraries_come_from_the_suite_config(capsys, tmp_path):
    """The MD5 problem fails to link under MBXP's defaults and passes with a sidecar that
    links -lcrypto (and probes <openssl/md5.h> first)."""
    path = write_jsonl(tmp_path / "md5.jsonl", [MBXP_MD5])
    code, out, _ = megacpp(capsys, "verify-reference", "--problems", str(path), "--no-pch")
    assert code == 1 and "compile_error" in out
    sidecar_path(path).write_text('libs = ["crypto"]\nheaders = ["openssl/md5.h"]\n')
    code, out, _ = megacpp(capsys, "verify-reference", "--problems", str(path), "--no-pch")
    assert code == 0 and "1/1 passed" in out and "libs=crypto" in out


@pytest.mark.parametrize(("records", "args", "message"), [
    ([{k: v for k, v in MBXP[0].items() if k not in ("entry_point", "description",
                                                     "language", "completion")}], (),
     "fit the humanevalx and mbxp layouts"),
    ([{"id": "x"}], (), "cannot tell the problem format"),
    (MBXP, ("--format", "multipl-e"), "missing or non-string field\\(s\\) name, tests"),
    (MBXP, ("--format", "apps"), "unknown problem format 'apps'"),
])
def test_bad_or_ambiguous_files_give_one_error_line(capsys, tmp_path, records, args, message):
    path = write_jsonl(tmp_path / "set.jsonl", records)
    for command in (("verify-reference",), ("mutation-check",)):
        code, out, err = megacpp(capsys, *command, "--problems", str(path), *args)
        lines = err.strip().splitlines()
        assert code == 2 and len(lines) == 1 and lines[0].startswith("error: "), err
        assert re.search(message, lines[0]), lines[0]
        assert "Traceback" not in out + err


def test_mutation_check_skips_problems_without_a_reference(capsys, tmp_path):
    path = write_jsonl(tmp_path / "mbcpp.jsonl", MBXP)
    code, out, _ = megacpp(capsys, "mutation-check", "--problems", str(path), "--per-problem",
                           "1", "--no-pch")
    assert code == 0, out
    assert "skipped 1 of 2 problems without a reference solution" in out
    assert "1/1 mutants killed" in out
