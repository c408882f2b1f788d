"""Checkpoints: exact resume after kill -9 (mid-run and mid-write), refusal of incomplete or
corrupt checkpoints, fallback on request, keep-last-N."""

from __future__ import annotations

import io
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from rich.console import Console

from megacpp.train.checkpoint import CheckpointError, load_trained_model, verify_checkpoint
from megacpp.train.config import RunConfig, load_run_config
from megacpp.train.trainer import TrainingFailed, train
from tests.train.helpers import (
    megacpp,
    run_config,
    single_thread_env,
    train_losses,
    write_config,
)

KILL_RUN = {"train": {"steps": 12, "eval_every": 4}, "checkpoint": {"every": 4, "keep_last": 2}}


def _quiet() -> Console:
    return Console(file=io.StringIO())


@pytest.fixture(scope="module")
def reference_losses(tmp_path_factory, cpp_dataset) -> list[float]:
    """The uninterrupted run the killed-and-resumed runs must reproduce."""
    out = tmp_path_factory.mktemp("reference") / "run"
    cfg = RunConfig.from_dict(run_config(cpp_dataset, out, **KILL_RUN))
    return train_losses(train(cfg, console=_quiet()).run_dir)


def _start(config: Path, *extra: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "megacpp", "train", "--config", str(config), "--no-progress",
         *extra], env=single_thread_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


def _kill_when(proc: subprocess.Popen, ready, timeout: float = 240) -> None:
    deadline = time.monotonic() + timeout
    while not ready():
        assert proc.poll() is None, f"the run ended before it could be killed:\n{_output(proc)}"
        assert time.monotonic() < deadline, "timed out waiting to kill the run"
        time.sleep(0.005)
    proc.send_signal(signal.SIGKILL)
    assert proc.wait(timeout=60) == -signal.SIGKILL


def _output(proc: subprocess.Popen) -> str:
    return proc.stdout.read().decode(errors="replace") if proc.stdout else ""


def _steps_logged(run_dir: Path) -> int:
    try:
        return (run_dir / "metrics.jsonl").read_text().count('"type": "train"')
    except FileNotFoundError:
        return 0


def test_kill_9_mid_run_then_resume_gives_the_same_losses(tmp_path, cpp_dataset,
                                                          reference_losses):
    run_dir = tmp_path / "killed"
    config = write_config(tmp_path / "killed.toml", run_config(cpp_dataset, run_dir, **KILL_RUN))
    proc = _start(config)
    _kill_when(proc, lambda: _steps_logged(run_dir) >= 6)  # checkpoint 4 exists; 8 does not
    assert not (run_dir / "checkpoints" / "step_000012").exists()
    megacpp("train", "--config", str(config), "--resume", "auto", "--no-progress")
    assert train_losses(run_dir) == reference_losses


def test_kill_9_during_a_checkpoint_write_then_resume(tmp_path, cpp_dataset, reference_losses):
    run_dir = tmp_path / "mid-write"
    config = write_config(tmp_path / "mid-write.toml", run_config(
        cpp_dataset, run_dir, **KILL_RUN, debug={"checkpoint_stall_step": 8}))
    partial = run_dir / "checkpoints" / ".tmp-step_000008"
    proc = _start(config)
    _kill_when(proc, lambda: (partial / "trainer_state.json").exists())
    assert (partial / ".metadata").exists() and not (partial / "COMPLETE").exists()
    assert not (run_dir / "checkpoints" / "step_000008").exists()  # never published
    resumed = megacpp("train", "--config", str(config), "--resume", "auto", "--no-progress",
                      "--set", "debug.checkpoint_stall_step=0")
    assert "interrupted" in resumed.stderr and "step_000004" in resumed.stderr
    assert not partial.exists()
    assert train_losses(run_dir) == reference_losses


