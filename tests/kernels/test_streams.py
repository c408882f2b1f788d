"""Side-stream branches of a backward pass (megacpp.kernels.streams): no-ops on CPU; on the
GPU the fork waits for the current stream and the join makes it wait for the branch, and the
MoE and Mamba-3 backward passes that fork give the same results bit for bit with the side
stream on and off, eagerly and replayed from a CUDA graph."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from megacpp.kernels import streams
from megacpp.kernels.streams import Branch


def test_branch_is_a_no_op_on_cpu(monkeypatch) -> None:
    monkeypatch.delenv(streams.ENV, raising=False)
    assert streams.enabled()
    branch = Branch(torch.device("cpu"))
    assert not branch.active
    x = torch.zeros(3)
    with branch.fork():
        x += 1
    branch.join()
    assert x.tolist() == [1.0, 1.0, 1.0]


def test_switch_reads_the_environment(monkeypatch) -> None:
    monkeypatch.setenv(streams.ENV, "0")
    assert not streams.enabled()
    monkeypatch.setenv(streams.ENV, "1")
    assert streams.enabled()


@pytest.mark.gpu
def test_fork_waits_for_the_current_stream_and_join_for_the_branch(monkeypatch) -> None:
    """A slow write on the current stream, then a fork that reads it and writes elsewhere,
    then the join and a read on the current stream: without the waits the side stream would
    read before the write (the sleep is ~100 ms) and the current stream before the branch."""
    monkeypatch.delenv(streams.ENV, raising=False)
    dev = torch.device("cuda")
    src = torch.zeros(1 << 20, device=dev)
    dst = torch.zeros_like(src)
    torch.cuda.synchronize()
    for step in range(1, 4):
        branch = Branch(dev)
        assert branch.active
        torch.cuda._sleep(100_000_000)
        src.fill_(float(step))
        with branch.fork():
            assert torch.cuda.current_stream(dev) == streams.side_stream(dev)
            torch.cuda._sleep(50_000_000)
            dst.copy_(src * 2)
        assert torch.cuda.current_stream(dev) != streams.side_stream(dev)
        branch.join()
        total = dst.sum()
        assert total.item() == 2.0 * step * src.numel()


def _count_forks(monkeypatch) -> list[bool]:
    """Record every fork (whether it ran on the side stream) of the code under test."""
    forks: list[bool] = []
    fork = Branch.fork

    def counted(self):
        forks.append(self.active)
        return fork(self)

    monkeypatch.setattr(Branch, "fork", counted)
    return forks


def _on_and_off(monkeypatch, run) -> tuple[list, list, list]:
    """``run()`` -> tensors, with the side stream off, on (eagerly), and on inside a CUDA graph
    replayed once (inputs unchanged)."""
    from megacpp.kernels import timing

    monkeypatch.setenv(streams.ENV, "0")
    off = [t.clone() for t in run()]
    monkeypatch.setenv(streams.ENV, "1")
    on = [t.clone() for t in run()]
    graph, captured = timing.capture_graph(run)
    graph.replay()
    torch.cuda.synchronize()
    return off, on, [t.clone() for t in captured]


@pytest.mark.gpu
def test_moe_backward_is_the_same_with_the_side_stream(monkeypatch) -> None:
    from megacpp.kernels.ops.moe.grouped import moe_experts_grouped
    from tests.kernels.test_moe_grouped import _inputs

    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("the wgrad kernel (what runs on the side stream) needs sm90+")
    forks = _count_forks(monkeypatch)
    x, idx, w, w_in, w_out = _inputs(4096, 256, 16, 4, 192, torch.bfloat16, "cuda", 3, (5,))
    leaves = [t.detach().clone().requires_grad_() for t in (x, w, w_in, w_out)]
    cot = torch.randn(4096, 256, device="cuda").bfloat16()

    def run():
        out = moe_experts_grouped(leaves[0], idx, *leaves[1:])
        return [out, *torch.autograd.grad(out, leaves, cot)]

    off, on, graphed = _on_and_off(monkeypatch, run)
    assert forks[:2] == [False, False] and all(forks[2:]) and len(forks) > 2
    for name, a, b, c in zip(("out", "dx", "dw", "dw_in", "dw_out"), off, on, graphed):
        assert torch.equal(a, b) and torch.equal(a, c), name
    assert off[4][5].abs().max() == 0  # expert 5 has no rows: its dw_out is zeros


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton")
@pytest.mark.gpu
def test_mamba3_backward_is_the_same_with_the_side_stream(monkeypatch) -> None:
    from megacpp.kernels.ops.mamba3_scan.triton import mamba3_scan_triton
    from tests.kernels.test_mamba3_triton import GRAD_ARGS, make_inputs

    forks = _count_forks(monkeypatch)
    inputs, reset = make_inputs(2, 700, 1, 8, 128, 64, 32, torch.bfloat16, "cuda", seed=11)
    cot = torch.randn(2, 700, 8, 64, device="cuda").bfloat16()

    def run():
        y, _ = mamba3_scan_triton(**inputs, reset=reset, output_final_state=False)
        return [y, *torch.autograd.grad(y, [inputs[n] for n in GRAD_ARGS], cot)]

    off, on, graphed = _on_and_off(monkeypatch, run)
    assert forks[0] is False and all(forks[1:]) and len(forks) > 1
    for name, a, b, c in zip(("y", *GRAD_ARGS), off, on, graphed):
        assert torch.equal(a, b) and torch.equal(a, c), name
