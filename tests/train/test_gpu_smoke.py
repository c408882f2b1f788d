"""A few training steps on CUDA: bf16 autocast, fused AdamW, Muon in bf16, MFU against the
device's peak, CUDA peak memory; regional compile; two GPUs over NCCL where available.

Marked ``gpu`` (skipped without CUDA). Run on a GPU machine with
``pytest -q -m gpu tests/train/test_gpu_smoke.py``.
"""

from __future__ import annotations

import io
import math
import sys

import pytest
import torch
from rich.console import Console

from megacpp.receipts import read_receipt
from megacpp.train.config import RunConfig
from megacpp.train.trainer import train
from tests.train.helpers import megacpp, run_config, train_losses, write_config

pytestmark = pytest.mark.gpu


EAGER = {"compile": False, "cuda_graph": False, "kernels": "reference"}  # the plain step


def _gpu_run(tmp_path, dataset, name: str, parallel: dict | None = None, **sections):
    cfg = RunConfig.from_dict(run_config(dataset, tmp_path / name, run={"device": "cuda"},
                                         train={"steps": 6, "micro_batch_size": 8},
                                         parallel={**EAGER, **(parallel or {})}, **sections))
    return train(cfg, console=Console(file=io.StringIO()))


def test_one_gpu_trains_in_bf16(tmp_path, cpp_dataset):
    result = _gpu_run(tmp_path, cpp_dataset, "gpu")
    losses = train_losses(result.run_dir)
    assert len(losses) == 6 and all(math.isfinite(x) for x in losses)
    assert losses[-1] < losses[0]
    receipt = read_receipt(result.receipt)
    assert receipt.config["invocation"]["device"].startswith("cuda")
    assert receipt.metrics["peak_mem_bytes"] > 0
    if "n/a" not in receipt.config["outcome"]["mfu"]:  # a device with a known bf16 peak
        assert 0 < receipt.metrics["mfu"] < 1


def test_one_gpu_with_regional_compile_and_checkpointing(tmp_path, cpp_dataset):
    eager = train_losses(_gpu_run(tmp_path, cpp_dataset, "eager").run_dir)
    compiled = _gpu_run(tmp_path, cpp_dataset, "compiled",
                        parallel={"compile": True, "activation_checkpointing": "ME"})
    assert train_losses(compiled.run_dir) == pytest.approx(eager, rel=2e-2)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_two_gpus_over_nccl(tmp_path, cpp_dataset, strategy):
    one = train_losses(_gpu_run(tmp_path, cpp_dataset, "one").run_dir)
    config = write_config(tmp_path / "two.toml", run_config(
        cpp_dataset, tmp_path / "two", run={"device": "cuda"},
        train={"steps": 6, "micro_batch_size": 4}, parallel={**EAGER, "strategy": strategy}))
    torchrun = (sys.executable, "-m", "torch.distributed.run", "--standalone",
                "--nproc-per-node", "2")
    megacpp("train", "--config", str(config), "--no-progress", launcher=torchrun)
    assert train_losses(tmp_path / "two") == pytest.approx(one, rel=2e-2)
    assert read_receipt(tmp_path / "two" / "receipt.json").metrics["world_size"] == 2
