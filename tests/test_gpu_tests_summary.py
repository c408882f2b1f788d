"""scripts/gpu_tests_summary.py: pytest's end-of-run lines into data."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "gpu_tests_summary.py"

FAILING = """\
..FF.s
=========================== short test summary info ============================
FAILED tests/a.py::test_x[1] - AssertionError: assert None is not None
FAILED tests/a.py::test_x[3] - AssertionError: assert None is not None
2 failed, 3 passed, 1 skipped, 310 deselected, 15 warnings in 213.31s (0:03:33)
"""
CUT = """\
....
tests/b.py:10: KeyboardInterrupt: SIGTERM
4 passed, 30 deselected, 105 warnings in 148.27s (0:02:28)
"""


def test_counts_failures_and_interruptions(tmp_path):
    (tmp_path / "group1.log").write_text(FAILING)
    (tmp_path / "rerun.log").write_text(CUT)
    out = tmp_path / "s" / "gpu_tests.json"
    run = subprocess.run([sys.executable, str(SCRIPT), "--out", str(out),
                          str(tmp_path / "group1.log"), str(tmp_path / "rerun.log")],
                         capture_output=True, text=True, check=False)
    assert run.returncode == 0, run.stderr
    runs = json.loads(out.read_text())["runs"]
    assert runs["group1"] == {"counts": {"failed": 2, "passed": 3, "skipped": 1,
                                         "deselected": 310},
                              "wall_s": 213.31, "interrupted": False,
                              "failed": ["tests/a.py::test_x[1]", "tests/a.py::test_x[3]"]}
    assert runs["rerun"]["interrupted"] and runs["rerun"]["counts"]["passed"] == 4


def test_a_log_without_a_summary_line_is_an_error(tmp_path):
    (tmp_path / "g.log").write_text("....\n")
    run = subprocess.run([sys.executable, str(SCRIPT), "--out", str(tmp_path / "o.json"),
                          str(tmp_path / "g.log")], capture_output=True, text=True, check=False)
    assert run.returncode == 2 and "no pytest summary line" in run.stderr
