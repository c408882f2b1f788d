"""benchmarks/quality.py end to end on CPU: two tiny candidates, a 3-value learning-rate sweep
and final runs as real ``megacpp train`` processes side by side, HumanEval-X sampling through
the engine and sandboxed scoring of 2 problems, then the JSON, PNGs, receipts and bundle."""

from __future__ import annotations

import json
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
from PIL import Image

from megacpp.receipts import read_receipt
from tests.train.helpers import LIBSTDCXX, build_dataset, single_thread_env

ROOT = Path(__file__).resolve().parents[1]
TINY = ("model.d_model=32 model.attention.n_heads=2 model.attention.n_kv_heads=1 "
        "model.attention.head_dim=16 model.mamba.d_state=16 model.mamba.headdim=16 "
        "model.mamba.chunk_size=16 model.rnn.n_heads=2 model.rnn.head_k_dim=16 "
        "model.rnn.head_v_dim=16 model.rnn.chunk_size=16 model.moe.n_experts=4 "
        "model.moe.expert_ffn=32")


@pytest.mark.slow
def test_quality_benchmark_end_to_end_on_cpu(tmp_path: Path) -> None:
    if not (LIBSTDCXX / "utility").is_file():
        pytest.skip("needs the libstdc++ headers")
    dataset = build_dataset(tmp_path)
    out = tmp_path / "out"
    # steps-capped runs under a generous budget: the time budget itself is tested in
    # tests/train/test_time_budget.py; this runs the whole benchmark flow quickly
    cmd = [sys.executable, str(ROOT / "benchmarks" / "quality.py"), "--data", str(dataset),
           "--out", str(out), "--device", "cpu", "--parallel", "3",
           "--candidate", f"hybrid=tiny model.pattern=AEMR {TINY}",
           "--candidate", f"dense=tiny model.pattern=ADAD {TINY} model.mlp.ffn=64",
           "--goal", "hybrid:dense", "--minutes", "2", "--sweep-minutes", "2",
           "--lrs", "1e-4", "3e-3", "3e-2", "--eval-every-s", "0.2", "--micro-batch", "4",
           "--val-batches", "2", "--warmup-steps", "1", "--set", "run.cpu_threads=1",
           "--he-limit", "2", "--he-n", "2", "--he-max-new-tokens", "6", "--he-max-num-seqs",
           "4", "--score-workers", "2", "--bundle", str(tmp_path / "quality.tgz"),
           "--steps-cap", "4"]
    done = subprocess.run(cmd, capture_output=True, text=True, env=single_thread_env(),
                          cwd=ROOT, timeout=300, check=False)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]

    sweep = json.loads((out / "sweep.json").read_text())
    for name in ("hybrid", "dense"):
        runs = sweep["candidates"][name]["runs"]
        assert set(runs) == {"0.0001", "0.003", "0.03"}
        assert all(r["status"] == "completed" and r["steps"] == 4 for r in runs.values())
        best = min(runs, key=lambda lr: runs[lr]["final_val_bpb"])
        assert sweep["candidates"][name]["best_lr"] == float(best)
        assert len({r["final_val_bpb"] for r in runs.values()}) == 3  # the lr matters

    report = json.loads((out / "quality.json").read_text())
    assert report["warmup_and_compile_counted"] is True
    assert report["dataset"]["train"]["tokens"] > 0
    for name, entry in report["candidates"].items():
        final = entry["final"]
        assert final["status"] == "completed" and final["steps"] == 4
        assert entry["lr"] == sweep["candidates"][name]["best_lr"]
        assert final["startup_s"] > 0  # the clock counts from the process's start
        curve = final["curve"]
        assert len(curve) >= 2 and curve[-1]["val_bpb"] == final["final_val_bpb"]
        assert [p["clock_s"] for p in curve] == sorted(p["clock_s"] for p in curve)
        he = entry["humaneval"]
        assert he["scored"] and set(he["greedy"]["pass_at_k"]) == {"pass@1"}
        assert sum(he["sampled"]["status_counts"].values()) == 2 * 2
    goal = report["goal"]
    assert goal["met"] in (True, False)
    assert ("the goal is MET" if goal["met"] else "the goal is NOT met") in goal["statement"]
    assert Image.open(out / "quality.png").size[0] > 500
    assert Image.open(out / "sweep.png").size[0] > 300
    receipt = read_receipt(out / "receipt.json")
    assert receipt.kind == "bench" and "hybrid.final_val_bpb" in receipt.metrics
    assert read_receipt(out / "runs" / "final" / "dense" / "receipt.json").kind == "train"
    assert "benchmarks/quality.py" in (out / "command.txt").read_text()
    assert "### CPP/0" in (out / "examples.md").read_text()
    with tarfile.open(tmp_path / "quality.tgz") as tar:
        names = tar.getnames()
    assert "out/quality.json" in names and not any("/work" in n for n in names)

    # the report phase alone, later and without the dataset, rebuilds the same report
    again = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "quality.py"), "--out",
                            str(out), "--phases", "report"], capture_output=True, text=True,
                           env=single_thread_env(), cwd=ROOT, timeout=120, check=False)
    assert again.returncode == 0, again.stderr[-2000:]
    assert json.loads((out / "quality.json").read_text())["goal"] == goal


