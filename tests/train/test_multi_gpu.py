"""Two GPUs over NCCL: the graphed DDP step (flat gradient buffer, one captured all-reduce)
and the graphed FSDP2 step train as their eager runs do; a graphed 2-GPU checkpoint resumes
graphed on one GPU; the defaults (auto kernels, compile, graphs) run and say so; a rank
killed while the other replays its graph is caught by the step watchdog.

Marked ``gpu`` and skipped below two CUDA devices. On a GPU machine::

    pytest -q -m gpu tests/train/test_multi_gpu.py
"""

from __future__ import annotations

import io
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from rich.console import Console

from megacpp.train.config import RunConfig
from megacpp.train.graphs import WARMUP_STEPS
from megacpp.train.trainer import train
from tests.train.helpers import (
    free_port,
    megacpp,
    run_config,
    single_thread_env,
    torchrun,
    train_losses,
    write_config,
)

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")]

STEPS = WARMUP_STEPS + 5  # eager warm-up, the capture, then replays
FAST = {"kernels": "fast", "compile": False}  # no host syncs; no compile time in the tests
TRAIN = {"steps": STEPS, "eval_every": 4, "micro_batch_size": 4, "grad_accum_steps": 2}
SCHEDULE = {"warmup_steps": STEPS}  # the lr changes every step: the replays must read it


def _two_gpus(tmp: Path, dataset: Path, name: str, **parallel) -> Path:
    run_dir = tmp / name
    config = write_config(tmp / f"{name}.toml", run_config(
        dataset, run_dir, run={"device": "cuda"}, train=TRAIN, schedule=SCHEDULE,
        checkpoint={"every": 4}, parallel={**FAST, **parallel}))
    megacpp("train", "--config", str(config), "--no-progress", launcher=torchrun(2),
            timeout=900)
    return run_dir


def _modes(run_dir: Path) -> dict:
    return json.loads((run_dir / "receipt.json").read_text())["config"]["invocation"]["modes"]


@pytest.fixture(scope="module")
def eager_ddp(tmp_path_factory, cpp_dataset) -> Path:
    return _two_gpus(tmp_path_factory.mktemp("eager"), cpp_dataset, "ddp", strategy="ddp",
                     cuda_graph=False, grad_sync="ddp")


@pytest.fixture(scope="module")
def graphed_ddp(tmp_path_factory, cpp_dataset) -> Path:
    return _two_gpus(tmp_path_factory.mktemp("graphed"), cpp_dataset, "ddp", strategy="ddp",
                     cuda_graph=True)


def test_graphed_ddp_trains_as_eager_ddp(eager_ddp, graphed_ddp):
    graphed = train_losses(graphed_ddp)
    assert all(math.isfinite(x) for x in graphed) and graphed[-1] < graphed[0]
    assert graphed == pytest.approx(train_losses(eager_ddp), rel=1e-3)
    modes = _modes(graphed_ddp)
    assert (modes["cuda_graph"], modes["grad_sync"]) == (True, "flat")
    assert _modes(eager_ddp)["grad_sync"] == "ddp"


def test_graphed_fsdp2_trains_as_eager_fsdp2(tmp_path, cpp_dataset, eager_ddp):
    eager = train_losses(_two_gpus(tmp_path, cpp_dataset, "eager", strategy="fsdp",
                                   cuda_graph=False))
    graphed_dir = _two_gpus(tmp_path, cpp_dataset, "graphed", strategy="fsdp", cuda_graph=True)
    assert _modes(graphed_dir)["cuda_graph"] is True  # captured, not fallen back
    assert train_losses(graphed_dir) == pytest.approx(eager, rel=1e-3)
    assert eager == pytest.approx(train_losses(eager_ddp), rel=1e-2)


def test_graphed_two_gpu_checkpoint_resumes_graphed_on_one(tmp_path, cpp_dataset, graphed_ddp):
    run_dir = shutil.copytree(graphed_ddp, tmp_path / "copy")
    step4 = run_dir / "checkpoints" / "step_000004"
    cfg = RunConfig.from_dict(run_config(
        cpp_dataset, run_dir, run={"device": "cuda"},
        train={**TRAIN, "micro_batch_size": 8}, schedule=SCHEDULE, checkpoint={"every": 4},
        parallel={**FAST, "cuda_graph": True}))  # the same 16 rows a step on one GPU
    result = train(cfg, resume=str(step4), console=Console(file=io.StringIO()))
    assert result.resumed_from == step4 and result.steps == STEPS
    assert train_losses(run_dir) == pytest.approx(train_losses(graphed_ddp), rel=1e-3)


def test_two_gpus_default_to_the_fast_path(tmp_path, cpp_dataset, eager_ddp):
    run_dir = tmp_path / "defaults"
    config = write_config(tmp_path / "defaults.toml", run_config(
        cpp_dataset, run_dir, run={"device": "cuda"}, train=TRAIN, schedule=SCHEDULE))
    result = megacpp("train", "--config", str(config), "--no-progress", launcher=torchrun(2),
                     timeout=900)
    modes = _modes(run_dir)
    assert (modes["kernels"], modes["compile"], modes["cuda_graph"], modes["grad_sync"]) == (
        "auto", True, True, "flat"), modes
    assert "cuda_graph: on (default on CUDA)" in result.stderr + result.stdout
    assert train_losses(run_dir) == pytest.approx(train_losses(eager_ddp), rel=2e-2)
    receipt = json.loads((run_dir / "receipt.json").read_text())
    assert "measured in this run" in receipt["config"]["outcome"]["mfu"]
    assert 0 < receipt["metrics"]["mfu"] < 1


def test_a_rank_killed_during_replays_is_caught_by_the_watchdog(tmp_path, cpp_dataset):
    run_dir = tmp_path / "run"
    config = write_config(tmp_path / "c.toml", run_config(
        cpp_dataset, run_dir, run={"device": "cuda"},
        train={"steps": 100000, "eval_every": 0, "micro_batch_size": 4},
        checkpoint={"every": 1000}, parallel={**FAST, "cuda_graph": True, "timeout_s": 20}))
    port = str(free_port())
    ranks = [subprocess.Popen(
        [sys.executable, "-m", "megacpp", "train", "--config", str(config), "--no-progress"],
        env={**single_thread_env(), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port,
             "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "2"},
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for rank in (0, 1)]
    deadline = time.monotonic() + 600
    while _steps_logged(run_dir) < WARMUP_STEPS + 10:  # well into the replays
        assert ranks[0].poll() is None and time.monotonic() < deadline, ranks[0].stderr.read()
        time.sleep(0.05)
    os.kill(ranks[1].pid, signal.SIGKILL)
    killed_at = time.monotonic()
    _, stderr = ranks[0].communicate(timeout=180)
    ranks[1].wait(timeout=60)
    assert time.monotonic() - killed_at < 90, stderr  # timeout_s 20 + the watchdog's poll
    assert ranks[0].returncode != 0, stderr
    errors = [line for line in stderr.splitlines() if line.startswith("error:")]
    # our watchdog's line (or a failed eager collective's); NCCL's own abort may come first
    assert (errors and errors[0].startswith("error: rank 0: ")) or "NCCL" in stderr, stderr


def _steps_logged(run_dir: Path) -> int:
    try:
        return (run_dir / "metrics.jsonl").read_text().count('"type": "train"')
    except FileNotFoundError:
        return 0
