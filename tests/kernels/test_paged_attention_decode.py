"""Paged decode attention (``paged_attention_decode``) against its reference, and the reference
against the attention layer's own paged path.

CPU: the reference equals the gather + mask + ``grouped_attention`` math of
``GroupedQueryAttention.forward_paged`` (float64), the layer's decode step through the hook
equals its gather path, a compiled decode step never asks the catalog, bad shapes name the
tensor. Interpreter: the Triton kernel equals the reference in float32 (tight) and bf16 (no
further from the float64 reference than the bf16 reference is) over GQA ratios 1, 4 and 6,
head_dim 64 and 48, rows at different lengths with blocks scattered in the pool, padding rows
on a scratch block, a bucket's slice of a wider block table, one split and several; the tiny
model's greedy decode with the kernel routed in. GPU: bf16 at nam56r-350m's shapes (B 1 and
64) and the kernel replayed from a CUDA graph.
"""

from __future__ import annotations

import pytest
import torch

from megacpp.kernels.ops.paged_attention_decode.reference import (
    paged_attention_decode_reference,
)
from megacpp.kernels.ops.paged_attention_decode.spec import SURFACE
from megacpp.model.attention import GroupedQueryAttention, grouped_attention
from megacpp.model.cache import PagedBatch, PagedPool, PagedView, paged_pool
from tests.kernels.interpreter import run_interpreter_check

# name -> (batch, heads, kv_heads, head_dim, page, context, spread)
SHAPES = {
    "check": (5, 8, 2, 64, 16, 100, 80),  # GQA 4
    "mha_hd48": (4, 3, 3, 48, 16, 70, 60),  # GQA 1, head_dim not a power of two
    "nam56r-350m": (3, 12, 2, 64, 16, 120, 100),  # GQA 6
    "page4": (3, 4, 1, 32, 4, 37, 30),  # small pages: a key tile spans several blocks
}


def make_inputs(shape: str, dtype: torch.dtype, device="cpu", seed=0, padding: int = 0,
                extra_width: int = 0) -> dict:
    """The surface's inputs at ``shape``, plus ``padding`` rows at position 0 whose whole table
    is the scratch block, and the block table as a slice of one ``extra_width`` blocks wider
    (the decode graphs' static buffer)."""
    batch, heads, kv_heads, head_dim, page, context, spread = SHAPES[shape]
    case = {"batch": batch, "heads": heads, "kv_heads": kv_heads, "head_dim": head_dim,
            "page": page, "context": context, "spread": spread}
    gen = torch.Generator(device=device).manual_seed(seed)
    inputs = SURFACE.make_inputs(case, dtype, device, gen)
    scratch = inputs["k_pool"].shape[0] - 1
    tables, positions = inputs["block_tables"], inputs["positions"]
    if padding:
        q_pad = torch.randn(padding, heads, head_dim, generator=gen, device=device).to(dtype)
        inputs["q"] = torch.cat([inputs["q"], q_pad])
        tables = torch.cat([tables, torch.full((padding, tables.shape[1]), scratch,
                                               dtype=tables.dtype, device=device)])
        positions = torch.cat([positions, positions.new_zeros(padding)])
    wide = torch.full((tables.shape[0], tables.shape[1] + extra_width), scratch,
                      dtype=tables.dtype, device=device)
    wide[:, : tables.shape[1]] = tables
    inputs["block_tables"] = wide[:, : tables.shape[1]]
    inputs["positions"] = positions
    return inputs


def rel(actual: torch.Tensor, expected: torch.Tensor) -> float:
    actual, expected = actual.detach().double().cpu(), expected.detach().double().cpu()
    if not torch.isfinite(actual).all():
        return float("nan")
    return float((actual - expected).norm() / expected.norm().clamp_min(1e-30))


def as_float64(inputs: dict) -> dict:
    return {n: t.double() if t.is_floating_point() else t for n, t in inputs.items()}


# --- CPU: the reference is the layer's paged path ---------------------------------------------

