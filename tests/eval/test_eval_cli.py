"""``megacpp eval ...`` end to end: real files, real sandbox, exit codes, one-line errors."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from megacpp.eval.harness import RECEIPT_FILE, SAMPLES_FILE, SUMMARY_FILE
from tests.eval.cli_helpers import run_eval as megacpp


def test_sandbox_info_reports_the_mechanisms(capsys):
    code, out, _ = megacpp(capsys, "sandbox-info", "--json")
    info = json.loads(out)
    assert code == 0 and info["isolation"] == "namespaces" and info["probe"] == "ok"
    assert "network namespace" in info["mechanisms"]
    if os.geteuid() == 0:
        assert info["program_uid"] == "65534"
    code, out, _ = megacpp(capsys, "sandbox-info", "--isolation", "rlimits")
    assert code == 0 and "NOT isolated" in out


def test_run_a_file(capsys, tmp_path):
    good = tmp_path / "good.cpp"
    good.write_text('#include <cstdio>\nint main() { std::puts("hello"); }\n')
    code, out, _ = megacpp(capsys, "run", str(good))
    assert code == 0 and "passed" in out and "hello" in out
    bad = tmp_path / "bad.cpp"
    bad.write_text("int main() { return 3; }\n")
    code, out, _ = megacpp(capsys, "run", str(bad), "--json")
    assert code == 1 and json.loads(out)["exit_code"] == 3


def test_verify_reference_writes_results_and_a_receipt(capsys, tmp_path):
    out_dir = tmp_path / "reference"
    code, out, _ = megacpp(capsys, "verify-reference", "--limit", "3", "--no-pch",
                           "--workers", "2", "--out", str(out_dir))
    assert code == 0, out
    assert "3/3 passed" in out
    for name in (SAMPLES_FILE, SUMMARY_FILE, RECEIPT_FILE):
        assert (out_dir / name).is_file()
    assert json.loads((out_dir / SUMMARY_FILE).read_text())["pass_at_k"] == {"pass@1": 1.0}


def test_score_completions_from_a_file(capsys, tmp_path, problems_by_id):
    samples = tmp_path / "samples.jsonl"
    rows = [("CPP/2", problems_by_id["CPP/2"].canonical_solution), ("CPP/2", "throw 1;}"),
            ("CPP/4", "not c++ at all"), ("CPP/4", problems_by_id["CPP/4"].canonical_solution)]
    samples.write_text("".join(json.dumps({"task_id": t, "completion": c}) + "\n" for t, c in rows))
    code, out, _ = megacpp(capsys, "score", str(samples), "--out", str(tmp_path / "scored"),
                           "--no-pch", "--model", "scripted", "--temperature", "0.2")
    assert code == 0, out
    assert "pass@1" in out and "0.5000" in out and "2 of 164" in out
    receipt = json.loads((tmp_path / "scored" / RECEIPT_FILE).read_text())
    assert receipt["config"]["model"]["name"] == "scripted"
    assert receipt["config"]["sampling"]["temperature"] == 0.2


def test_mutation_check_gate(capsys):
    code, out, _ = megacpp(capsys, "mutation-check", "--task", "CPP/2", "--per-problem", "1",
                           "--no-pch")
    assert code == 0 and "1/1 mutants killed" in out
    code, _, _ = megacpp(capsys, "mutation-check", "--task", "CPP/2", "--per-problem", "1",
                         "--no-pch", "--min-kill-rate", "1.01")
    assert code == 1


@pytest.mark.parametrize(("args", "message"), [
    (["verify-reference", "--problems", "/no/such/file.jsonl.gz"], "not found at /no/such"),
    (["verify-reference", "--task", "CPP/999", "--no-pch"], "unknown task id"),
    (["verify-reference", "--limit", "1", "--std", "c++98"], "c++98"),
    (["verify-reference", "--limit", "1", "--linker", "ld"], "linker 'ld'"),
    (["run", "/no/such/file.cpp"], "C++ source /no/such/file.cpp does not exist"),
    (["run", "/no/such/file.cpp", "--wall", "nan"], "--wall nan: expected a number > 0"),
    (["run", "/no/such/file.cpp", "--wall", "inf"], "--wall inf: expected a number > 0"),
    (["run", "/dev/zero"], "C++ source /dev/zero is a character device"),
    (["score", "/no/such/samples.jsonl", "--out", "/tmp/x"], "does not exist"),
    (["sandbox-info", "--isolation", "chroot"], "isolation 'chroot'"),
])
def test_bad_input_is_one_line_and_exit_2(capsys, args, message):
    code, _, err = megacpp(capsys, *args)
    assert code == 2
    assert message in err and "Traceback" not in err


def test_the_console_script_prints_no_traceback(tmp_path):
    done = subprocess.run([sys.executable, "-m", "megacpp", "eval", "run", str(tmp_path / "x.cpp")],
                          capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 2
    assert "error:" in done.stderr and "Traceback" not in done.stderr


def test_the_eval_path_warns_in_one_line_when_the_host_lacks_a_guarantee(tmp_path):
    """A real ``megacpp eval run`` process: one warning line, the verdict still comes, and it
    names the weaker memory bound."""
    good = tmp_path / "good.cpp"
    good.write_text('#include <cstdio>\nint main() { std::puts("hello"); }\n')
    env = {**os.environ, "MEGACPP_SANDBOX_CGROUP": "off"}
    done = subprocess.run([sys.executable, "-m", "megacpp", "eval", "run", str(good),
                           "--json"], capture_output=True, text=True, env=env, timeout=120,
                          check=False)
    assert done.returncode == 0, done.stderr
    (warning,) = done.stderr.splitlines()
    assert warning.startswith("warning: no memory cgroup for sandboxed runs (disabled by "
                              "MEGACPP_SANDBOX_CGROUP=off): memory is bounded per process")
    assert json.loads(done.stdout)["memory_bound"].startswith("rlimits only:")
    bad = subprocess.run([sys.executable, "-m", "megacpp", "eval", "run", str(good)],
                         capture_output=True, text=True, timeout=120, check=False,
                         env={**env, "MEGACPP_SANDBOX_CGROUP": str(tmp_path)})
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1
    assert bad.stderr.startswith("error: MEGACPP_SANDBOX_CGROUP=") and "Traceback" not in bad.stderr
