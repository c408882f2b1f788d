"""Two real processes (torchrun, gloo, CPU): DDP and FSDP2 reproduce the single-process
losses of the same global batch; a DDP checkpoint resumes under FSDP2."""

from __future__ import annotations

import io
import json
import shutil
import sys
from pathlib import Path

import pytest
from rich.console import Console

from megacpp.train.config import RunConfig
from megacpp.train.trainer import train
from tests.train.helpers import DSA_MTP_MODEL, megacpp, run_config, train_losses, write_config

TORCHRUN = (sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2")
TRAIN = {"steps": 4, "eval_every": 2}
TOLERANCE = 2e-5  # relative: 2 x 2 rows sum in another order than 4 rows


@pytest.fixture(scope="module")
def single_losses(tmp_path_factory, cpp_dataset) -> list[float]:
    """One process, micro-batch 4: the global batch the two-process runs split 2 + 2."""
    tmp = tmp_path_factory.mktemp("single")
    cfg = RunConfig.from_dict(run_config(cpp_dataset, tmp / "run",
                                         train={**TRAIN, "micro_batch_size": 4}))
    return train_losses(train(cfg, console=Console(file=io.StringIO())).run_dir)


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
