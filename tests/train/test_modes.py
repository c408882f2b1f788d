"""The run's execution modes (``megacpp.train.modes``): the fast path by default on CUDA, the
plain step on CPU, explicit choices kept, impossible ones refused in one line, and the
environment variable overriding the config. Pure decisions: no device or process needed."""

from __future__ import annotations

import io
import json

import pytest
import torch
from rich.console import Console

from megacpp.errors import ConfigError
from megacpp.kernels.runtime import kernel_mode_override
from megacpp.train.config import ParallelSection, RunConfig
from megacpp.train.modes import plan_execution
from megacpp.train.trainer import train
from tests.train.helpers import run_config

CUDA, CPU = torch.device("cuda", 0), torch.device("cpu")


@pytest.fixture(autouse=True)
def no_kernel_env(monkeypatch):
    monkeypatch.delenv("MEGACPP_KERNELS", raising=False)


def test_cuda_defaults_are_the_fast_path():
    plan = plan_execution(ParallelSection(), CUDA, "single", 1)
    assert (plan.kernels, plan.compile, plan.cuda_graph, plan.grad_sync) == ("auto", True, True,
                                                                             None)
    assert plan.lines() == [
        "kernels: auto (default on CUDA: the catalog's chosen backend where it qualifies)",
        "compile: on (default on CUDA)", "cuda_graph: on (default on CUDA)",
        "float8: off (default: bf16 GEMMs)"]


def test_cpu_defaults_stay_the_plain_step():
    plan = plan_execution(ParallelSection(), CPU, "ddp", 2)
    assert (plan.kernels, plan.compile, plan.cuda_graph) == ("reference", False, False)
    assert plan.grad_sync == "ddp"  # no graph: torch's DDP, overlapped with backward
    assert "cuda_graph: off (default off on CPU)" in plan.lines()


def test_graphed_ddp_uses_the_flat_reduction_and_fsdp_graphs_too():
    ddp = plan_execution(ParallelSection(), CUDA, "ddp", 2)
    assert (ddp.cuda_graph, ddp.grad_sync) == (True, "flat")
    fsdp = plan_execution(ParallelSection(), CUDA, "fsdp", 2)
    assert (fsdp.cuda_graph, fsdp.grad_sync) == (True, None)


def test_opting_out_is_kept_and_said():
    plan = plan_execution(ParallelSection(compile=False, cuda_graph=False, kernels="reference"),
                          CUDA, "ddp", 4)
    assert (plan.kernels, plan.compile, plan.cuda_graph, plan.grad_sync) == (
        "reference", False, False, "ddp")
    assert plan.lines()[:3] == ["kernels: reference (parallel.kernels = \"reference\")",
                                "compile: off (parallel.compile = false)",
                                "cuda_graph: off (parallel.cuda_graph = false)"]


def test_auto_graphs_step_aside_where_capture_cannot_hold():
    reference = plan_execution(ParallelSection(kernels="reference"), CUDA, "single", 1)
    assert not reference.cuda_graph and "reference kernels sync" in reference.cuda_graph_why
    wrapper = plan_execution(ParallelSection(grad_sync="ddp"), CUDA, "ddp", 2)
    assert not wrapper.cuda_graph and wrapper.grad_sync == "ddp"


def test_impossible_explicit_modes_are_refused_in_one_line():
    with pytest.raises(ConfigError, match="needs a CUDA device .* set it false or \"auto\""):
        plan_execution(ParallelSection(cuda_graph=True), CPU, "single", 1)
    with pytest.raises(ConfigError, match="needs parallel.grad_sync = \"flat\""):
        plan_execution(ParallelSection(cuda_graph=True, grad_sync="ddp"), CUDA, "ddp", 2)


def test_the_environment_variable_overrides_the_config(monkeypatch):
    monkeypatch.setenv("MEGACPP_KERNELS", "fast")
    plan = plan_execution(ParallelSection(kernels="reference"), CUDA, "single", 1)
    assert plan.kernels == "fast"
    assert plan.kernels_why == ("MEGACPP_KERNELS=fast; parallel.kernels = \"reference\" is "
                                "overridden")
    monkeypatch.delenv("MEGACPP_KERNELS")
    with kernel_mode_override("fast"):
        assert plan_execution(ParallelSection(), CPU, "single", 1).kernels == "fast"


def test_a_cpu_run_logs_and_receipts_its_modes(tmp_path, cpp_dataset):
    console = io.StringIO()
    result = train(RunConfig.from_dict(run_config(cpp_dataset, tmp_path / "run",
                                                  train={"steps": 2, "eval_every": 0})),
                   console=Console(file=console, width=200))
    assert "compile: off (default off on CPU)" in console.getvalue()
    receipt = json.loads(result.receipt.read_text())
    modes = receipt["config"]["invocation"]["modes"]
    assert (modes["kernels"], modes["compile"], modes["cuda_graph"]) == ("reference", False, False)
    setup = json.loads((result.run_dir / "metrics.jsonl").read_text().splitlines()[0])
    assert setup["type"] == "setup" and setup["modes"] == modes
    assert setup["mfu_peak_tflops"] is None and "fp32 run" in setup["mfu_peak_source"]
