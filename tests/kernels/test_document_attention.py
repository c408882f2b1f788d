"""Attention inside the documents of packed rows: FlexAttention's block mask made from doc_ids,
the flex backend against the dense-mask reference, and its catalog row."""

from __future__ import annotations

import pytest
import torch
from torch.nn.attention.flex_attention import create_block_mask

from megacpp.kernels.catalog import KernelSelectionError, device_facts, select
from megacpp.kernels.ops.attention.document import (
    document_attention_flex,
    document_attention_reference,
    document_block_mask,
    document_causal_mask,
)
from megacpp.kernels.registry import default_catalog

LAYOUTS = {  # document lengths per row and the rows' length (the test below also reverses them)
    "one_doc": ([[300], [300]], 300),
    "tile_edges": ([[128, 128], [100, 156]], 256),
    "many": ([[5, 120, 3, 256], [384]], 384),
    "short_tail": ([[60, 60, 80], [1, 199]], 200),
}


def _ids(lengths: list[list[int]]) -> torch.Tensor:
    return torch.stack([torch.cat([torch.full((n,), i) for i, n in enumerate(row)])
                        for row in lengths])


def _blocks(mask) -> tuple[list, list]:
    """Per (row, q block): the sets of partial and of full kv blocks."""
    def sets(num, idx):
        return [[set(idx[b, 0, q, : num[b, 0, q]].tolist()) for q in range(num.shape[-1])]
                for b in range(num.shape[0])]
    return (sets(mask.kv_num_blocks, mask.kv_indices),
            sets(mask.full_kv_num_blocks, mask.full_kv_indices))


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_block_mask_is_torchs_for_the_same_mask(layout):
    """The same partial and full tiles as torch's create_block_mask, which evaluates the whole
    mask; also for ids that are not sorted along the row, and for a partial last tile (past
    L the mask here reads the last token's id, as the implementation's does)."""
    lengths, length = LAYOUTS[layout]
    for doc_ids in (_ids(lengths), _ids(lengths).flip(-1)):
        def doc_causal(b, h, q, kv, doc_ids=doc_ids, last=length - 1):
            return (kv <= q) & (doc_ids[b, q.clamp(max=last)] == doc_ids[b, kv.clamp(max=last)])

        ours = document_block_mask(doc_ids)
        torchs = create_block_mask(doc_causal, doc_ids.shape[0], None, length, length,
                                   device="cpu")
        assert _blocks(ours) == _blocks(torchs)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_flex_forward_equals_the_dense_mask(layout):
    """FlexAttention (eager on CPU: torch has no CPU backward for it; the GPU test below checks
    both directions) over the block mask is the masked SDPA, grouped-query heads included."""
    lengths, length = LAYOUTS[layout]
    doc_ids = _ids(lengths)
    gen = torch.Generator().manual_seed(length)
    q = torch.randn(2, 4, length, 32, generator=gen, dtype=torch.float64)
    k, v = (torch.randn(2, 2, length, 32, generator=gen, dtype=torch.float64) for _ in range(2))
    torch.testing.assert_close(document_attention_flex(q, k, v, doc_ids),
                               document_attention_reference(q, k, v, doc_ids),
                               rtol=1e-12, atol=1e-12)


def test_reference_sees_only_its_document_and_the_past():
    doc_ids = _ids([[2, 3]])
    expected = torch.tensor([[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [0, 0, 1, 0, 0],
                             [0, 0, 1, 1, 0], [0, 0, 1, 1, 1]], dtype=torch.bool)
    assert torch.equal(document_causal_mask(doc_ids)[0], expected)
    v = torch.arange(5.0, dtype=torch.float64)[None, None, :, None].expand(1, 1, 5, 2)
    q = k = torch.zeros(1, 1, 5, 2, dtype=torch.float64)
    out = document_attention_reference(q, k, v, doc_ids)[0, 0, :, 0]  # uniform weights
    torch.testing.assert_close(out, torch.tensor([0.0, 0.5, 2.0, 2.5, 3.0], dtype=torch.float64))


def test_catalog_rows():
    """flex is a measured donor row (with the reason it is not selected); the model's masked
    SDPA is the reference; with no chosen backend, selection fails closed everywhere."""
    catalog = default_catalog()
    (flex,) = catalog.of("document_attention", "donor")
    assert flex.name == "flex" and "not selected" in flex.reason
    assert [b.name for b in catalog.of("document_attention", "fallback")] == ["reference"]
    assert catalog.of("document_attention", "chosen") == []
    with pytest.raises(KernelSelectionError, match="document_attention"):
        select(catalog, "document_attention", device_facts(torch.device("cpu")), "bfloat16")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype, tol", [(torch.bfloat16, 1e-2), (torch.float32, 1e-3)])
def test_flex_matches_the_float64_reference_forward_and_backward(dtype, tol):
    """Fresh random inputs at a packed row shape with documents crossing tile edges: output
    and the three gradients within the dtype's tolerance of the float64 reference (relative
    Frobenius error), and finite."""
    gen = torch.Generator(device="cuda").manual_seed(7)
    doc_ids = _ids([[700, 1, 299, 1048], [2048]]).cuda()
    q = torch.randn(2, 6, 2048, 64, device="cuda", generator=gen)
    k, v = (torch.randn(2, 2, 2048, 64, device="cuda", generator=gen) for _ in range(2))
    cot = torch.randn(2, 6, 2048, 64, device="cuda", generator=gen)

    def run(fn, dt):
        leaves = [t.to(dt).requires_grad_() for t in (q, k, v)]
        out = fn(*leaves, doc_ids)
        return [out, *torch.autograd.grad(out, leaves, cot.to(dt))]

    truth = run(document_attention_reference, torch.float64)
    for got, ref in zip(run(document_attention_flex, dtype), truth, strict=True):
        assert torch.isfinite(got).all()
        rel = ((got.double() - ref).norm() / ref.norm()).item()
        assert rel < tol, rel


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_flex_is_captured_in_a_cuda_graph_with_new_documents_per_replay():
    """The block mask is made on the device from doc_ids (no host sync): a CUDA graph captured
    once follows the documents written into its doc_ids buffer before each replay."""
    from megacpp.kernels import timing

    gen = torch.Generator(device="cuda").manual_seed(3)
    q = torch.randn(2, 4, 512, 64, device="cuda", generator=gen, dtype=torch.bfloat16)
    k, v = (torch.randn(2, 2, 512, 64, device="cuda", generator=gen, dtype=torch.bfloat16)
            for _ in range(2))
    doc_ids = _ids([[512], [512]]).cuda()
    graph, out = timing.capture_graph(lambda: document_attention_flex(q, k, v, doc_ids))
    for lengths in ([[100, 412], [512]], [[3, 300, 209], [256, 256]]):
        doc_ids.copy_(_ids(lengths))
        graph.replay()
        torch.testing.assert_close(out, document_attention_flex(q, k, v, doc_ids))
        torch.testing.assert_close(out.float(), document_attention_reference(q, k, v, doc_ids).float(),
                                   rtol=2e-2, atol=2e-2)