def test_bad_candidates_and_missing_data_are_one_line_errors(tmp_path: Path) -> None:
    script = str(ROOT / "benchmarks" / "quality.py")
    for args, message in (
        (["--candidate", "nopreset", "--data", str(tmp_path)], "expected NAME=PRESET"),
        (["--data", str(tmp_path)], "not a complete `megacpp data build` output"),
    ):
        done = subprocess.run([sys.executable, script, "--out", str(tmp_path / "o"),
                               "--device", "cpu", *args], capture_output=True, text=True,
                              cwd=ROOT, timeout=60, check=False)
        assert done.returncode == 2, done.stderr
        assert done.stderr.startswith("error: ") and message in done.stderr
        assert "Traceback" not in done.stderr


def _quality_module():
    import importlib.util

    spec = importlib.util.spec_from_file_location("quality", ROOT / "benchmarks" / "quality.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("quality", module)  # dataclasses look their module up
    spec.loader.exec_module(sys.modules["quality"])
    return sys.modules["quality"]


def test_goal_verdict_and_candidate_specs() -> None:
    quality = _quality_module()

    def entry(bpb, status="completed"):
        return {"final": {"final_val_bpb": bpb, "status": status}}

    runs = {"h": entry(1.10), "d1": entry(1.20), "d2": entry(1.15)}
    verdict = quality.goal_verdict(runs, "h:d1,d2")
    assert verdict["met"] is True and verdict["margin_bpb"] == pytest.approx(0.05)
    assert "(d2) 1.1500: the goal is MET (the hybrid 0.0500 bits/byte lower)" in verdict["statement"]
    runs["d2"] = entry(1.05)
    assert quality.goal_verdict(runs, "h:d1,d2")["met"] is False
    runs["d1"] = entry(None, "failed")
    failed = quality.goal_verdict(runs, "h:d1,d2")
    assert failed["met"] is None and "d1 did not complete" in failed["statement"]
    assert "x not among" in quality.goal_verdict(runs, "x:d1")["statement"]

    cand = quality.Candidate.parse("nomuon=nam56r-350m optim.muon=false 'model.d_model=512'")
    assert (cand.name, cand.preset, cand.overrides) == (
        "nomuon", "nam56r-350m", ("optim.muon=false", "model.d_model=512"))
    for bad in ("nopreset", "a b=c", "a=b lr=1"):
        with pytest.raises(quality.MegaCppError):
            quality.Candidate.parse(bad)


def test_gpu_slots_follow_cuda_visible_devices(monkeypatch: pytest.MonkeyPatch) -> None:
    quality = _quality_module()
    import torch

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")
    assert quality.slots_for("cuda", None, 1) == ["2", "3"]
    assert quality.slots_for("cuda", 1, 1) == ["2"]
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert quality.slots_for("cuda", None, 1) == ["0", "1"]
    with pytest.raises(quality.MegaCppError, match="--gpus 3"):
        quality.slots_for("cuda", 3, 1)
    assert quality.slots_for("cpu", None, 2) == ["cpu0", "cpu1"]


def test_a_run_stopped_before_its_receipt_keeps_its_curve(tmp_path: Path) -> None:
    quality = _quality_module()
    run = tmp_path / "run"
    run.mkdir()
    assert quality.read_run(run)["status"] == "missing"
    records = [{"type": "train", "step": 1, "tokens": 64, "loss": 9.0, "clock_s": 5.0, "time_s": 4.0},
               {"type": "val", "step": 1, "tokens": 64, "clock_s": 6.0, "val_bpb": 4.3,
                "val_loss": 10.5},
               {"type": "val", "step": 40, "tokens": 2560, "clock_s": 60.0, "val_bpb": 2.6,
                "val_loss": 6.4}]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    result = quality.read_run(run)
    assert result["status"] == "stopped" and "final_val_bpb" not in result
    assert (result["last_val_bpb"], result["last_step"], result["last_clock_s"]) == (2.6, 40, 60.0)
    # a stopped candidate is not a completed one for the goal
    verdict = quality.goal_verdict({"h": {"final": result},
                                    "d": {"final": {"final_val_bpb": 3.0, "status": "completed"}}},
                                   "h:d")
    assert verdict["met"] is None
