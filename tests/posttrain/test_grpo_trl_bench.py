"""benchmarks/grpo_trl.py: its per-step log and the report built from it (synthetic trainer
logs, no TRL needed), and a real run of TRL's GRPOTrainer on the HF export with the
verifier's reward (skipped where trl is not installed)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.train.helpers import single_thread_env

ROOT = Path(__file__).resolve().parents[2]


def _bench():
    """benchmarks/grpo_trl.py as a module (it imports TRL only when it trains)."""
    name = "benchmarks_grpo_trl"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / "grpo_trl.py")
        sys.modules[name] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(sys.modules[name])
    return sys.modules[name]


def trainer_logs(step: int) -> dict:
    """A log dict as TRL's GRPOTrainer hands it to on_log (a subset of its keys)."""
    return {"loss": 0.01 * step, "grad_norm": 0.5, "learning_rate": 2e-5,
            "reward": 0.25 * step, "reward_std": 0.1, "kl": 0.001 * step,
            "completions/mean_length": 40.0, "epoch": 0.1 * step}


def write_steps(out: Path, target: int, done: int) -> None:
    bench = _bench()
    log = bench.StepLog(out)
    log.start({"steps": str(target), "group_size": "8"})
    for step in range(1, done + 1):
        log.on_log(trainer_logs(step), step)


def lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_each_step_is_on_disk_as_soon_as_it_is_logged(tmp_path):
    bench = _bench()
    log = bench.StepLog(tmp_path)
    log.start({"steps": "10"})
    path = tmp_path / bench.STEPS_FILE
    assert lines(path) == [{"kind": "settings", "step": 0, "settings": {"steps": "10"}}]
    log.on_log(trainer_logs(1), 1)
    assert len(lines(path)) == 2  # flushed: readable before the next step
    log.on_log({**trainer_logs(2), "kl": float("nan"), "note": "text"}, 2)
    log.on_log({"train_runtime": 12.0, "train_loss": 0.1}, 2)  # the end summary: no reward
    records = lines(path)
    assert [r["kind"] for r in records] == ["settings", "step", "step"]
    first, second = records[1], records[2]
    assert first["step"] == 1 and first["reward"] == 0.25 and first["kl"] == 0.001
    assert first["completions/mean_length"] == 40.0 and first["elapsed_s"] >= 0
    assert second["kl"] is None and "note" not in second


def test_the_callback_writes_through_the_trainer_state(tmp_path):
    transformers = pytest.importorskip("transformers")
    bench = _bench()
    log = bench.StepLog(tmp_path)
    log.start({"steps": "3"})
    callback = bench.step_callback(log)
    assert isinstance(callback, transformers.TrainerCallback)
    state = transformers.TrainerState(global_step=7)
    callback.on_log(None, state, None, logs=trainer_logs(1))
    state.is_world_process_zero = False  # other ranks write nothing
    callback.on_log(None, state, None, logs=trainer_logs(2))
    (record,) = [r for r in lines(tmp_path / bench.STEPS_FILE) if r["kind"] == "step"]
    assert record["step"] == 7 and record["reward"] == 0.25


def test_report_only_builds_a_partial_report_from_a_cut_off_run(tmp_path, capsys):
    bench = _bench()
    out = tmp_path / "trl"
    write_steps(out, target=10, done=3)
    with open(out / bench.STEPS_FILE, "a") as f:
        f.write('{"kind": "step", "step": 4, "rew')  # killed mid-write
    megacpp_run = tmp_path / "megacpp"
    megacpp_run.mkdir()
    (megacpp_run / "metrics.jsonl").write_text("".join(json.dumps(
        {"kind": "train", "step": s, "reward": 0.5, "kl": 0.0, "sample_s": 1.0,
         "verify_s": 0.5, "update_s": 0.5}) + "\n" for s in (1, 2)) + json.dumps(
        {"kind": "eval", "step": 2, "heldout_pass@1": 0.5}) + "\n")
    assert bench.main(["--report-only", "--out", str(out), "--megacpp-run",
                       str(megacpp_run)]) == 0
    result = json.loads((out / bench.RESULT_FILE).read_text())
    assert result["status"] == "partial"
    assert (result["steps_done"], result["steps_target"]) == (3, 10)
    assert result["trl"]["reward"] == [0.25, 0.5, 0.75]
    assert result["trl"]["kl"] == [0.001, 0.002, 0.003] and result["trl"]["steps"] == 3
    assert result["megacpp"] == {"reward": [0.5, 0.5], "kl": [0.0, 0.0], "wall_s": 4.0,
                                 "steps": 2}
    assert result["settings"]["group_size"] == "8"
    assert (out / bench.PLOT_FILE).stat().st_size > 1000
    receipt = json.loads((out / bench.RECEIPT_FILE).read_text())
    assert receipt["kind"] == "bench" and receipt["config"]["status"] == "partial"
    assert receipt["metrics"]["trl_steps"] == 3 and receipt["metrics"]["trl_steps_target"] == 10
    assert receipt["metrics"]["trl_mean_reward"] == pytest.approx(0.5)
    assert '"status": "partial"' in capsys.readouterr().out


def test_report_only_of_a_finished_run_is_complete(tmp_path):
    bench = _bench()
    write_steps(tmp_path, target=2, done=2)
    assert bench.main(["--report-only", "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / bench.RESULT_FILE).read_text())
    assert result["status"] == "complete" and result["steps_done"] == 2
    assert "megacpp" not in result


def test_report_only_without_a_step_log_is_one_error_line(tmp_path, capsys):
    bench = _bench()
    assert bench.main(["--report-only", "--out", str(tmp_path / "none")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "grpo_trl_steps.jsonl not found" in err
    assert len(err.splitlines()) == 1
    (tmp_path / bench.STEPS_FILE).write_text('{"kind": "step", "step": 1, "reward": 0.5}\n')
    assert bench.main(["--report-only", "--out", str(tmp_path)]) == 2
    assert "not a grpo_trl step log" in capsys.readouterr().err


def test_training_needs_base_and_train(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_:
        _bench().main(["--out", str(tmp_path)])
    assert exit_.value.code == 2
    assert "--base and --train required (or --report-only)" in capsys.readouterr().err


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
    assert result["status"] == "complete"
    assert result["trl"]["steps"] == 1 and result["trl"]["reward"] == [0.0]
    (step,) = [r for r in lines(tmp_path / "out" / "grpo_trl_steps.jsonl")
               if r["kind"] == "step"]
    assert step["step"] == 1 and step["reward"] == 0.0
    assert (tmp_path / "out" / "grpo_trl.receipt.json").is_file()