def _layer_batch(positions: torch.Tensor, tables: torch.Tensor, page: int) -> PagedBatch:
    """A one-token-per-row batch writing row b's token at its position through its table."""
    rows = torch.arange(len(positions))
    slot_mapping = tables[rows, positions // page] * page + positions % page
    return PagedBatch(positions=positions[:, None], slot_mapping=slot_mapping,
                      block_tables=tables, state_slots=rows)


@pytest.mark.parametrize("shape", ["check", "mha_hd48", "nam56r-350m"])
def test_reference_is_the_gather_mask_grouped_attention_math(shape):
    """The reference == PagedPool.read + PagedBatch.allowed_keys + grouped_attention at L == 1
    (float64, padding rows included)."""
    inputs = as_float64(make_inputs(shape, torch.float64, padding=2))
    pool = PagedPool({"k": inputs["k_pool"], "v": inputs["v_pool"]})
    batch = PagedBatch(positions=inputs["positions"][:, None], slot_mapping=inputs["positions"],
                       block_tables=inputs["block_tables"],
                       state_slots=torch.arange(len(inputs["positions"])))
    keys, values = pool.read("k", batch), pool.read("v", batch)
    expected = grouped_attention(inputs["q"][:, :, None], keys, values,
                                 batch.allowed_keys(keys.shape[1]))[:, :, 0]
    torch.testing.assert_close(paged_attention_decode_reference(**inputs), expected,
                               rtol=1e-12, atol=1e-12)


def _layer_and_pool(dtype=torch.float64, heads=4, kv_heads=2, head_dim=16, page=4,
                    rows=3, width=5):
    torch.manual_seed(0)
    layer = GroupedQueryAttention(32, heads, kv_heads, head_dim).to(dtype).eval()
    pool = paged_pool(layer.paged_layout(), rows * width + 1, page, "cpu", dtype)
    for t in pool.tensors.values():
        t.normal_()
    tables = torch.randperm(rows * width).view(rows, width)
    return layer, pool, tables


def _forced(monkeypatch, fn, calls: list | None = None):
    """Route the attention module's ``paged_attention_decode`` resolution to ``fn``, marked
    chosen (every other surface resolves as usual)."""
    import types

    import megacpp.model.attention as attention_module

    real = attention_module.resolve

    def counted(*args, **kwargs):
        if calls is not None:
            calls.append(args[0].shape)
        return fn(*args, **kwargs)

    chosen = types.SimpleNamespace(role="chosen", fn=counted, name="forced")
    monkeypatch.setattr(attention_module, "resolve", lambda surface, like: (
        chosen if surface == "paged_attention_decode" else real(surface, like)))


def test_layer_decode_through_the_hook_equals_the_gather_path(monkeypatch):
    """forward_paged of one token per row with the surface forced chosen (its reference as the
    backend) == the gather path, over three steps in float64; the pool receives the same
    entries; a two-token step (the speculative verify's form) and a step with document ids
    never call the backend."""
    layer, pool, tables = _layer_and_pool()
    theirs = PagedPool({n: t.clone() for n, t in pool.tensors.items()})
    page = pool.block_size
    positions = torch.tensor([6, 0, 13])
    calls = []
    for step in range(3):
        x = torch.randn(3, 1, 32, dtype=torch.float64)
        batch = _layer_batch(positions, tables, page)
        with torch.no_grad():
            expected = layer.forward_paged(x, PagedView(theirs, batch))
            with monkeypatch.context() as m:
                _forced(m, paged_attention_decode_reference, calls)
                ours = layer.forward_paged(x, PagedView(pool, batch))
        torch.testing.assert_close(ours, expected, rtol=1e-12, atol=1e-12, msg=f"step {step}")
        for name in ("k", "v"):
            assert torch.equal(pool.tensors[name], theirs.tensors[name]), name
        positions = positions + 1
    assert calls == [torch.Size([3, 4, 16])] * 3
    two = torch.stack([positions, positions + 1], 1)  # [B, 2]
    rows = torch.arange(3)
    slot_mapping = (tables[rows[:, None], two // page] * page + two % page).flatten()
    batch = PagedBatch(positions=two, slot_mapping=slot_mapping, block_tables=tables,
                       state_slots=rows)
    with torch.no_grad(), monkeypatch.context() as m:
        _forced(m, paged_attention_decode_reference, calls)
        layer.forward_paged(torch.randn(3, 2, 32, dtype=torch.float64), PagedView(pool, batch))
        one = _layer_batch(positions + 2, tables, page)
        one.doc_ids = torch.ones(3, 1, dtype=torch.long)  # a document mask: the gather path
        layer.forward_paged(torch.randn(3, 1, 32, dtype=torch.float64), PagedView(pool, one))
    assert len(calls) == 3


def test_compiled_decode_runs_the_gather_path_without_asking_the_catalog():
    """Under torch.compile (the engine's compile_decode) the layer does not resolve
    ``paged_attention_decode`` (a first selection is a graph break there)."""
    from megacpp.kernels.runtime import chosen_kernels, clear_resolutions

    layer, pool, tables = _layer_and_pool(torch.float32)
    theirs = PagedPool({n: t.clone() for n, t in pool.tensors.items()})
    batch = _layer_batch(torch.tensor([3, 9, 1]), tables, pool.block_size)
    x = torch.randn(3, 1, 32)
    clear_resolutions()
    with torch.no_grad():
        layer(torch.randn(1, 3, 32))  # the eager forward's own selections (the QK-norms)
        step = torch.compile(lambda x: layer.forward_paged(x, PagedView(pool, batch)),
                             fullgraph=True, backend="eager")
        out = step(x)
        assert "paged_attention_decode" not in chosen_kernels()
        expected = layer.forward_paged(x, PagedView(theirs, batch))
    torch.testing.assert_close(out, expected)


def test_bad_shapes_name_the_tensor():
    inputs = make_inputs("check", torch.float32)
    with pytest.raises(ValueError, match="positions has shape"):
        paged_attention_decode_reference(**{**inputs, "positions": inputs["positions"][:-1]})
    with pytest.raises(ValueError, match="v_pool has shape"):
        paged_attention_decode_reference(**{**inputs, "v_pool": inputs["v_pool"][:, :8]})
    with pytest.raises(ValueError, match="multiple of k_pool's 2 heads"):
        paged_attention_decode_reference(**{**inputs, "q": inputs["q"][:, :7]})
    with pytest.raises(ValueError, match="share a dtype"):
        paged_attention_decode_reference(**{**inputs, "q": inputs["q"].double()})


def test_catalog_row_is_forward_only_with_reference_fallback():
    from megacpp.kernels.registry import default_catalog

    catalog = default_catalog()
    assert catalog.surface("paged_attention_decode").grad_args == ()
    assert catalog.of("paged_attention_decode", "fallback")[0].fn \
        is paged_attention_decode_reference
    chosen = catalog.backend("paged_attention_decode", "triton")
    assert chosen.role == "chosen" and chosen.requirements.devices == ("cuda",)
    assert chosen.requirements.min_capability == (8, 0)
    assert "float64" not in chosen.requirements.dtypes  # a float64 model keeps the gather


def test_split_keys_depends_on_shapes_only():
    from megacpp.kernels.ops.paged_attention_decode.configs import DecodeConfig, split_keys

    config = DecodeConfig(block_n=64, target_programs=264)
    assert split_keys(64, 2, 384, config) == (3, 128)  # 6 tiles over 3 splits
    assert split_keys(1, 2, 384, config) == (6, 64)  # one tile each
    assert split_keys(200, 2, 384, config) == (1, 384)
    assert split_keys(1, 2, 16, config) == (1, 64)


# --- the Triton kernel under the CPU interpreter ----------------------------------------------

def interpreter_check() -> dict:
    """Run in a fresh process with TRITON_INTERPRET=1; raises on a tolerance miss."""
    from tests.kernels.interpreter import patch_bf16_dot, patch_bf16_rounding

    patch_bf16_dot()
    patch_bf16_rounding()  # the probabilities' cast to bf16 rounds as on the GPU
    from megacpp.kernels.ops.paged_attention_decode.configs import DecodeConfig, split_keys
    from megacpp.kernels.ops.paged_attention_decode.triton import paged_attention_decode_triton

    configs = {"default": DecodeConfig(),  # at these contexts: two splits of 64 keys
               "one_split": DecodeConfig(block_n=32, target_programs=1),
               "many_splits": DecodeConfig(block_n=16, target_programs=64)}
    results = {}
    for shape, (batch, _, kv_heads, _, page, _, _) in SHAPES.items():
        for dtype in (torch.float32, torch.bfloat16):
            inputs = make_inputs(shape, dtype, padding=2, extra_width=3)
            exact = paged_attention_decode_reference(**as_float64(inputs))
            expected = paged_attention_decode_reference(**inputs)
            for name, config in configs.items():
                if dtype == torch.bfloat16 and name != "many_splits":
                    continue  # bf16's rounding is the same code at every split count
                splits = split_keys(batch + 2, kv_heads, inputs["block_tables"].shape[1] * page,
                                    config)[0]
                out = paged_attention_decode_triton(**inputs, config=config)
                assert out.dtype == dtype and out.shape == inputs["q"].shape
                err, err_ref = rel(out, exact), rel(expected, exact)
                results[f"{shape}/{dtype}/{name}/splits={splits}"] = (err, err_ref)
                if dtype == torch.float32:
                    assert err < 2e-6, (shape, name, err)
                else:
                    assert err <= 2 * err_ref + 1e-3 and rel(out, expected) < 2e-2, (
                        shape, name, err, err_ref)
    splits_run = {int(k.rsplit("=", 1)[1]) for k in results}
    assert 1 in splits_run and max(splits_run) > 2, splits_run
    results["generate_greedy"] = _generate_check(paged_attention_decode_triton)
    return results


def _generate_check(kernel) -> int:
    """The tiny model's greedy decode (LockstepCache: the engine's paged layer code) with the
    kernel routed in by the attention layer's hook == with the gather path; the hook ran once
    per decode step and A layer."""
    import dataclasses

    from megacpp.model import attention
    from megacpp.model.config import load_config
    from megacpp.model.model import HybridLM

    torch.manual_seed(0)
    cfg = dataclasses.replace(load_config("tiny"), vocab_size=256, init_std=0.3)
    model = HybridLM(cfg).float().eval()
    prompt = torch.randint(0, 256, (2, 5), generator=torch.Generator().manual_seed(3))
    expected = model.generate_greedy(prompt, 6)
    calls = []

    class Chosen:
        role = "chosen"

        @staticmethod
        def fn(q, *args):
            calls.append(q.shape)
            return kernel(q, *args)

    real = attention.resolve
    attention.resolve = lambda surface, like: (
        Chosen if surface == "paged_attention_decode" else real(surface, like))
    try:
        got = model.generate_greedy(prompt, 6)
    finally:
        attention.resolve = real
    a_layers = cfg.pattern.count("A")
    assert len(calls) == 5 * a_layers and all(s == (2, 4, 32) for s in calls), calls
    assert torch.equal(got, expected), (got, expected)
    return len(calls)


def test_triton_decode_attention_under_the_interpreter():
    run_interpreter_check(__file__, "interpreter_check")


# --- GPU --------------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("batch", [1, 64])
def test_bf16_at_nam56r_shapes(batch):
    """bf16 at nam56r-350m's attention (12 / 2 heads of 64, 16-token blocks, context 384):
    the kernel against the float64 reference of the same inputs, no further from it than the
    bf16 reference is."""
    from megacpp.kernels.ops.paged_attention_decode.triton import paged_attention_decode_triton

    case = SURFACE.cases[f"nam56r_b{batch}"]
    inputs = SURFACE.make_inputs(case, torch.bfloat16, "cuda",
                                 torch.Generator(device="cuda").manual_seed(0))
    out = paged_attention_decode_triton(**inputs)
    exact = paged_attention_decode_reference(**as_float64(inputs))
    expected = paged_attention_decode_reference(**inputs)
    assert rel(out, exact) <= 2 * rel(expected, exact) + 1e-3, (rel(out, exact),
                                                                 rel(expected, exact))
    assert rel(out, expected) < 2e-2


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_replays_in_a_cuda_graph(dtype):
    """Captured once over a bucket's slice of a static block table, replayed on new queries,
    positions, tables and pool contents: equals the eager reference each time."""
    from megacpp.kernels.ops.paged_attention_decode.triton import paged_attention_decode_triton

    static = make_inputs("nam56r-350m", dtype, "cuda", padding=2, extra_width=3)
    paged_attention_decode_triton(**static)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = paged_attention_decode_triton(**static)
    for seed in range(1, 4):
        fresh = make_inputs("nam56r-350m", dtype, "cuda", seed=seed, padding=2)
        for name, t in fresh.items():
            static[name].copy_(t)
        graph.replay()
        expected = paged_attention_decode_reference(**static)
        assert rel(out, expected) < (1e-5 if dtype == torch.float32 else 2e-2), seed


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_kernels_compile_for_hopper_without_spills(dtype):
    """Both kernels at nam56r-350m's shape (G = 6 query heads a K/V head, head_dim 64, 16-token
    blocks, the shipped 64-key tiles and warps) compile for sm_90 with Triton's own compiler and
    ptxas (no GPU needed) and spill no registers: the interpreter does not check that
    ``tl.dot``'s operand shapes and the loop over a loaded bound lower to GPU code."""
    pytest.importorskip("triton")
    from megacpp.kernels.ops.paged_attention_decode import triton as decode
    from megacpp.kernels.ops.paged_attention_decode.configs import CONFIGS
    from tests.kernels.test_triton_compile import _compile, _ptxas_spills

    config = CONFIGS["default"]
    pointers = {"Q": dtype, "K": dtype, "V": dtype, "TABLES": "i64", "POS": "i64", "O": dtype,
                "M_PART": "fp32", "L_PART": "fp32", "ACC_PART": "fp32"}
    ints = ("stride_qb", "stride_qh", "stride_kblk", "stride_ktok", "stride_kh", "stride_vblk",
            "stride_vtok", "stride_vh", "stride_tb", "stride_tw", "stride_pos", "stride_ob",
            "stride_oh", "n_table", "G", "D", "keys_per_split")
    signature = {name: f"*{t}" for name, t in pointers.items()}
    signature.update({name: "i32" for name in ints})
    signature["scale"] = "fp32"
    constexprs = {"PAGE": 16, "BLOCK_N": config.block_n, "BLOCK_G": 16, "BLOCK_D": 64,
                  "N_SPLITS": 3, "PRECISION": "ieee" if dtype == "fp32" else None}
    signature.update({name: "constexpr" for name in constexprs})
    div16 = (*pointers, "stride_qb", "stride_qh", "stride_kblk", "stride_ktok", "stride_vblk",
             "stride_vtok", "stride_ob", "stride_oh", "D", "keys_per_split")
    warps = config.num_warps_f32 if dtype == "fp32" else config.num_warps
    kernel = _compile(decode._decode_kernel, signature, constexprs, div16, num_warps=warps)
    assert _ptxas_spills(kernel)[1] == 0
    combine = {"M_PART": "*fp32", "L_PART": "*fp32", "ACC_PART": "*fp32", "O": f"*{dtype}",
               "stride_ob": "i32", "stride_oh": "i32", "D": "i32", "N_SPLITS": "constexpr",
               "BLOCK_S": "constexpr", "BLOCK_D": "constexpr"}
    kernel = _compile(decode._combine_kernel, combine,
                      {"N_SPLITS": 3, "BLOCK_S": 4, "BLOCK_D": 64}, ("M_PART", "ACC_PART", "O"))
    assert _ptxas_spills(kernel)[1] == 0
