"""``parallel.cuda_graph``: the training step captured as two CUDA graphs and replayed.

On CPU only the refusals run; the rest is marked ``gpu`` (``pytest -m gpu
tests/train/test_cuda_graph.py`` on a GPU machine): a graphed run trains as the eager run
does (same losses, the schedule's lr reaching the replays), resumes exactly, keeps the
non-finite guard (the bad step is never applied), and a step with host syncs (the reference
kernels) fails to capture with an error that says what to do.
"""

from __future__ import annotations

import io
import math

import pytest
import torch
from rich.console import Console

from megacpp.kernels.runtime import clear_resolutions, kernel_mode_override
from megacpp.train.config import RunConfig
from megacpp.train.graphs import WARMUP_STEPS
from megacpp.train.trainer import TrainingFailed, train
from tests.train.helpers import run_config, train_losses

STEPS = WARMUP_STEPS + 5  # eager warm-up, the capture, then replays
CUDA = {"device": "cuda"}


def _run(tmp_path, dataset, name: str, graphed: bool, resume: str | None = None, **sections):
    sections.setdefault("train", {"steps": STEPS, "eval_every": 4})
    cfg = RunConfig.from_dict(run_config(
        dataset, tmp_path / name, run=CUDA, parallel={"cuda_graph": graphed, "compile": False},
        schedule={"warmup_steps": STEPS}, **sections))  # the lr changes every step
    return train(cfg, resume=resume, console=Console(file=io.StringIO()))


def test_cuda_graph_needs_a_cuda_device(tmp_path, cpp_dataset):
    cfg = RunConfig.from_dict(run_config(cpp_dataset, tmp_path / "run", run={"device": "cpu"},
                                         parallel={"cuda_graph": True}))
    with pytest.raises(TrainingFailed, match="parallel.cuda_graph = true needs a CUDA device"):
        train(cfg, console=Console(file=io.StringIO()))


@pytest.fixture
def fast_kernels():
    """The catalog's fast kernels (no host syncs), as a graphed run needs."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    clear_resolutions()
    with kernel_mode_override("fast"):
        yield
    clear_resolutions()


@pytest.mark.gpu
def test_graphed_run_trains_as_the_eager_run(tmp_path, cpp_dataset, fast_kernels):
    eager = train_losses(_run(tmp_path, cpp_dataset, "eager", graphed=False).run_dir)
    result = _run(tmp_path, cpp_dataset, "graphed", graphed=True)
    graphed = train_losses(result.run_dir)
    assert all(math.isfinite(x) for x in graphed) and graphed[-1] < graphed[0]
    # the same kernels in the same order; only AdamW's capturable state and Muon's float32
    # lr tensor differ by rounding from the eager run
    assert graphed == pytest.approx(eager, rel=1e-3)


@pytest.mark.gpu
def test_graphed_run_resumes_exactly(tmp_path, cpp_dataset, fast_kernels):
    whole = train_losses(_run(tmp_path, cpp_dataset, "whole", graphed=True,
                              checkpoint={"every": 4}).run_dir)
    first = _run(tmp_path, cpp_dataset, "split", graphed=True, checkpoint={"every": 4},
                 train={"steps": 4, "eval_every": 4})
    assert first.steps == 4
    resumed = _run(tmp_path, cpp_dataset, "split", graphed=True, resume="auto",
                   checkpoint={"every": 4})
    assert resumed.resumed_from is not None
    assert train_losses(resumed.run_dir) == pytest.approx(whole, rel=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("target", ["loss", "embed.weight"])
def test_graphed_run_keeps_the_nonfinite_guard(tmp_path, cpp_dataset, fast_kernels, target):
    bad = WARMUP_STEPS + 2  # a replayed step
    with pytest.raises(TrainingFailed, match=f"non-finite .* at step {bad}") as err:
        _run(tmp_path, cpp_dataset, "nan", graphed=True,
             debug={"nan_step": bad, "nan_target": target})
    assert "first parameter with a non-finite gradient: embed.weight" in str(err.value)
    assert len(train_losses(tmp_path / "nan")) == bad - 1  # the bad step was never applied


@pytest.mark.gpu
def test_host_syncs_fail_capture_with_advice(tmp_path, cpp_dataset):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    clear_resolutions()
    # the reference MoE loop syncs the host
    with kernel_mode_override("reference"), pytest.raises(TrainingFailed,
                                                          match="MEGACPP_KERNELS=fast"):
        _run(tmp_path, cpp_dataset, "ref", graphed=True)
    clear_resolutions()
    assert torch.cuda.is_available()  # the process can still use the GPU
    torch.zeros(1, device="cuda").add_(1).item()
