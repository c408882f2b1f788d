"""Training across process counts, with real gloo processes on CPU: a checkpoint resumes on
another world size (1 -> 2, 2 -> 1, 2 -> 4) and continues the loss curve, two "nodes" on one
machine (two torchrun launchers, one rendezvous on 127.0.0.1) train as one process does, a
global batch the processes cannot split is refused before anything starts, and a rank killed
mid-run makes the other stop with a clear error in bounded time, after which a restart
resumes from the last complete checkpoint.

The model is the tiny one and every run is a few steps; the 4-process resume is marked slow.
"""

from __future__ import annotations

import io
import json
import os
import shutil
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
    TORCHRUN,
    free_port,
    megacpp,
    run_config,
    single_thread_env,
    torchrun,
    train_losses,
    write_config,
)

TRAIN = {"steps": 4, "eval_every": 2}
TOLERANCE = 2e-5  # relative: the same rows summed in another order
GLOBAL = {"global_batch_size": 4}  # 4 rows a step on any number of ranks


@pytest.fixture(scope="module")
def single(tmp_path_factory, cpp_dataset) -> Path:
    """One process, 4 rows a step as 2 micro-batches of 2: the run every layout matches."""
    run_dir = tmp_path_factory.mktemp("single") / "run"
    cfg = RunConfig.from_dict(run_config(cpp_dataset, run_dir,
                                         train={**TRAIN, **GLOBAL, "micro_batch_size": 2}))
    return train(cfg, console=Console(file=io.StringIO())).run_dir


def _resume_copy(run_dir: Path, dest: Path, step: int) -> tuple[Path, Path]:
    copy = shutil.copytree(run_dir, dest)
    return copy, copy / "checkpoints" / f"step_{step:06d}"


def _receipt(run_dir: Path) -> dict:
    return json.loads((run_dir / "receipt.json").read_text())


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory, cpp_dataset, single) -> Path:
    """Two processes, 2 rows each: the same 4-row steps as :func:`single`."""
    tmp = tmp_path_factory.mktemp("two")
    config = write_config(tmp / "two.toml", run_config(
        cpp_dataset, tmp / "run", train={**TRAIN, **GLOBAL, "micro_batch_size": 2}))
    megacpp("train", "--config", str(config), "--no-progress", launcher=torchrun(2))
    assert train_losses(tmp / "run") == pytest.approx(train_losses(single), rel=TOLERANCE)
    return tmp / "run"


@pytest.mark.slow
def test_one_rank_checkpoint_resumes_on_two(tmp_path, single):
    run_dir, step2 = _resume_copy(single, tmp_path / "copy", 2)
    megacpp("train", "--config", str(run_dir / "config.toml"), "--no-progress",
            "--resume", str(step2), "--set", f"run.out_dir={run_dir}", launcher=torchrun(2))
    assert train_losses(run_dir) == pytest.approx(train_losses(single), rel=TOLERANCE)
    receipt = _receipt(run_dir)
    assert receipt["config"]["invocation"]["world_size"] == 2
    assert receipt["config"]["invocation"]["global_batch"] == 4  # 2 ranks x 2 rows x 1


@pytest.mark.slow
def test_two_rank_checkpoint_resumes_on_one(tmp_path, single, two_ranks, cpp_dataset):
    run_dir, step2 = _resume_copy(two_ranks, tmp_path / "copy", 2)
    cfg = RunConfig.from_dict(run_config(cpp_dataset, run_dir,
                                         train={**TRAIN, **GLOBAL, "micro_batch_size": 2}))
    out = io.StringIO()
    result = train(cfg, resume=str(step2), console=Console(file=out, width=200))
    assert "resuming a checkpoint of 2 rank(s) on 1: the data continues at its global sample 8" \
        in out.getvalue()
    assert result.steps == 4
    assert train_losses(run_dir) == pytest.approx(train_losses(single), rel=TOLERANCE)


@pytest.mark.slow
def test_two_rank_checkpoint_resumes_on_four_under_fsdp2(tmp_path, single, two_ranks):
    """2 -> 4 ranks, DDP -> FSDP2: DCP reshards the replicated tensors into 4 shards."""
    run_dir, step2 = _resume_copy(two_ranks, tmp_path / "copy", 2)
    megacpp("train", "--config", str(run_dir / "config.toml"), "--no-progress",
            "--resume", str(step2), "--set", f"run.out_dir={run_dir}",
            "--set", "train.micro_batch_size=1", "--set", "parallel.strategy=fsdp",
            launcher=torchrun(4))
    assert train_losses(run_dir) == pytest.approx(train_losses(single), rel=TOLERANCE)
    assert _receipt(run_dir)["config"]["invocation"]["world_size"] == 4


@pytest.mark.slow
def test_two_nodes_on_one_machine_train_as_one_process(tmp_path, single, cpp_dataset):
    """`torchrun --nnodes 2 --nproc-per-node 1` twice, node ranks 0 and 1, one rendezvous on
    127.0.0.1 -- the multi-node command -- with the flat gradient buffer, its 190 KB summed in
    ~10 buckets started during backward."""
    run_dir = tmp_path / "nodes"
    config = write_config(tmp_path / "nodes.toml", run_config(
        cpp_dataset, run_dir, train={**TRAIN, **GLOBAL, "micro_batch_size": 2},
        parallel={"grad_sync": "flat", "bucket_mb": 0.02}))
    port = str(free_port())
    nodes = [subprocess.Popen(
        [*TORCHRUN, "--nnodes", "2", "--nproc-per-node", "1", "--node-rank", str(rank),
         "--master-addr", "127.0.0.1", "--master-port", port,
         "-m", "megacpp", "train", "--config", str(config), "--no-progress"],
        env=single_thread_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for rank in (0, 1)]
    outputs = [node.communicate(timeout=300)[0] for node in nodes]
    assert [node.returncode for node in nodes] == [0, 0], "\n".join(outputs)
    assert train_losses(run_dir) == pytest.approx(train_losses(single), rel=TOLERANCE)
    receipt = _receipt(run_dir)
    assert receipt["config"]["invocation"]["modes"]["grad_sync"] == "flat"
    assert receipt["metrics"]["world_size"] == 2


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
    receipt = _receipt(run_dir)
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
