"""Run a test module's check function under the Triton CPU interpreter, in a fresh process.

``TRITON_INTERPRET`` is read when triton is imported, so the check runs in a subprocess with
it set; the check function returns its measured errors, which are printed for the log."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def run_interpreter_check(test_file: str, check: str) -> None:
    """Import ``test_file``'s module (a path next to this file) and call ``check()`` under
    ``TRITON_INTERPRET=1``; fail with its output unless it exits cleanly."""
    pytest.importorskip("triton")
    here = Path(test_file).resolve()
    env = {**os.environ, "TRITON_INTERPRET": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT), str(here.parent),
                                          os.environ.get("PYTHONPATH", "")])}
    code = f"import {here.stem} as t; print(t.{check}())"
    run = subprocess.run([sys.executable, "-c", code], check=False, env=env,
                         capture_output=True, text=True, timeout=300)
    print(run.stdout)
    assert run.returncode == 0, run.stdout + run.stderr[-4000:]
