"""scripts/gpu_tests.sh: its groups split the GPU suite into parts that add up to the whole."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "gpu_tests.sh"

pytest.importorskip("pytest_split")


def _collect(*args: str) -> tuple[int, list[str], str]:
    proc = subprocess.run(["bash", str(SCRIPT), *args, "--collect-only"], check=False, cwd=ROOT,
                          capture_output=True, text=True, timeout=240,
                          env={"PATH": "/usr/bin:/bin", "PYTHON": sys.executable})
    ids = [line for line in proc.stdout.splitlines() if "::" in line]
    return proc.returncode, ids, proc.stdout + proc.stderr


def test_groups_partition_the_gpu_suite():
    files = [ROOT / "tests" / "gpu_durations.json", ROOT / "tests" / "gpu_durations.measured.json"]
    before = [f.read_bytes() if f.exists() else None for f in files]
    rc, whole, out = _collect("all")
    assert rc == 0, out
    assert len(whole) > 100 and all(i.startswith("tests/") for i in whole)
    groups = []
    for g in (1, 2, 3, 4):
        rc, ids, out = _collect(str(g), "4")
        assert rc == 0, out
        assert ids, f"group {g} of 4 is empty"
        groups.append(ids)
    flat = [i for ids in groups for i in ids]
    assert len(flat) == len(set(flat)), "a test is in two groups"
    assert set(flat) == set(whole)
    # collecting (every test skips here) stores no durations
    assert [f.read_bytes() if f.exists() else None for f in files] == before


@pytest.mark.parametrize("args", [(), ("0",), ("5", "4"), ("x",)])
def test_bad_group_is_refused(args):
    proc = subprocess.run(["bash", str(SCRIPT), *args], check=False, cwd=ROOT, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 2
    assert "usage" in proc.stderr or "group" in proc.stderr


def test_gpu_modules_import_without_the_serving_packages():
    # The GPU machine's image has no fastapi, pydantic or openai: a gpu-marked module that
    # imports them (directly or through a helper) stops the whole group's collection there.
    modules = sorted(str(p.relative_to(ROOT).with_suffix("")).replace("/", ".")
                     for p in (ROOT / "tests").rglob("test_*.py") if "mark.gpu" in p.read_text())
    assert modules
    code = ("import importlib, sys\n"
            "for name in ('fastapi', 'pydantic', 'openai', 'starlette', 'uvicorn'):\n"
            "    sys.modules[name] = None\n"
            f"for module in {modules!r}:\n"
            "    importlib.import_module(module)\n")
    run = subprocess.run([sys.executable, "-c", code], check=False, cwd=ROOT, capture_output=True,
                         text=True,
                         env={**os.environ, "PYTHONPATH": f"{ROOT / 'src'}:{ROOT}"})
    assert run.returncode == 0, run.stderr[-2000:]
