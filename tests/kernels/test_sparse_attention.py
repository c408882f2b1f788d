"""DSA's latent attention over selected keys (``sparse_attention`` surface): our Triton kernel
against the plain-PyTorch reference, forward and backward, on fresh random inputs.

The CPU test runs the kernels through the Triton interpreter (skipped without triton); the GPU
tests run them compiled, in float32 and bf16, and through the DSA layer."""

from __future__ import annotations

import pytest
import torch

from megacpp.kernels.ops.sparse_attention.reference import sparse_latent_attention
from megacpp.kernels.ops.sparse_attention.spec import random_selection
from tests.kernels.interpreter import run_interpreter_check


def make_inputs(batch, queries, keys, heads, rank, rope, top_k, dtype, device, seed):
    """Queries at the last ``queries`` positions of ``keys`` keys (a decode-like chunk when
    queries < keys), a causal random selection, q_latent as a non-contiguous slice."""
    g = torch.Generator().manual_seed(seed)
    idx, valid = random_selection(batch, keys, top_k, "cpu", g)
    idx, valid = idx[:, keys - queries:], valid[:, keys - queries:]
    wide = torch.randn(batch, queries, heads, rank + 3, generator=g) * rank**-0.25
    tensors = [wide[..., :rank],
               torch.randn(batch, queries, heads, rope, generator=g) * rope**-0.25,
               torch.randn(batch, keys, rank, generator=g),
               torch.randn(batch, keys, rope, generator=g)]
    tensors = [t.to(device=device, dtype=dtype).requires_grad_() for t in tensors]
    return (*tensors, idx.to(device), valid.to(device), (rank + rope) ** -0.5)


def rel(actual: torch.Tensor, expected: torch.Tensor) -> float:
    actual, expected = actual.detach().double().cpu(), expected.detach().double().cpu()
    if not torch.isfinite(actual).all():
        return float("nan")
    return float((actual - expected).norm() / expected.norm().clamp_min(1e-30))


def compare(fn, inputs, tol: float, with_probs: bool = True) -> dict[str, float]:
    """o, the head-mean probs and the four input gradients of ``fn`` against the float64
    reference (one random cotangent)."""
    *tensors, idx, valid, scale = inputs
    ours = [t.detach().clone().requires_grad_() for t in tensors]
    ref = [t.detach().double().requires_grad_() for t in tensors]
    o, probs = fn(*ours, idx, valid, scale, with_probs)
    o_ref, probs_ref = sparse_latent_attention(*ref, idx, valid, scale, with_probs)
    assert o.dtype == tensors[0].dtype and o.shape == o_ref.shape
    cot = torch.randn(o.shape, dtype=torch.float64, device=o.device)
    grads = torch.autograd.grad(o, ours, cot.to(o.dtype))
    grads_ref = torch.autograd.grad(o_ref, ref, cot)
    errors = {"o": rel(o, o_ref)}
    if with_probs:
        assert probs.dtype == torch.float32 and not probs.requires_grad
        errors["probs"] = rel(probs, probs_ref)
    else:
        assert probs is None
    for name, g, r in zip(("dq_latent", "dq_rope", "dlatent", "dk_rope"), grads, grads_ref):
        assert g.dtype == tensors[0].dtype
        errors[name] = rel(g, r)
    bad = {k: v for k, v in errors.items() if not v <= tol}  # NaN never passes
    assert not bad, f"errors over {tol}: {bad}\nall: {errors}"
    return errors


def layer_through(attend, dtype: torch.dtype, device: str = "cpu") -> tuple[torch.Tensor, ...]:
    """A DSA layer's training forward and backward (packed documents, 3 chunks, top-k 4 of
    up to 12 keys) with its ``sparse_attention`` call routed to ``attend`` as a chosen
    backend, i.e. the whole row in one call -> (output, KL, input gradient, attention and
    indexer parameter gradients)."""
    from megacpp.kernels.catalog import Backend, Requirements
    from megacpp.model import dsa as dsa_module
    from tests.model.test_dsa import DOCS, _dsa, _x

    layer = _dsa(top_k=4).to(device=device, dtype=dtype).train()
    x = _x(1, 15).to(device=device, dtype=dtype).requires_grad_()
    resolve = dsa_module.resolve
    if attend is not None:
        backend = Backend("under_test", "sparse_attention", "chosen", Requirements(), attend)
        dsa_module.resolve = lambda surface, like: backend
    try:
        out = layer(x, doc_ids=DOCS.to(device))
    finally:
        dsa_module.resolve = resolve
    (out.square().sum() + layer.aux_loss).backward()
    grads = [p.grad for p in layer.parameters()]
    return (out, layer.aux_loss, x.grad, *grads)


