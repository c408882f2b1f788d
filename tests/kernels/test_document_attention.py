"""Attention inside the documents of packed rows: FlexAttention's block mask made from doc_ids,
the flex backend against the dense-mask reference, and its catalog row."""

from __future__ import annotations

import pytest
import torch
from torch.nn.attention.flex_attention import create_block_mask

from megacpp.kernels.catalog import KernelSelectionError, device_facts, select
from megacpp.kernels.ops.document_attention.configs import FLEX_OPTIONS
from megacpp.kernels.ops.document_attention.flex import (
    BLOCK,
    document_attention_flex,
    document_block_mask,
    document_block_tiles,
    flex_kernel_options,
)
from megacpp.kernels.ops.document_attention.reference import (
    document_attention_reference,
    document_causal_mask,
)
from megacpp.kernels.registry import default_catalog

LAYOUTS = {  # document lengths per row and the rows' length (the test below also reverses them)
    "one_doc": ([[300], [300]], 300),
    "tile_edges": ([[128, 128], [100, 156]], 256),
    "many": ([[5, 120, 3, 256], [384]], 384),
    "short_tail": ([[60, 60, 80], [1, 199]], 200),
}


MASK_FIELDS = ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices",
               "q_num_blocks", "q_indices", "full_q_num_blocks", "full_q_indices")


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
        for field in MASK_FIELDS:  # and the same tensors: torch's order of the kv blocks too
            assert torch.equal(getattr(ours, field), getattr(torchs, field)), field


def test_block_tiles_operator_passes_opcheck_and_compiles_to_the_eager_mask():
    """document_block_tiles is a registered operator (its fake's shapes and dtypes are the real
    ones: torch.library.opcheck), and a compiled function that makes the mask returns the
    eager tensors."""
    doc_ids = _ids([[700, 1, 299, 1048], [2048]])
    torch.library.opcheck(document_block_tiles, (doc_ids,))
    torch.library.opcheck(document_block_tiles, (_ids([[60, 60, 80], [1, 199]]),))

    def fields(d):
        mask = document_block_mask(d)
        return tuple(getattr(mask, f) for f in MASK_FIELDS)

    for name, eager, traced in zip(MASK_FIELDS, fields(doc_ids), torch.compile(fields)(doc_ids),
                                   strict=True):
        assert torch.equal(eager, traced), name


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


def test_flex_kernel_options_only_for_hopper_half_precision_at_head_dim_64():
    """No launch settings off the GPU, in float32 or at another head dim (Inductor's own
    choice); the H100 settings are tiles FlexAttention accepts with the mask's 128-token
    blocks (powers of two dividing them), for both directions, and name only known knobs."""
    for dtype, dim in ((torch.bfloat16, 64), (torch.float32, 64), (torch.bfloat16, 128)):
        assert flex_kernel_options(torch.zeros(1, 1, 8, dim, dtype=dtype)) is None
    assert [(e.capability, e.head_dim) for e in FLEX_OPTIONS] == [((9, 0), 64)]
    for entry in FLEX_OPTIONS:
        options = entry.as_dict()
        assert len(options) == len(entry.options)  # no knob twice
        tiles = {k: v for k, v in options.items() if "BLOCK" in k}
        assert set(tiles) == {"fwd_BLOCK_M", "fwd_BLOCK_N", "bwd_BLOCK_M1", "bwd_BLOCK_N1",
                              "bwd_BLOCK_N2", "bwd_BLOCK_M2"}
        for name, size in tiles.items():
            assert size & (size - 1) == 0 and BLOCK % size == 0, name
        # the backward pairs its two loops' tiles (N1 with M1, N2 with M2) as Inductor's do
        assert options["bwd_BLOCK_N1"] % options["bwd_BLOCK_M1"] == 0
        assert options["bwd_BLOCK_M2"] % options["bwd_BLOCK_N2"] == 0
        assert {k.split("_", 1)[1] for k in options} <= {
            "BLOCK_M", "BLOCK_N", "BLOCK_M1", "BLOCK_N1", "BLOCK_M2", "BLOCK_N2", "num_stages",
            "num_warps"}


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
    """flex is chosen (sm80+ CUDA); the model's masked SDPA is the reference; on CPU nothing
    chosen qualifies, so selection fails closed naming flex's rejection unless the reference is
    allowed."""
    catalog = default_catalog()
    assert [b.name for b in catalog.of("document_attention", "chosen")] == ["flex"]
    assert [b.name for b in catalog.of("document_attention", "fallback")] == ["reference"]
    cpu = device_facts(torch.device("cpu"))
    with pytest.raises(KernelSelectionError, match="flex"):
        select(catalog, "document_attention", cpu, "bfloat16")
    assert select(catalog, "document_attention", cpu, "bfloat16",
                  allow_reference=True).backend.name == "reference"


