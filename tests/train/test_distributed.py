"""Real processes (torchrun, gloo, CPU): DDP and FSDP2 reproduce the single-process losses of
the same global batch; a checkpoint resumes on another world size (1 -> 2, 2 -> 1, 2 -> 4)
and under another strategy (DDP -> FSDP2) and continues the loss curve; two "nodes" on one
machine (two torchrun launchers, one rendezvous on 127.0.0.1) train as one process does.

Every run is the tiny model for 4 steps; those over ~15 s are marked slow."""

from __future__ import annotations

import io
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from rich.console import Console

from megacpp.train.config import RunConfig, load_run_config
from megacpp.train.trainer import train
from tests.train.helpers import (
    DSA_MTP_MODEL,
    free_port,
    megacpp,
    run_config,
    single_thread_env,
    torchrun,
    train_losses,
    write_config,
)
from tests.train.helpers import (
    TORCHRUN as LAUNCHER,
)

TORCHRUN = (sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2")
TRAIN = {"steps": 4, "eval_every": 2}
TOLERANCE = 2e-5  # relative: 2 x 2 rows sum in another order than 4 rows


@pytest.fixture(scope="module")
def single_run(tmp_path_factory, cpp_dataset) -> Path:
    """One process, micro-batch 4: the global batch the two-process runs split 2 + 2."""
    tmp = tmp_path_factory.mktemp("single")
    cfg = RunConfig.from_dict(run_config(cpp_dataset, tmp / "run",
                                         train={**TRAIN, "micro_batch_size": 4}))
    return train(cfg, console=Console(file=io.StringIO())).run_dir


@pytest.fixture(scope="module")
def single_losses(single_run) -> list[float]:
    return train_losses(single_run)


def _two_processes(tmp: Path, dataset: Path, strategy: str) -> Path:
    run_dir = tmp / strategy
    config = write_config(tmp / f"{strategy}.toml", run_config(
        dataset, run_dir, train={**TRAIN, "micro_batch_size": 2},
        parallel={"strategy": strategy, "activation_checkpointing": "E"}))
    megacpp("train", "--config", str(config), "--no-progress", launcher=TORCHRUN)
    return run_dir


@pytest.fixture(scope="module")
def ddp_run(tmp_path_factory, cpp_dataset) -> Path:
    return _two_processes(tmp_path_factory.mktemp("ddp"), cpp_dataset, "ddp")


def _check_two_rank_run(run_dir: Path, single_losses: list[float], strategy: str) -> None:
    assert train_losses(run_dir) == pytest.approx(single_losses, rel=TOLERANCE)
    checkpoint = run_dir / "checkpoints" / "step_000004"
    assert (checkpoint / "rank_00000.json").exists() and (checkpoint / "rank_00001.json").exists()
    receipt = json.loads((run_dir / "receipt.json").read_text())
    assert receipt["metrics"]["world_size"] == 2
    assert receipt["config"]["invocation"]["strategy"] == strategy


def test_ddp_matches_one_process(ddp_run, single_losses):
    _check_two_rank_run(ddp_run, single_losses, "ddp")


def test_fsdp2_matches_one_process(tmp_path, cpp_dataset, single_losses):
    _check_two_rank_run(_two_processes(tmp_path, cpp_dataset, "fsdp"), single_losses, "fsdp")


def test_ddp_checkpoint_resumes_under_fsdp2(tmp_path, ddp_run, single_losses):
    run_dir = shutil.copytree(ddp_run, tmp_path / "copy")
    step2 = run_dir / "checkpoints" / "step_000002"
    megacpp("train", "--config", str(run_dir / "config.toml"), "--no-progress",
            "--resume", str(step2), "--set", "parallel.strategy=fsdp",
            "--set", f"run.out_dir={run_dir}", launcher=TORCHRUN)
    assert train_losses(run_dir) == pytest.approx(single_losses, rel=TOLERANCE)
    receipt = json.loads((run_dir / "receipt.json").read_text())
    assert receipt["config"]["invocation"]["resumed_from"] == str(step2)
    assert receipt["config"]["invocation"]["strategy"] == "fsdp"
    assert (run_dir / "history").is_dir()  # the DDP segment's receipt is kept


def test_ddp_trains_a_model_with_dsa_and_mtp(tmp_path, cpp_dataset):
    """DDP needs a gradient on every parameter: the MTP output norm and the DSA indexer get
    theirs only from the MTP loss and the indexer KL (the trainer once left both out, and
    this run failed with DDP's unused-parameter error)."""
    config = write_config(tmp_path / "c.toml", run_config(
        cpp_dataset, tmp_path / "run", model=DSA_MTP_MODEL,
        train={"steps": 2, "eval_every": 0, "micro_batch_size": 2},
        parallel={"strategy": "ddp"}))
    megacpp("train", "--config", str(config), "--no-progress", launcher=TORCHRUN)
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text()
               .splitlines()]
    assert [r["step"] for r in records if r["type"] == "train" and r["mtp_loss"] > 0] == [1, 2]


