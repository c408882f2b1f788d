"""The short causal conv + SiLU (``short_conv`` surface): our Triton kernels against the
plain-PyTorch reference, forward and backward.

The CPU test runs the kernels through the Triton interpreter (skipped without triton, as in CI);
the GPU tests run them compiled, in float32 and bf16, and through the Gated DeltaNet mixer.
"""

from __future__ import annotations

import pytest
import torch

from megacpp.kernels.ops.short_conv.reference import short_causal_conv, short_conv_reference
from tests.kernels.interpreter import run_interpreter_check


def make_inputs(batch, seqlen, channels, taps, dtype, device, seed, docs=True, pad=0):
    """x as a column slice of a wider tensor (as the mixer's in_proj split gives it), a
    weight, and packed documents (a boundary inside the first token block of row 0)."""
    g = torch.Generator().manual_seed(seed)
    wide = torch.randn(batch, seqlen, channels + pad, generator=g).to(dtype)
    x = wide.to(device)[..., :channels].requires_grad_()
    weight = (torch.randn(channels, taps, generator=g) / taps**0.5).to(device).requires_grad_()
    doc_ids = None
    if docs:
        starts = torch.rand(batch, seqlen, generator=g) < 0.05
        starts[0, 3] = True
        doc_ids = starts.cumsum(1).to(device)
    return x, weight, doc_ids


def rel(actual: torch.Tensor, expected: torch.Tensor) -> float:
    actual, expected = actual.detach().double().cpu(), expected.detach().double().cpu()
    if not torch.isfinite(actual).all():
        return float("nan")
    return float((actual - expected).norm() / expected.norm().clamp_min(1e-30))


def compare(conv, x, weight, doc_ids, tol) -> dict[str, float]:
    """y, dx and dweight of ``conv`` against the float64 reference (one random cotangent)."""
    ours = [t.detach().clone().requires_grad_() for t in (x, weight)]
    ref = [t.detach().double().requires_grad_() for t in (x, weight)]
    y = conv(ours[0], ours[1], doc_ids)
    y_ref = short_conv_reference(ref[0], ref[1], doc_ids)
    assert y.dtype == x.dtype and y.shape == x.shape
    cot = torch.randn(y.shape, dtype=torch.float64, device=y.device)
    grads = torch.autograd.grad(y, ours, cot.to(y.dtype))
    grads_ref = torch.autograd.grad(y_ref, ref, cot)
    errors = {"y": rel(y, y_ref), "dx": rel(grads[0], grads_ref[0]),
              "dweight": rel(grads[1], grads_ref[1])}
    assert grads[0].dtype == x.dtype and grads[1].dtype == weight.dtype
    bad = {k: v for k, v in errors.items() if not v <= tol}  # NaN never passes
    assert not bad, f"errors over {tol}: {bad}\nall: {errors}"
    return errors


def test_reference_packs_documents_as_if_each_ran_alone() -> None:
    """The surface's reference on a packed row equals the conv of each document from zeros
    (the contract the kernels are checked against), in float64."""
    x, weight, _ = make_inputs(1, 40, 6, 4, torch.float64, "cpu", seed=0, docs=False)
    doc_ids = torch.tensor([[0] * 3 + [1] * 20 + [2] * 17])
    y = short_conv_reference(x, weight, doc_ids)
    for start, end in ((0, 3), (3, 23), (23, 40)):
        alone = short_causal_conv(x[:, start:end], weight, None, None)[0]
        torch.testing.assert_close(y[:, start:end], alone, rtol=0, atol=0)


def test_refuses_tensors_past_32_bit_offsets() -> None:
    pytest.importorskip("triton")
    from megacpp.errors import MegaCppError
    from megacpp.kernels.ops.short_conv.triton import short_conv_triton

    big = torch.zeros(4).expand(2**29 + 1, 1, 4)  # 2**31 + 4 elements, no memory behind them
    with pytest.raises(MegaCppError, match=r"2\*\*31"):
        short_conv_triton(big, torch.zeros(4, 4))


# -- CPU: the Triton interpreter ---------------------------------------------------------------
def _interpreter_check() -> list[dict[str, float]]:
    from megacpp.kernels.ops.short_conv import triton as K

    # ragged token and channel blocks (45 tokens of 32, 150 channels of 128), a column slice
    # of a wider tensor, documents; then no documents, 3 taps (padded to 4 in the weight pass)
    errors = [compare(K.short_conv_triton, *make_inputs(2, 45, 150, 4, torch.float32, "cpu", 1,
                                                        pad=7), tol=1e-5)]
    errors.append(compare(K.short_conv_triton, *make_inputs(1, 33, 20, 3, torch.float32, "cpu",
                                                            2, docs=False), tol=1e-5))
    return errors


def test_interpreter_matches_reference() -> None:
    run_interpreter_check(__file__, "_interpreter_check")


# -- GPU ---------------------------------------------------------------------------------------
def _gpu_conv():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    from megacpp.kernels.ops.short_conv.triton import short_conv_triton

    return short_conv_triton


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("docs", [False, True])
def test_gpu_matches_reference(dtype, docs) -> None:
    # the nam56r R block's shape: 1024 channels of a 1544-wide in_proj output, 4 taps
    x, weight, doc_ids = make_inputs(2, 2048, 1024, 4, dtype, "cuda", seed=3, docs=docs,
                                     pad=520)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    print(compare(_gpu_conv(), x, weight, doc_ids, tol))


@pytest.mark.gpu
def test_gpu_refuses_what_it_does_not_support() -> None:
    from megacpp.errors import MegaCppError

    conv = _gpu_conv()
    x, weight, _ = make_inputs(1, 8, 4, 4, torch.float32, "cuda", seed=4, docs=False)
    with pytest.raises(MegaCppError, match="unit channel stride"):
        conv(x.transpose(1, 2), weight)
    with pytest.raises(MegaCppError, match="W <= 8"):
        conv(x, torch.zeros(4, 9, device="cuda"))
    with pytest.raises(MegaCppError, match="doc_ids"):
        conv(x, weight, torch.zeros(1, 7, dtype=torch.long, device="cuda"))