def _packed_case(seed: int) -> tuple[torch.Tensor, ...]:
    """On the GPU: doc_ids of two packed rows (documents crossing tile edges; one whole-row
    document), fresh random q [2, 6, 2048, 64], k, v [2, 2, 2048, 64] and an output cotangent."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    doc_ids = _ids([[700, 1, 299, 1048], [2048]]).cuda()
    q = torch.randn(2, 6, 2048, 64, device="cuda", generator=gen)
    k, v = (torch.randn(2, 2, 2048, 64, device="cuda", generator=gen) for _ in range(2))
    return doc_ids, q, k, v, torch.randn(2, 6, 2048, 64, device="cuda", generator=gen)


def _fwd_bwd(fn, dtype, case) -> list[torch.Tensor]:
    """[out, dq, dk, dv] of ``fn`` in ``dtype`` on ``case``."""
    doc_ids, q, k, v, cot = case
    leaves = [t.to(dtype).requires_grad_() for t in (q, k, v)]
    out = fn(*leaves, doc_ids)
    return [out, *torch.autograd.grad(out, leaves, cot.to(dtype))]


def _rel(got: torch.Tensor, ref: torch.Tensor) -> float:
    """Relative Frobenius error against a float64 reference."""
    return ((got.double() - ref).norm() / ref.norm()).item()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype, tol", [(torch.bfloat16, 1e-2), (torch.float32, 1e-3)])
def test_flex_matches_the_float64_reference_forward_and_backward(dtype, tol):
    """Fresh random inputs at a packed row shape with documents crossing tile edges: output
    and the three gradients within the dtype's tolerance of the float64 reference (relative
    Frobenius error), and finite."""
    case = _packed_case(seed=7)
    truth = _fwd_bwd(document_attention_reference, torch.float64, case)
    for got, ref in zip(_fwd_bwd(document_attention_flex, dtype, case), truth, strict=True):
        assert torch.isfinite(got).all()
        assert _rel(got, ref) < tol, _rel(got, ref)


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


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_flex_with_the_mask_made_inside_a_compiled_function():
    """As the model's compiled blocks run it: torch.compile traces the mask's construction
    with the attention. Output and gradients within bf16 tolerance of the float64 reference,
    and the no-grad forward too (a mask traced op by op came out wrong, or crashed a trainer's
    no-grad forward)."""
    @torch.compile
    def traced_attention(q, k, v, d):  # the launch settings of flex_kernel_options included
        return document_attention_flex(q, k, v, d)

    case = _packed_case(seed=11)
    truth = _fwd_bwd(document_attention_reference, torch.float64, case)
    for got, ref in zip(_fwd_bwd(traced_attention, torch.bfloat16, case), truth, strict=True):
        assert _rel(got, ref) < 1e-2
    doc_ids, q, k, v, _ = case
    with torch.no_grad():
        out = traced_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), doc_ids)
    for b in range(2):  # row by row: a row reading another row's tiles shows here
        assert _rel(out[b], truth[0][b]) < 1e-2, b


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available()
                    or torch.cuda.get_device_capability() != (9, 0), reason="needs an sm90 GPU")
def test_hopper_launch_settings_compute_what_the_defaults_do():
    """On an H100 the settings of flex_kernel_options are in force for bf16 at head dim 64, and
    give Inductor's defaults' output and gradients bit for bit on fresh random inputs: both walk
    each query's keys in 128-column steps forward, and 64-row / 64-column blocks backward, in
    one order (the tiles only change how many rows or columns a program owns)."""
    from torch.nn.attention.flex_attention import flex_attention

    case = _packed_case(seed=13)
    assert flex_kernel_options(case[1].bfloat16()) == FLEX_OPTIONS[0].as_dict()
    compiled = torch.compile(flex_attention, dynamic=False)

    def defaults(q, k, v, d):
        return compiled(q, k, v, block_mask=document_block_mask(d), enable_gqa=True)

    ours = _fwd_bwd(document_attention_flex, torch.bfloat16, case)
    base = _fwd_bwd(defaults, torch.bfloat16, case)
    for name, got, ref in zip(("out", "dq", "dk", "dv"), ours, base, strict=True):
        assert torch.isfinite(got).all(), name
        assert torch.equal(got, ref), (name, _rel(got, ref.double()))


def _block_settings(codes: list[str]) -> set[tuple[str, int]]:
    """The (BLOCK_*, size) constants of the Triton templates in Inductor's output code."""
    import re

    return {(m[1], int(m[2])) for code in codes
            for m in re.finditer(r"\b(BLOCK_[MN]\d?) : tl\.constexpr = (\d+)", code)}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available()
                    or torch.cuda.get_device_capability() != (9, 0), reason="needs an sm90 GPU")
