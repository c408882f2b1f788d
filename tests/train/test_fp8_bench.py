"""benchmarks/fp8.py for real on the CPU: the bf16 speed and loss rows are real `megacpp
train` runs, the FP8 rows are skipped with the lane's own reason (no FP8 GEMMs here), and
the results, receipts and command are written. (Its numbers mean nothing here.)"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.kernels.interpreter import ROOT
from tests.train.helpers import run_config, single_thread_env, write_config


@pytest.mark.slow
def test_fp8_benchmark_runs_bf16_skips_fp8_on_the_cpu_and_writes_results(tmp_path, cpp_dataset):
    config = write_config(tmp_path / "tiny-fp8.toml",
                          run_config(cpp_dataset, tmp_path / "unused", run={"device": "cpu"}))
    out = tmp_path / "out"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "fp8.py"), "--presets", str(config),
           "--recipes", "tensorwise", "--device", "cpu", "--speed-steps", "3", "--skip-steps",
           "1", "--loss-steps", "3", "--micro-batch", "2", "--data", str(cpp_dataset),
           "--out", str(out)]
    result = subprocess.run(cmd, capture_output=True, text=True, env=single_thread_env(),
                            timeout=600, check=False)
    assert result.returncode == 0, result.stdout + result.stderr
    results = json.loads((out / "results.json").read_text())
    assert results["matmul_peak_tflops"] == {"bf16": None, "fp8": None}  # nothing to measure
    speed = {(r["float8"], r["graphs"]): r for r in results["speed"]}
    assert set(speed) == {("off", False), ("tensorwise", False)}  # graphs need CUDA
    bf16, fp8 = speed["off", False], speed["tensorwise", False]
    assert bf16["status"] == "ok" and bf16["tokens_per_s"] > 0 and bf16["speedup"] == 1.0
    assert bf16["peak_mem_gib"] > 0 and bf16["flops_per_token"] > 0
    assert "cuda_graph off" in bf16["graph_mode"] and bf16["float8_layers"] is None
    assert fp8["status"] == "skipped" and fp8["tokens_per_s"] is None
    assert fp8["error"].startswith('parallel.float8 = "tensorwise" cannot run on this device')
    loss = {r["float8"]: r for r in results["loss"]}
    assert loss["off"]["status"] == "ok" and loss["off"]["steps"] == 3
    assert loss["off"]["final_loss"] > 0 and loss["off"]["rel_to_bf16"] == 0.0
    assert loss["tensorwise"]["status"] == "skipped"
    assert (out / "loss.png").stat().st_size > 5_000
    assert sorted(p.name for p in (out / "receipts").iterdir()) == [
        "tiny-fp8-off-eager.json", "tiny-fp8-off-loss.json"]
    run_receipt = json.loads((out / "receipts" / "tiny-fp8-off-eager.json").read_text())
    assert run_receipt["fingerprint"]["numerics"] == {"float8": "off"}
    receipt = json.loads((out / "receipt.json").read_text())
    assert receipt["kind"] == "bench" and "tiny-fp8.off.eager.tokens_per_s" in receipt["metrics"]
    assert "--loss-steps 3" in (out / "command.txt").read_text()


def test_loss_presets_must_be_among_the_presets(tmp_path):
    cmd = [sys.executable, str(ROOT / "benchmarks" / "fp8.py"), "--presets", "nam56r-350m",
           "--loss-steps", "3", "--loss-presets", "nam56r-1b", "--out", str(tmp_path / "o")]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=False)
    assert result.returncode == 2
    assert "--loss-presets nam56r-1b: not among --presets" in result.stderr
    assert not (tmp_path / "o").exists()
