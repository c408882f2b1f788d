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


def _write_run(run_dir, steps: int, world_size: int, receipt: bool) -> None:
    run_dir.mkdir(parents=True)
    setup = {"type": "setup", "step": 0, "world_size": world_size, "modes": {"compile": True},
             "global_batch": 2 * world_size, "mfu_peak_tflops": 500.0,
             "mfu_peak_source": "measured in this run"}
    train = [{"type": "train", "step": s, "tokens": s * 2 * world_size * 64,
              "time_s": 0.1 * (1 + s % 2), "mfu": 0.3, "peak_mem_bytes": (s + 1) * 2**30}
             for s in range(1, steps + 1)]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in [setup, *train]))
    if receipt:
        (run_dir / "receipt.json").write_text(json.dumps({
            "config": {"outcome": {"status": "completed"}},
            "fingerprint": {"devices": [{"name": "Some GPU"}], "packages": {"torch": "2.x"}},
            "metrics": {"peak_mem_bytes": 9 * 2**30}}))


def test_remeasure_keeps_a_run_stopped_after_its_last_step_and_fails_a_cut_one(tmp_path):
    scaling = _scaling()
    runs = tmp_path / "runs"
    _write_run(runs / "p-single-w1", steps=6, world_size=1, receipt=True)
    _write_run(runs / "p-fsdp-w2", steps=6, world_size=2, receipt=False)  # stopped at exit
    _write_run(runs / "p-ddp-w2", steps=4, world_size=2, receipt=False)  # cut mid-run
    scaling.main(["--remeasure", "--out", str(tmp_path), "--steps", "6", "--skip-steps", "2"])
    rows = {r["strategy"]: r for r in json.loads((tmp_path / "results.json").read_text())["rows"]}
    assert rows["single"]["status"] == "ok" and rows["single"]["peak_mem_gib"] == 9.0
    stopped = rows["fsdp"]
    assert stopped["status"] == "ok" and "stopped before it wrote its receipt" in stopped["note"]
    assert stopped["measured_steps"] == 4 and stopped["peak_mem_gib"] == 7.0  # rank 0, step 6
    assert stopped["speedup"] == pytest.approx(2.0)  # same step times, twice the rows
    assert rows["ddp"]["status"] == "failed" and "did not complete" in rows["ddp"]["error"]
