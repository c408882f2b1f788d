"""The fused linear cross-entropy's float32 weight-gradient accumulator (cuBLAS halves), its
memory bound, its no-grad path and its single-use gradients (GPU), and the halves'
accumulate/finish logic and the CE row kernel under the Triton interpreter (CPU). (The
catalog check against the float64 reference runs in test_ops_triton.py.)"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from megacpp.errors import MegaCppError
from megacpp.kernels.ops.linear_cross_entropy.reference import linear_cross_entropy_reference
from tests.kernels.interpreter import run_interpreter_check

ROOT = Path(__file__).resolve().parents[2]
gpu = pytest.mark.gpu


def _case(tokens, hidden, vocab, dtype, seed):
    g = torch.Generator("cuda").manual_seed(seed)
    h = torch.randn(tokens, hidden, device="cuda", generator=g).to(dtype).requires_grad_()
    w = (torch.randn(vocab, hidden, device="cuda", generator=g) * hidden**-0.5).to(dtype)
    labels = torch.randint(0, vocab, (tokens,), device="cuda", generator=g)
    labels[torch.rand(tokens, device="cuda", generator=g) < 0.1] = -100
    return h, w.requires_grad_(), labels


def _rel(a, b) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_grads_scaled_by_grad_output_match_fp32_reference(dtype):
    from megacpp.kernels.ops.linear_cross_entropy.triton import linear_cross_entropy_triton

    h, w, labels = _case(3000, 256, 10007, dtype, 0)  # ragged vocab / last chunk
    scale = 0.37
    loss = linear_cross_entropy_triton(h, w, labels, chunk_tokens=704)
    dh, dw = torch.autograd.grad(loss * scale, [h, w])
    h32, w32 = h.detach().float().requires_grad_(), w.detach().float().requires_grad_()
    ref = linear_cross_entropy_reference(h32, w32, labels)
    rdh, rdw = torch.autograd.grad(ref * scale, [h32, w32])
    assert dw.dtype == dtype and dw.shape == w.shape and dh.dtype == dtype
    assert abs(loss.item() - ref.item()) / ref.item() < 1e-4
    assert _rel(dh, rdh) < 1e-2 and _rel(dw, rdw) < 1e-2


@gpu
def test_no_grad_path_computes_only_the_loss():
    from megacpp.kernels.ops.linear_cross_entropy.triton import linear_cross_entropy_triton

    h, w, labels = _case(2048, 256, 32000, torch.bfloat16, 2)
    with_grad = linear_cross_entropy_triton(h, w, labels, chunk_tokens=512)
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    with torch.no_grad():
        loss = linear_cross_entropy_triton(h, w, labels, chunk_tokens=512)
    peak = torch.cuda.max_memory_allocated() - base
    assert abs(loss.item() - with_grad.item()) < 1e-6
    assert peak < 512 * 32000 * 2 + 2**20  # one chunk of logits, no gradient buffers


@gpu
def test_backward_twice_is_a_clear_error():
    from megacpp.kernels.ops.linear_cross_entropy.triton import linear_cross_entropy_triton

    h, w, labels = _case(256, 64, 1000, torch.bfloat16, 3)
    loss = linear_cross_entropy_triton(h, w, labels)
    loss.backward(retain_graph=True)
    with pytest.raises(MegaCppError, match="backward ran twice"):
        loss.backward()


@gpu
def test_peak_memory_and_no_host_sync():
    """Peak extra memory over fwd+bwd <= dh + the float32 dW halves + one chunk of logits; the
    halves' finish adds at most a quarter of the float32 dW after the logits are gone (no
    float32 dW + full cast copy); nothing syncs the host."""
    from megacpp.kernels.ops.linear_cross_entropy.triton import linear_cross_entropy_triton

    tokens, hidden, vocab, chunk = 4096, 512, 32768, 512
    h, w, labels = _case(tokens, hidden, vocab, torch.bfloat16, 4)
    linear_cross_entropy_triton(h, w, labels, chunk_tokens=chunk).backward()  # compile
    h.grad = w.grad = None
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    torch.cuda.set_sync_debug_mode("error")
    try:
        dh, dw = torch.autograd.grad(
            linear_cross_entropy_triton(h, w, labels, chunk_tokens=chunk),
            [h, w])
    finally:
        torch.cuda.set_sync_debug_mode("default")
    peak = torch.cuda.max_memory_allocated() - base
    fp32_dw = vocab * hidden * 4
    bound = tokens * hidden * 2 + max(fp32_dw + chunk * vocab * 2, fp32_dw * 5 // 4)
    assert peak <= bound + 2 * 2**20, (peak, bound)
    assert dw.dtype == torch.bfloat16 and torch.isfinite(dw).all() and torch.isfinite(dh).all()


# -- CPU: the Triton interpreter ----------------------------------------------------------------
def _interpreter_check() -> dict:
    """float32 halves accumulated over several chunks == one float32 addmm accumulation; the
    finish scales and casts both halves into one [V, D] tensor and empties the list. Run in a
    fresh process with TRITON_INTERPRET=1 (float32 output: the interpreter's bf16 cast
    truncates instead of rounding)."""
    from megacpp.kernels.ops.linear_cross_entropy import triton as lce

    g = torch.Generator().manual_seed(0)
    errors = {}
    for vocab in (301, 64, 9, 1):
        hidden = 24
        halves = lce._fp32_halves(torch.empty(vocab, hidden))
        want = torch.zeros(vocab, hidden)
        for _ in range(3):
            grad = torch.randn(40, vocab, generator=g).bfloat16()
            h = torch.randn(40, hidden, generator=g).bfloat16()
            lce.accumulate_weight_grad_fp32(halves, grad, h)
            want.addmm_(grad.t().float(), h.float())
        scale = torch.tensor([0.37])
        out = lce.finish_weight_grad_fp32(halves, scale, torch.float32)
        assert out.shape == (vocab, hidden) and not halves and out.is_contiguous()
        errors[vocab] = _rel(out, want * 0.37)
    assert all(e < 1e-6 for e in errors.values()), errors  # NaN fails
    return errors


def test_interpreter_fp32_halves_accumulate_and_finish() -> None:
    run_interpreter_check(__file__, "_interpreter_check")


def _rows_interpreter_check() -> dict:
    """The CE row kernel against torch's log-softmax: loss rows
    and the gradient written in place, with ignored rows, a vocab narrower than the block
    (masked lanes that never see a value) and one several blocks wide with a ragged end.
    float32 logits (the interpreter's bf16 cast truncates)."""
    from megacpp.kernels.ops.linear_cross_entropy import triton as lce

    g = torch.Generator().manual_seed(0)
    errors = {}
    for vocab, block in ((300, 512), (300, 64), (64, 64), (1, 16)):
        logits = torch.randn(7, vocab, generator=g) * 4
        labels = torch.randint(0, vocab, (7,), generator=g)
        labels[2] = -100
        kept = labels != -100
        inv_n = torch.tensor([1.0 / int(kept.sum())])
        logp = torch.log_softmax(logits.double(), dim=-1)
        safe = labels.clamp(min=0)
        want_loss = torch.where(kept, -logp.gather(1, safe[:, None])[:, 0], 0.0)
        want_grad = (logp.exp() - torch.nn.functional.one_hot(safe, vocab)) * inv_n.double()
        want_grad[~kept] = 0.0
        work, loss = logits.clone(), torch.empty(7)
        lce._ce_rows[(3,)](work, labels, loss, inv_n, 7, work.stride(0), -100, n_cols=vocab,
                           BLOCK=block, WRITE_GRAD=True)
        errors[f"V{vocab}_B{block}"] = max(float((loss.double() - want_loss).abs().max()),
                                           float((work.double() - want_grad).abs().max()))
    assert all(e < 1e-5 for e in errors.values()), errors  # (a NaN fails here, not in max)
    return errors


def test_interpreter_ce_rows_match_log_softmax() -> None:
    run_interpreter_check(__file__, "_rows_interpreter_check")
