"""benchmarks/scaling.py for real on CPU: `megacpp train` under torchrun with gloo at world
sizes 1 and 2 for the tiny model, then the table, results.json, the PNG, the receipts and the
exact command. (Its numbers mean nothing here; the GPU machine's are the point.)"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.kernels.interpreter import ROOT
from tests.train.helpers import run_config, single_thread_env, write_config


@pytest.mark.slow
def test_scaling_benchmark_runs_world_sizes_and_writes_its_results(tmp_path, cpp_dataset):
    config = write_config(tmp_path / "tiny-scaling.toml",
                          run_config(cpp_dataset, tmp_path / "unused", run={"device": "cpu"}))
    out = tmp_path / "out"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "scaling.py"), "--presets", str(config),
           "--strategies", "ddp", "--world-sizes", "1", "2", "--steps", "4", "--skip-steps",
           "2", "--micro-batch", "2", "--data", str(cpp_dataset), "--device", "cpu",
           "--out", str(out)]
    result = subprocess.run(cmd, capture_output=True, text=True, env=single_thread_env(),
                            timeout=600, check=False)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "weak scaling on cpu: median of steps 3-4" in result.stdout
    rows = json.loads((out / "results.json").read_text())["rows"]
    assert [(r["preset"], r["strategy"], r["world_size"], r["status"]) for r in rows] == [
        ("tiny-scaling", "single", 1, "ok"), ("tiny-scaling", "ddp", 2, "ok")]
    single, ddp = rows
    assert single["efficiency"] == 1.0 and single["measured_steps"] == 2
    assert ddp["global_batch"] == 4 and ddp["seq_len"] == 64  # 2 rows on each of 2 ranks
    assert ddp["tokens_per_s"] == pytest.approx(4 * 64 / (ddp["step_ms"] / 1e3))
    assert ddp["efficiency"] == pytest.approx(ddp["tokens_per_s_per_gpu"]
                                              / single["tokens_per_s_per_gpu"])
    assert ddp["modes"]["compile"] is False and ddp["peak_mem_gib"] > 0
    assert (out / "scaling.png").stat().st_size > 10_000
    assert sorted(p.name for p in (out / "receipts").iterdir()) == [
        "tiny-scaling-ddp-w2.json", "tiny-scaling-single-w1.json"]
    receipt = json.loads((out / "receipt.json").read_text())
    assert receipt["kind"] == "bench" and "tiny-scaling.ddp.w2.step_ms" in receipt["metrics"]
    assert (out / "command.txt").read_text().split()[1:] == cmd[1:]


def _scaling():
    """benchmarks/scaling.py as a module."""
    import importlib.util

    name = "benchmarks_scaling"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / "scaling.py")
        sys.modules[name] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(sys.modules[name])
    return sys.modules[name]


def test_a_second_sitting_adds_its_rows_and_relates_them_to_the_first_single_run():
    scaling = _scaling()
    first = [scaling.Row("p", "single", 1, tokens_per_s=100.0, tokens_per_s_per_gpu=100.0),
             scaling.Row("p", "ddp", 2, tokens_per_s=190.0, tokens_per_s_per_gpu=95.0)]
    second = [scaling.Row("p", "fsdp", 2, tokens_per_s=180.0, tokens_per_s_per_gpu=90.0),
              scaling.Row("p", "ddp", 2, tokens_per_s=196.0, tokens_per_s_per_gpu=98.0)]
    rows = scaling.merged(first, second)
    scaling.relate(rows)
    assert [(r.strategy, r.world_size, r.efficiency, r.speedup) for r in rows] == [
        ("single", 1, 1.0, 1.0), ("ddp", 2, 0.98, 1.96), ("fsdp", 2, 0.9, 1.8)]
