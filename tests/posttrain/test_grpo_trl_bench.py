"""benchmarks/grpo_trl.py runs TRL's GRPOTrainer on the HF export with the verifier's reward
(skipped where trl is not installed)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.train.helpers import single_thread_env

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_trl_grpo_runs_with_the_verifier_reward(base_dir, task_dir, tmp_path):
    pytest.importorskip("trl")
    train = tmp_path / "two.jsonl"
    train.write_text("".join((task_dir / "train.jsonl").read_text().splitlines(True)[:2]))
    (tmp_path / "two.suite.toml").write_text((task_dir / "train.suite.toml").read_text())
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "grpo_trl.py"), "--base", str(base_dir),
         "--train", str(train), "--steps", "1", "--tasks-per-step", "2", "--group-size", "2",
         "--max-new-tokens", "8", "--device", "cpu", "--workers", "2", "--out",
         str(tmp_path / "out")], capture_output=True, text=True, env=single_thread_env(),
        timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads((tmp_path / "out" / "grpo_trl.json").read_text())
    assert result["trl"]["steps"] == 1 and result["trl"]["reward"] == [0.0]
    assert (tmp_path / "out" / "grpo_trl.receipt.json").is_file()
