"""Faults of a run of several processes, with real gloo processes on CPU: a global batch the
processes cannot split is refused before anything starts, and a rank killed mid-run makes
the other stop with a clear error in bounded time, after which a restart resumes from the
last complete checkpoint and repeats the lost steps bit for bit."""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from rich.console import Console

from megacpp.errors import ConfigError
from megacpp.train.config import RunConfig
from megacpp.train.trainer import train
from tests.train.helpers import (
    free_port,
    run_config,
    single_thread_env,
    write_config,
)


def test_a_global_batch_the_ranks_cannot_split_is_refused_before_any_work(tmp_path,
                                                                          cpp_dataset,
                                                                          monkeypatch):
    """Refused from the launch's WORLD_SIZE before a process group starts (none could: no
    MASTER_ADDR) or the run directory is made."""
    cfg = RunConfig.from_dict(run_config(cpp_dataset, tmp_path / "run",
                                         train={"steps": 2, "global_batch_size": 5}))
    for key, value in {"WORLD_SIZE": "2", "RANK": "0", "LOCAL_RANK": "0"}.items():
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    with pytest.raises(ConfigError) as err:
        train(cfg, console=Console(file=io.StringIO()))
    assert str(err.value) == (
        "train.global_batch_size = 5 rows does not divide over the 2 processes of this run; "
        "use a multiple of 2 (e.g. 4) or launch a number of processes that divides 5")
    assert err.value.exit_code == 2 and not (tmp_path / "run").exists()


def _rank(config: Path, rank: int, port: int, *extra: str) -> subprocess.Popen:
    """One of two ranks started by hand (what torchrun sets, without its agent)."""
    env = {**single_thread_env(), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
           "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "2"}
    return subprocess.Popen([sys.executable, "-m", "megacpp", "train", "--config", str(config),
                             "--no-progress", *extra], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def _train_records(run_dir: Path) -> dict[int, float]:
    try:
        lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    except FileNotFoundError:
        return {}
    records = [json.loads(line) for line in lines if line.endswith("}")]
    return {r["step"]: r["loss"] for r in records if r["type"] == "train"}


@pytest.mark.slow
def test_a_killed_rank_stops_the_other_with_a_clear_error_and_a_restart_resumes(tmp_path,
                                                                                cpp_dataset):
    run_dir = tmp_path / "run"
    config = write_config(tmp_path / "c.toml", run_config(
        cpp_dataset, run_dir, train={"steps": 400, "eval_every": 0, "micro_batch_size": 2},
        schedule={"kind": "constant", "warmup_steps": 0},  # the lr is the same on restart
        checkpoint={"every": 4, "keep_last": 2}, parallel={"timeout_s": 30}))
    port = free_port()
    ranks = [_rank(config, rank, port) for rank in (0, 1)]
    deadline = time.monotonic() + 240
    while max(_train_records(run_dir), default=0) < 6:  # checkpoint 4 is complete
        assert ranks[0].poll() is None and time.monotonic() < deadline, ranks[0].stderr.read()
        time.sleep(0.01)
    ranks[1].send_signal(signal.SIGKILL)
    killed_at = time.monotonic()
    _, stderr = ranks[0].communicate(timeout=120)
    ranks[1].wait(timeout=60)
    assert time.monotonic() - killed_at < 60  # detected, not waited out
    assert ranks[0].returncode == 1, stderr
    errors = [line for line in stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in stderr, stderr
    assert errors[0].startswith("error: rank 0: a collective failed at step ")
    assert "restart with --resume auto" in errors[0]
    published = sorted((run_dir / "checkpoints").glob("step_*"))
    assert published and all((p / "COMPLETE").is_file() for p in published)  # none partial
    receipt = json.loads((run_dir / "receipt.json").read_text())
    assert receipt["metrics"]["completed"] == 0 and "collective failed" in \
        receipt["config"]["outcome"]["error"]

    before = _train_records(run_dir)
    last = int(published[-1].name.split("_")[1])
    stop = min(last + 3, max(before))  # steps the killed run finished after its checkpoint
    port = free_port()
    ranks = [_rank(config, rank, port, "--resume", "auto", "--set", f"train.steps={stop}")
             for rank in (0, 1)]
    outputs = [rank.communicate(timeout=300) for rank in ranks]
    assert [rank.returncode for rank in ranks] == [0, 0], outputs[0][1]
    assert f"resumed from {published[-1]}" in outputs[0][1]
    after = _train_records(run_dir)
    assert sorted(after) == list(range(1, stop + 1))
    assert [after[s] for s in range(last + 1, stop + 1)] == [
        before[s] for s in range(last + 1, stop + 1)]  # the same steps, bit for bit
    assert os.listdir(run_dir / "history")  # the failed segment's receipt is kept
