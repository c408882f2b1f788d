"""``megacpp receipts show|compare|golden`` end to end."""

from __future__ import annotations

import copy
import json
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from megacpp.cli.receipts import app
from megacpp.contract import capture_fingerprint
from megacpp.receipts import DriftError, ReceiptError, write_receipt

runner = CliRunner()
CONFIG = {"train": {"steps": 10}}


@pytest.fixture(scope="module")
def fingerprint():
    return capture_fingerprint()


def _receipt(path: Path, fingerprint, tokens_per_s: float) -> Path:
    write_receipt(
        path,
        "bench",
        CONFIG,
        {"tokens_per_s": tokens_per_s, "mfu": 0.4},
        fingerprint=copy.deepcopy(fingerprint),
    )
    return path


def test_show_table_and_json(tmp_path: Path, fingerprint):
    path = _receipt(tmp_path / "a.json", fingerprint, 1000.0)
    table = runner.invoke(app, ["show", str(path)])
    assert (
        table.exit_code == 0 and "tokens_per_s" in table.output and "bench receipt" in table.output
    )
    data = json.loads(runner.invoke(app, ["show", str(path), "--json"]).output)
    assert data["metrics"]["tokens_per_s"] == 1000.0 and data["artifact_status"] == {}


def test_compare_prints_ratios_and_refuses_drift(tmp_path: Path, fingerprint):
    a = _receipt(tmp_path / "a.json", fingerprint, 1000.0)
    b = _receipt(tmp_path / "b.json", fingerprint, 1500.0)
    ok = runner.invoke(app, ["compare", str(a), str(b), "--metric", "tokens_per_s", "--json"])
    assert ok.exit_code == 0
    assert json.loads(ok.output)["metrics"] == [
        {"name": "tokens_per_s", "a": 1000.0, "b": 1500.0, "ratio_b_over_a": 1.5}
    ]

    drifted = copy.deepcopy(fingerprint)
    drifted["env"]["TORCH_CUDA_ARCH_LIST"] = "12.1a"
    c = tmp_path / "c.json"
    write_receipt(c, "bench", CONFIG, {"tokens_per_s": 900.0}, fingerprint=drifted)
    refused = runner.invoke(app, ["compare", str(a), str(c)])
    assert isinstance(refused.exception, DriftError) and refused.exception.exit_code == 1
    assert "env.TORCH_CUDA_ARCH_LIST" in str(refused.exception)
    stamped = runner.invoke(app, ["compare", str(a), str(c), "--allow-drift"])
    assert (
        stamped.exit_code == 0 and "DRIFT ALLOWED" in stamped.output and "DRIFTED" in stamped.output
    )


def test_golden_refuses_a_dirty_checkout(tmp_path: Path, fingerprint):
    dirty = copy.deepcopy(fingerprint)
    dirty["git"] = {
        "root": "/x",
        "sha": "a" * 40,
        "dirty": True,
        "diff_sha256": "b" * 64,
        "untracked_files": 0,
    }
    path = tmp_path / "d.json"
    write_receipt(path, "bench", CONFIG, {"tokens_per_s": 1.0}, fingerprint=dirty)
    result = runner.invoke(app, ["golden", str(path)])
    assert isinstance(result.exception, ReceiptError)


def test_corrupt_receipt_through_the_console_script(tmp_path: Path, fingerprint):
    path = _receipt(tmp_path / "a.json", fingerprint, 1.0)
    path.write_text(path.read_text()[:-40])
    done = subprocess.run(
        [sys.executable, "-m", "megacpp", "receipts", "show", str(path)],
        capture_output=True, check=False,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2 and done.stderr.startswith("error:")
    assert "truncated" in done.stderr and "Traceback" not in done.stderr
