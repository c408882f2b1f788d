from __future__ import annotations

import pytest
import torch

from megacpp.kernels.catalog import KernelSelectionError
from megacpp.kernels.ops.document_attention.reference import document_causal_mask
from megacpp.kernels.runtime import chosen_kernels, clear_resolutions, kernel_mode_override
from megacpp.model.attention import GroupedQueryAttention
from tests.model.conftest import paged_decode


def _attn(qk_norm=True):
    torch.manual_seed(0)
    return GroupedQueryAttention(
        d_model=32, n_heads=4, n_kv_heads=2, head_dim=8, qk_norm=qk_norm
    ).double()


def test_document_mask_blocks_cross_document_attention():
    doc = torch.tensor([[0, 0, 1, 1, 1, 2]])
    m = document_causal_mask(doc)[0]
    assert m[1, 0] and not m[2, 1] and m[4, 2] and not m[5, 4] and not m[0, 1]


def test_packed_row_equals_documents_alone():
    attn = _attn()
    x = torch.randn(1, 12, 32, dtype=torch.float64)
    doc = torch.tensor([[0] * 5 + [1] * 4 + [2] * 3])
    packed = attn(x, doc_ids=doc)
    # RoPE is relative, so a document's outputs do not depend on where it sits in the row
    for lo, hi in [(0, 5), (5, 9), (9, 12)]:
        torch.testing.assert_close(packed[:, lo:hi], attn(x[:, lo:hi]), rtol=1e-10, atol=1e-10)


def test_packed_rows_go_through_the_document_attention_surface():
    """With doc_ids the attention asks the catalog: the reference here (the default mode; under
    auto on CPU too); under fast on CPU it fails closed, naming flex (CUDA only)."""
    attn = _attn()
    x = torch.randn(1, 12, 32, dtype=torch.float64)
    doc = torch.tensor([[0] * 5 + [1] * 7])
    for mode in ("reference", "auto"):
        clear_resolutions()
        with kernel_mode_override(mode):
            attn(x, doc_ids=doc)
        assert chosen_kernels()["document_attention"] == "reference", mode
    clear_resolutions()
    with kernel_mode_override("fast"), pytest.raises(KernelSelectionError, match="flex"):
        _attn(qk_norm=False)(x, doc_ids=doc)  # (QK-norm's RMSNorm would fail closed first)
    clear_resolutions()


def test_paged_prefill_and_steps_equal_full_forward():
    attn = _attn()
    x = torch.randn(2, 9, 32, dtype=torch.float64)
    out, pool = paged_decode(attn, x, prompt=5)
    torch.testing.assert_close(out, attn(x), rtol=1e-10, atol=1e-10)
    assert set(pool.tensors) == {"k", "v"} and pool.tensors["k"].shape == (6, 4, 2, 8)


def test_compiled_attention_reads_rope_tables_it_does_not_recompute():
    """Under torch.compile the RoPE tables are graph constants (rope_range): the generated
    code has no cos/sin (Inductor used to recompute them per batch row and head), for the
    first length and for the dynamic-shape recompile a second length triggers."""
    import re

    from torch._inductor.utils import run_and_get_code

    torch._dynamo.reset()
    torch.manual_seed(0)
    attn = GroupedQueryAttention(d_model=32, n_heads=4, n_kv_heads=2, head_dim=8, qk_norm=True)
    compiled = torch.compile(attn)
    for length in (12, 20):
        x = torch.randn(2, length, 32)
        out, codes = run_and_get_code(compiled, x)
        torch.testing.assert_close(out, attn(x), rtol=1e-5, atol=1e-5)
        trig = [line for code in codes for line in code.splitlines()
                if re.search(r"\b(cos|sin)\b", line)]
        assert not trig, trig[:3]


def test_qk_norm_with_rope_equals_norm_then_rotation():
    """The QK-norm rotates inside the norm op (one op, one kernel each way when fused): the
    same values as RMSNorm followed by apply_rope, on a head-transposed view, in float64."""
    import pytest

    from megacpp.kernels.ops.rmsnorm.reference import rmsnorm_reference
    from megacpp.model.rope import apply_rope, rope_range

    attn = _attn()
    with torch.no_grad():
        attn.q_norm.weight.uniform_(0.5, 1.5)
    q = torch.randn(2, 7, 4 * 8, dtype=torch.float64).view(2, 7, 4, 8).transpose(1, 2)
    cos, sin = rope_range(3, 7, 8, 10000.0, torch.float64, q.device)
    want = apply_rope(attn.q_norm(q), cos, sin)
    torch.testing.assert_close(attn.q_norm(q, rope=(cos, sin)), want, rtol=1e-12, atol=1e-12)
    y, _ = rmsnorm_reference(q, attn.q_norm.weight, eps=attn.q_norm.eps, rope=(cos, sin))
    torch.testing.assert_close(y, want, rtol=1e-12, atol=1e-12)
    with pytest.raises(ValueError, match="must be \\[7, 4\\]"):  # tables of another length
        attn.q_norm(q, rope=(cos[:6], sin[:6]))
    with pytest.raises(ValueError, match="QK-norm"):
        rmsnorm_reference(q, attn.q_norm.weight, residual=q, rope=(cos, sin))


def test_kv_projection_reads_the_second_copy_of_the_input():
    """With ``again`` (the pre-norm block's second copy of the normed input, INPUT_FANOUT 2)
    q_proj reads x and kv_proj reads ``again``: the same output as from x alone, and the two
    copies' gradients add up to x's gradient alone (the norm's backward sums them)."""
    attn = _attn()
    assert GroupedQueryAttention.INPUT_FANOUT == 2
    x = torch.randn(2, 9, 32, dtype=torch.float64, requires_grad=True)
    again = x.detach().clone().requires_grad_()
    doc = torch.tensor([[0] * 4 + [1] * 5, [0] * 9])
    cot = torch.randn(2, 9, 32, dtype=torch.float64)
    out = attn(x, doc_ids=doc, again=(again,))
    (dx,) = torch.autograd.grad(out, [x], cot, retain_graph=True)
    (d_again,) = torch.autograd.grad(out, [again], cot)
    ref = x.detach().clone().requires_grad_()
    want = attn(ref, doc_ids=doc)
    (d_ref,) = torch.autograd.grad(want, [ref], cot)
    torch.testing.assert_close(out, want, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(dx + d_again, d_ref, rtol=1e-10, atol=1e-12)
    # each copy feeds one projection, so neither carries the whole gradient
    assert not torch.allclose(dx, d_ref) and not torch.allclose(d_again, d_ref)