def compare_layer(attend, dtype: torch.dtype, tol: float, device: str = "cpu") -> float:
    """``layer_through(attend)`` against the layer's chunk-by-chunk reference path (the same
    selection: only the attention over it differs)."""
    ours, ref = layer_through(attend, dtype, device), layer_through(None, dtype, device)
    worst = max(rel(a, b) for a, b in zip(ours, ref, strict=True))
    assert worst <= tol, worst
    return worst


def test_dsa_layer_whole_row_path_equals_chunk_by_chunk() -> None:
    """The layer's one-call path (a fast backend) with the reference as that backend equals
    its chunk-by-chunk path: same output, KL and gradients (float64)."""
    compare_layer(sparse_latent_attention, torch.float64, 1e-12)


def interpreter_check() -> dict:
    """Tiny shapes under TRITON_INTERPRET=1: a whole row (early queries with invalid slots, k
    over two key blocks, H and r not powers of two), a decode-like chunk, and no probs."""
    from megacpp.kernels.ops.sparse_attention.configs import SparseAttentionConfig
    from megacpp.kernels.ops.sparse_attention.triton import sparse_latent_attention_triton

    def fn(*args):
        return sparse_latent_attention_triton(*args, config=SparseAttentionConfig(16, 4))

    row = make_inputs(2, 30, 30, 3, 24, 16, 20, torch.float32, "cpu", seed=0)
    chunk = make_inputs(1, 3, 37, 4, 32, 8, 8, torch.float32, "cpu", seed=1)
    return {"row": compare(fn, row, 1e-5), "chunk": compare(fn, chunk, 1e-5),
            "no_probs": compare(fn, row, 1e-5, with_probs=False),
            "dsa_layer": compare_layer(fn, torch.float32, 1e-5)}


def test_triton_kernels_match_the_reference_under_the_interpreter() -> None:
    run_interpreter_check(__file__, "interpreter_check")


def test_reference_equals_masked_dense_attention() -> None:
    """The surface's reference over the selection equals latent attention over every key with
    the unselected ones masked (float64): the truth the kernels are checked against."""
    from megacpp.kernels.ops.sparse_attention.reference import latent_attention

    ql, qr, lat, kr, idx, valid, scale = make_inputs(2, 9, 9, 3, 8, 4, 5, torch.float64, "cpu", 2)
    keep = torch.zeros(2, 9, 9, dtype=torch.bool).scatter(-1, idx, valid)
    o, probs = sparse_latent_attention(ql, qr, lat, kr, idx, valid, scale, True)
    dense, dense_probs = latent_attention(ql, qr, lat[:, None], kr[:, None], keep, scale)
    torch.testing.assert_close(o, dense, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(probs, dense_probs.mean(2).gather(-1, idx), rtol=1e-12, atol=1e-12)


# -- GPU: compiled kernels ---------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize(("dtype", "tol"), [(torch.float32, 1e-5), (torch.bfloat16, 1.5e-2)])
def test_triton_matches_reference_on_gpu(dtype, tol) -> None:
    from megacpp.kernels.ops.sparse_attention.triton import sparse_latent_attention_triton

    # nam56r-cut13's DSA widths (8 heads, r 128, dr 32), k 96 over 300 keys
    compare(sparse_latent_attention_triton,
            make_inputs(2, 300, 300, 8, 128, 32, 96, dtype, "cuda", seed=3), tol)
    compare(sparse_latent_attention_triton,
            make_inputs(3, 5, 700, 8, 128, 32, 64, dtype, "cuda", seed=4), tol)


@pytest.mark.gpu
@pytest.mark.parametrize(("dtype", "tol"), [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)])
def test_dsa_layer_through_the_kernel_matches_the_reference_path(dtype, tol) -> None:
    """The DSA layer's training forward and backward with its attention over the selected
    keys on the compiled kernel (the whole row in one call) against its reference path."""
    from megacpp.kernels.ops.sparse_attention.triton import sparse_latent_attention_triton

    compare_layer(sparse_latent_attention_triton, dtype, tol, "cuda")