def test_hopper_launch_settings_reach_the_generated_kernels():
    """The settings are in force: the forward and backward kernels Inductor generates for the
    flex row carry the 64-row tiles, where a compile with no options carries its defaults'
    128-row forward and 128-column backward tiles."""
    from torch._inductor import config
    from torch._inductor.utils import run_and_get_code
    from torch.nn.attention.flex_attention import flex_attention

    case = _packed_case(seed=17)
    compiled = torch.compile(flex_attention, dynamic=False)

    def defaults(q, k, v, d):
        return compiled(q, k, v, block_mask=document_block_mask(d), enable_gqa=True)

    with config.patch(fx_graph_cache=False):
        _, ours = run_and_get_code(_fwd_bwd, document_attention_flex, torch.bfloat16, case)
        _, base = run_and_get_code(_fwd_bwd, defaults, torch.bfloat16, case)
    ours, base = _block_settings(ours), _block_settings(base)
    assert {("BLOCK_M", 64), ("BLOCK_N1", 64), ("BLOCK_M2", 64)} <= ours, ours
    assert ("BLOCK_M", 128) not in ours and ("BLOCK_N1", 128) not in ours, ours
    assert {("BLOCK_M", 128), ("BLOCK_N1", 128)} <= base, base


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_triton_tiles_equal_the_torch_code():
    """The one-launch Triton tiles (what document_block_tiles runs on CUDA) are the torch
    code's eight tensors bit for bit: packed rows of random document lengths (sorted ids),
    shuffled ids, one document, a partial last tile, int32 ids, and rows of 1 to 64 tiles;
    past 64 tiles the torch code serves."""
    from megacpp.kernels.ops.document_attention import triton as kernels
    from megacpp.kernels.ops.document_attention.flex import document_block_tiles_torch

    gen = torch.Generator().manual_seed(21)
    cases = []
    for length in (1, 100, 128, 300, 2048, 2049, 4096, 8192):
        for batch in (1, 3):
            cuts = torch.rand(batch, length, generator=gen) < 0.01
            cases.append(cuts.long().cumsum(-1))  # packed rows, sorted ids
            cases.append(torch.randint(0, 3, (batch, length), generator=gen))  # unsorted
        cases.append(torch.zeros(2, length, dtype=torch.int64))  # one document
    cases.append(cases[-3].int())
    for doc_ids in cases:
        ids = doc_ids.cuda()
        assert kernels.tiles_triton_ok(ids)
        got = kernels.document_block_tiles_triton(ids)
        want = document_block_tiles_torch(ids)
        assert len(got) == len(want) == 8
        for name, a, b in zip(MASK_FIELDS, got, want, strict=True):
            assert a.dtype == b.dtype == torch.int32 and a.is_contiguous(), name
            assert torch.equal(a, b), (name, tuple(doc_ids.shape))
        assert all(torch.equal(a, b) for a, b in zip(document_block_tiles(ids), want,
                                                     strict=True))
    assert not kernels.tiles_triton_ok(torch.zeros(1, 8193, dtype=torch.int64, device="cuda"))
    assert not kernels.tiles_triton_ok(torch.zeros(1, 64, dtype=torch.int64))  # CPU