@pytest.fixture
def finished_run(tmp_path, cpp_dataset) -> tuple[RunConfig, Path]:
    """A 4-step run with checkpoints at steps 2 and 4."""
    path = write_config(tmp_path / "run.toml", run_config(cpp_dataset, tmp_path / "run",
                                                          train={"steps": 4}))
    cfg = load_run_config(path)
    train(cfg, console=_quiet())
    return cfg, tmp_path / "run" / "checkpoints"


def _resume(cfg: RunConfig, steps: int = 6, **kwargs):
    longer = RunConfig.from_dict(cfg.to_dict() | {"train": {**cfg.to_dict()["train"],
                                                            "steps": steps}})
    return train(longer, console=_quiet(), **kwargs)


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        (lambda ck: (ck / "COMPLETE").unlink(), "has no COMPLETE marker"),
        (lambda ck: os.truncate(ck / "__0_0.distcp", 100), "file __0_0.distcp is truncated"),
        (lambda ck: _flip_byte(ck / ".metadata"), "file .metadata is corrupt (sha256 mismatch)"),
        (lambda ck: (ck / "rank_00000.json").unlink(), "file rank_00000.json is missing"),
        (lambda ck: (ck / "COMPLETE").write_text("{not json"), "corrupt COMPLETE marker"),
    ],
)
def test_damaged_checkpoint_is_refused_by_name(finished_run, damage, message):
    cfg, checkpoints = finished_run
    latest = checkpoints / "step_000004"
    damage(latest)
    with pytest.raises(CheckpointError, match=re.escape(message)):
        verify_checkpoint(latest)
    with pytest.raises(TrainingFailed) as err:
        _resume(cfg, resume="auto")
    assert str(latest) in str(err.value) and message in str(err.value)
    assert "--fallback-to-previous" in str(err.value)
    with pytest.raises(TrainingFailed, match=re.escape(message)):
        _resume(cfg, resume=str(latest))


def test_fallback_to_previous_only_on_request(finished_run, cpp_dataset, tmp_path):
    cfg, checkpoints = finished_run
    (checkpoints / "step_000004" / "COMPLETE").unlink()
    result = _resume(cfg, resume="auto", fallback_to_previous=True)
    assert result.resumed_from == checkpoints / "step_000002" and result.steps == 6
    # the unusable checkpoint of step 4 was moved aside, not deleted, when step 4 was redone
    assert (checkpoints / ".stale-step_000004").is_dir()
    assert verify_checkpoint(checkpoints / "step_000004")["step"] == 4
    # resumed from step 2, the losses are those of an uninterrupted 6-step run
    reference = RunConfig.from_dict(run_config(cpp_dataset, tmp_path / "ref", train={"steps": 6}))
    assert train_losses(result.run_dir) == train_losses(train(reference, console=_quiet()).run_dir)


def test_keep_last_and_resume_auto_without_checkpoints(tmp_path, cpp_dataset):
    cfg = RunConfig.from_dict(run_config(cpp_dataset, tmp_path / "run", train={"steps": 8},
                                         checkpoint={"every": 2, "keep_last": 2}))
    result = train(cfg, resume="auto", console=_quiet())  # nothing to resume: a fresh start
    assert result.resumed_from is None
    names = sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir())
    assert names == ["step_000006", "step_000008"]


def test_trained_model_loads_for_inference(finished_run):
    _, checkpoints = finished_run
    model = load_trained_model(checkpoints / "step_000004")
    assert not model.training and model.cfg.vocab_size == 512
    out = model.generate_greedy(torch.tensor([[1, 2, 3]]), max_new_tokens=4)
    assert out.shape == (1, 7)
    with pytest.raises(CheckpointError, match="does not exist"):
        load_trained_model(checkpoints / "step_000099")


def _flip_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def test_resume_refuses_a_different_model(finished_run):
    cfg, _ = finished_run
    other = cfg.to_dict()
    other["model"]["d_model"] = 48
    other["train"]["steps"] = 6
    with pytest.raises(TrainingFailed, match=r"is of another model \(model.d_model: 32 -> 48"):
        train(RunConfig.from_dict(other), resume="auto", console=_quiet())
