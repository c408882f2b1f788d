"""benchmarks/kernels.py refuses unknown --surfaces / --cases / --backends before any GPU work,
naming what it knows; a valid selection gets as far as the CUDA check."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "kernels.py"


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True,
                          timeout=120, check=False)


@pytest.mark.parametrize(("flag", "bad", "known"), [
    ("--surfaces", "mamba4_scan", "mamba3_scan"),
    ("--cases", "seq4097", "seq4096"),
    ("--backends", "triton_chunkd", "triton_chunked"),
])
def test_unknown_selection_is_refused_with_the_known_names(flag, bad, known) -> None:
    run = _run(flag, f"{bad},reference" if flag == "--backends" else bad)
    assert run.returncode == 1, run.stderr
    assert f"unknown {flag} ['{bad}']" in run.stderr and known in run.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="would run the benchmark")
def test_a_valid_selection_reaches_the_cuda_check() -> None:
    run = _run("--surfaces", "mamba3_scan", "--cases", "seq8192",
               "--backends", "triton_chunked,mamba_ssm")
    assert run.returncode == 2 and "needs a CUDA device" in run.stderr, run.stderr
