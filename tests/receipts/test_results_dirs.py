"""benchmarks/results/<benchmark>/<device>/: the results layout and its helpers."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megacpp.receipts.results import begin, command_line, device_slug, results_dir

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(("name", "count", "slug"), [
    ("NVIDIA H100 80GB HBM3", 1, "h100"),
    ("NVIDIA H200", 1, "h200"),
    ("NVIDIA H100 80GB HBM3", 4, "h100x4"),
    ("NVIDIA A100-SXM4-80GB", 1, "a100"),
    ("NVIDIA GeForce RTX 4090", 1, "rtx4090"),
    ("Some New Accelerator 9", 1, "some-new-accelerator-9"),
])
def test_device_slug_names_the_card(name, count, slug):
    assert device_slug(name, count) == slug


@pytest.mark.skipif(torch.cuda.is_available(), reason="names the CUDA device where there is one")
def test_device_slug_without_a_gpu_is_cpu():
    assert device_slug() == "cpu"


def test_begin_replaces_only_its_own_stem(tmp_path):
    out = results_dir("kernels", "h100", root=tmp_path)
    out.mkdir(parents=True)
    (out / "kernels.json").write_text("{}")
    (out / "mamba3_scan_seq4096.json").write_text("{}")
    (out / "receipts" / "kernels").mkdir(parents=True)
    (out / "receipts" / "kernels" / "old.json").write_text("{}")
    begin(out, "kernels", "kernels", ["benchmarks/kernels.py", "--name", "kernels"])
    assert not (out / "kernels.json").exists()
    assert not (out / "receipts" / "kernels").exists()
    assert (out / "mamba3_scan_seq4096.json").exists()  # another stem's result stays
    assert (out / "command.txt").read_text().strip().endswith(
        "python benchmarks/kernels.py --name kernels")
    begin(out, "mamba3_scan_seq4096", "kernels", ["benchmarks/kernels.py", "--cases", "a b"])
    assert not (out / "mamba3_scan_seq4096.json").exists()
    assert "'a b'" in (out / "mamba3_scan_seq4096.command.txt").read_text()


def test_command_line_quotes_arguments():
    assert command_line(["benchmarks/x.py", "--p", "two words"]).endswith(
        "python benchmarks/x.py --p 'two words'")


def _committable(folder: Path) -> list[Path]:
    """The files under ``folder`` that git would commit (tracked, or new and not ignored):
    a benchmark's ignored ``runs/`` and ``data/`` folders stay out of the count."""
    listed = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard",
                             "-z", "--", str(folder)], check=False, cwd=ROOT,
                            capture_output=True)
    if listed.returncode != 0:  # not a git checkout (an sdist): every file
        return [p for p in folder.rglob("*") if p.is_file()]
    paths = (ROOT / name for name in listed.stdout.decode().split("\0") if name)
    return [p for p in paths if p.is_file()]


def test_every_results_folder_is_benchmark_then_device_with_a_command():
    results = ROOT / "benchmarks" / "results"
    folders = [p for p in results.glob("*/*") if p.is_dir()]
    assert folders, "benchmarks/results holds no results"
    for folder in folders:
        assert list(folder.glob("*command.txt")), f"{folder} has no command.txt"
        for path in folder.glob("*.json"):
            json.loads(path.read_text())  # every committed JSON parses
    files = _committable(results)
    assert len(files) <= 160  # one latest result per benchmark and device: JSON, receipts, PNG, command
    assert sum(p.stat().st_size for p in files) <= 3 * 1024 * 1024
    assert not [p for p in files if p.suffix in {".py", ".sh", ".diff"}]


def test_readme_tables_are_rendered_from_the_results():
    run = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "readme_table.py"),
                          "--check"], capture_output=True, text=True, cwd=ROOT, check=False)
    assert run.returncode == 0, run.stderr
