"""The wheel works outside the repo: build it, install it into a fresh virtualenv, and from a
temporary directory run the documented commands (presets and configs are package data).

The fresh venv gets the wheel (``pip install --no-deps``) and nothing else; its dependencies
(torch, numpy, ...) come from the interpreter running the tests through one ``.pth`` line
naming that interpreter's site-packages -- installing torch again would take minutes and the
network. A ``.pth`` line only appends a directory to ``sys.path`` (``.pth`` files inside it
are not run), so the project's editable install stays out and ``megacpp`` is imported from
the wheel (asserted).
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

from tests.train.helpers import HEADERS, LIBSTDCXX

REPO = Path(__file__).resolve().parents[1]
WHEEL_DATA = (
    "megacpp/configs/models/tiny.toml", "megacpp/configs/models/nam56r-small.toml",
    "megacpp/configs/runs/tiny-cpu.toml", "megacpp/configs/data/tiny.toml",
    "megacpp/eval/data/humaneval-x-cpp.jsonl.gz", "megacpp/eval/data/HUMANEVAL-X-LICENSE.txt",
    "megacpp/eval/jail.c", "megacpp/data/pretokenize.cpp",
)  # fmt: skip
DATA_BUILD = """\
[tokenizer]
vocab_size = 512
max_train_bytes = 1048576

[packing]
seq_len = 64
val_permille = 150
"""


def _build_wheel(out: Path) -> Path:
    """``pip wheel --no-deps`` of a copy of the project (pyproject, README, src)."""
    project = out / "project"
    project.mkdir(parents=True)
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, project / name)
    shutil.copytree(REPO / "src", project / "src",
                    ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    # without build isolation when setuptools is here (no network needed), else with it
    isolation = [] if importlib.util.find_spec("setuptools") is None else [
        "--no-build-isolation"]
    _run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", *isolation,
          "--disable-pip-version-check", str(project), "-w", str(out / "dist")], cwd=out)
    (wheel,) = (out / "dist").glob("megacpp-*.whl")
    return wheel


def _fresh_venv(root: Path, wheel: Path) -> Path:
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(root)], check=True,
                   timeout=120)
    python = root / "bin" / "python"
    _run([sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--no-deps",
          "--disable-pip-version-check", str(wheel)], cwd=root)
    where = "import sysconfig; print(sysconfig.get_path('purelib'))"
    site = subprocess.run([str(python), "-c", where], capture_output=True, text=True,
                          check=True).stdout
    deps = sysconfig.get_path("purelib")  # this interpreter's: torch, numpy, typer, ...
    Path(site.strip(), "_megacpp_test_deps.pth").write_text(deps + "\n")
    return root / "bin"


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    return {**env, "OMP_NUM_THREADS": "1", "COLUMNS": "200", "PYTHONUNBUFFERED": "1"}


def _run(cmd: list[str], cwd: Path, timeout: float = 300) -> str:
    done = subprocess.run([str(c) for c in cmd], cwd=cwd, capture_output=True, text=True,
                          env=_env(), timeout=timeout, check=False)
    assert done.returncode == 0, f"{cmd} failed ({done.returncode}):\n{done.stdout}\n{done.stderr}"
    return done.stdout


@pytest.mark.slow
def test_the_wheel_runs_the_documented_commands_outside_the_repo(tmp_path):
    if not (LIBSTDCXX / "utility").is_file():
        pytest.skip(f"needs the libstdc++ headers in {LIBSTDCXX}")
    wheel = _build_wheel(tmp_path / "build")
    names = set(zipfile.ZipFile(wheel).namelist())
    assert set(WHEEL_DATA) <= names, sorted(set(WHEEL_DATA) - names)
    bin_dir = _fresh_venv(tmp_path / "venv", wheel)
    work = tmp_path / "elsewhere"
    work.mkdir()
    megacpp = str(bin_dir / "megacpp")

    where = _run([bin_dir / "python", "-c", "import megacpp; print(megacpp.__file__)"], work)
    assert where.startswith(str(tmp_path / "venv")), where  # the wheel, not the checkout
    # `megacpp --version` is the CLI's flag once it has one; the command says the same
    assert "megacpp" in _run([megacpp, "version"], work)
    described = _run([megacpp, "model", "describe", "NAM56R", "--config", "tiny", "--json"],
                     work)
    assert json.loads(described)["config"] == "tiny"
    count = "from megacpp.eval.problems import load_problems; print(len(load_problems()))"
    problems = _run([bin_dir / "python", "-c", count], work)
    assert problems.strip() == "164"

    sources = work / "headers"
    sources.mkdir()
    for rel in HEADERS[:12]:
        shutil.copyfile(LIBSTDCXX / rel, sources / (rel.replace("/", "_") + (
            "" if "." in rel else ".h")))
    (work / "build.toml").write_text(DATA_BUILD)
    _run([megacpp, "data", "build", "headers", "--out", "data/tiny-cpp", "--config",
          "build.toml", "--workers", "1"], work)
    _run([megacpp, "train", "--config", "tiny-cpu", "--no-progress",
          "--set", "train.steps=5", "--set", "train.eval_every=5", "--set", "checkpoint.every=5",
          "--set", "train.micro_batch_size=4", "--set", "data.val_batches=2",
          "--set", "run.device=cpu", "--set", "run.plots=false"], work)
    run_dir = work / "runs" / "tiny-cpu"
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if r["type"] == "train"] == [1, 2, 3, 4, 5]
    out = _run([megacpp, "generate", "--checkpoint", "runs/tiny-cpu", "--prompt", "int f() {",
                "--max-new-tokens", "4", "--seed", "0", "--json"], work)
    assert json.loads(out)["checkpoint"].endswith("checkpoints/step_000005")