def _resume_copy(run_dir: Path, dest: Path) -> tuple[Path, Path]:
    """A copy of ``run_dir`` and its step-2 checkpoint."""
    copy = shutil.copytree(run_dir, dest)
    return copy, copy / "checkpoints" / "step_000002"


def _invocation(run_dir: Path) -> dict:
    return json.loads((run_dir / "receipt.json").read_text())["config"]["invocation"]


@pytest.mark.slow
def test_one_rank_checkpoint_resumes_on_two(tmp_path, single_run, single_losses):
    run_dir, step2 = _resume_copy(single_run, tmp_path / "copy")
    megacpp("train", "--config", str(run_dir / "config.toml"), "--no-progress",
            "--resume", str(step2), "--set", f"run.out_dir={run_dir}",
            "--set", "train.micro_batch_size=2", launcher=TORCHRUN)
    assert train_losses(run_dir) == pytest.approx(single_losses, rel=TOLERANCE)
    invocation = _invocation(run_dir)
    assert (invocation["world_size"], invocation["global_batch"]) == (2, 4)


def test_two_rank_checkpoint_resumes_on_one(tmp_path, ddp_run, single_losses):
    """2 ranks x 2 rows -> 1 rank x 2 rows x 2 micro-batches (train.global_batch_size = 4)."""
    run_dir, step2 = _resume_copy(ddp_run, tmp_path / "copy")
    cfg = load_run_config(run_dir / "config.toml", [
        f"run.out_dir={run_dir}", "train.global_batch_size=4", "train.grad_accum_steps=1"])
    out = io.StringIO()
    result = train(cfg, resume=str(step2), console=Console(file=out, width=200))
    assert ("resuming a checkpoint of 2 rank(s) on 1: the data continues at its global "
            "sample 8") in out.getvalue()
    assert result.steps == 4 and _invocation(run_dir)["global_batch"] == 4
    assert train_losses(run_dir) == pytest.approx(single_losses, rel=TOLERANCE)


@pytest.mark.slow
def test_two_rank_checkpoint_resumes_on_four_under_fsdp2(tmp_path, ddp_run, single_losses):
    """2 -> 4 ranks, DDP -> FSDP2: DCP reshards the replicated tensors into 4 shards."""
    run_dir, step2 = _resume_copy(ddp_run, tmp_path / "copy")
    megacpp("train", "--config", str(run_dir / "config.toml"), "--no-progress",
            "--resume", str(step2), "--set", f"run.out_dir={run_dir}",
            "--set", "train.micro_batch_size=1", "--set", "parallel.strategy=fsdp",
            launcher=torchrun(4))
    assert train_losses(run_dir) == pytest.approx(single_losses, rel=TOLERANCE)
    assert _invocation(run_dir)["world_size"] == 4


@pytest.mark.slow
def test_two_nodes_on_one_machine_train_as_one_process(tmp_path, cpp_dataset, single_losses):
    """`torchrun --nnodes 2 --nproc-per-node 1` twice, node ranks 0 and 1, one rendezvous on
    127.0.0.1 -- the multi-node command -- with the flat gradient buffer, its 190 KB summed in
    ~10 buckets started during backward."""
    run_dir = tmp_path / "nodes"
    config = write_config(tmp_path / "nodes.toml", run_config(
        cpp_dataset, run_dir, train={**TRAIN, "micro_batch_size": 2},
        parallel={"grad_sync": "flat", "bucket_mb": 0.02}))
    port = str(free_port())
    nodes = [subprocess.Popen(
        [*LAUNCHER, "--nnodes", "2", "--nproc-per-node", "1", "--node-rank", str(rank),
         "--master-addr", "127.0.0.1", "--master-port", port,
         "-m", "megacpp", "train", "--config", str(config), "--no-progress"],
        env=single_thread_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for rank in (0, 1)]
    outputs = [node.communicate(timeout=300)[0] for node in nodes]
    assert [node.returncode for node in nodes] == [0, 0], "\n".join(outputs)
    assert train_losses(run_dir) == pytest.approx(single_losses, rel=TOLERANCE)
    invocation = _invocation(run_dir)
    assert (invocation["modes"]["grad_sync"], invocation["world_size"]) == ("flat", 2)
