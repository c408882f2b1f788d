"""The fused Gated DeltaNet decode step (``gated_delta_step``) against its reference, and the
reference against the R mixer's own paged decode path.

CPU: the reference equals ``RecurrentMixer.forward_paged`` (gather, ``step``, scatter) through
the mixer's ``_fused_step`` glue; the mixer's ``forward_paged`` and ``step`` route a chosen
backend in (and keep the reference under torch.compile); bad shapes name the tensor.
Interpreter: the Triton kernel equals the reference in float32 / float64 / bfloat16 over
several shapes (nam56r-350m's included), rows in slots out of order, padding rows sharing a
scratch slot, two steps in a row. GPU: bf16 at nam56r-350m's shapes, and the kernel captured
in a CUDA graph.
"""

from __future__ import annotations

import types

import pytest
import torch

from megacpp.kernels.ops.gated_delta_step.reference import gated_delta_step_reference
from megacpp.kernels.ops.gated_delta_step.spec import SURFACE
from megacpp.model import mixer as mixer_module
from megacpp.model.cache import PagedBatch, PagedView
from megacpp.model.gated_delta import GatedDeltaNetMixer
from megacpp.model.mixer import RecurrentMixer
from tests.kernels.interpreter import run_interpreter_check
from tests.kernels.step_checks import (
    check_bf16_against_float64,
    check_graph_replay,
    rel,
    step_errors,
)

STATE = ("state", "conv_state")
# (batch, pool slots, heads, head_k_dim, head_v_dim, conv taps)
SHAPES = {
    "check": (5, 9, 3, 32, 48, 4),
    "nam56r-350m": (3, 7, 4, 64, 128, 4),
    "odd": (4, 6, 2, 24, 40, 3),  # K, V not powers of two, three taps
    "two_taps": (2, 3, 1, 8, 16, 2),  # the shortest conv: a one-input tail
}


def make_inputs(shape: str, dtype: torch.dtype, device="cpu", seed=0) -> dict:
    batch, pool, heads, head_k_dim, head_v_dim, conv_size = SHAPES[shape]
    case = {"batch": batch, "pool": pool, "heads": heads, "head_k_dim": head_k_dim,
            "head_v_dim": head_v_dim, "conv_size": conv_size}
    gen = torch.Generator(device=device).manual_seed(seed)
    inputs = SURFACE.make_inputs(case, dtype, device, gen)
    if dtype == torch.float64:  # a float64 model keeps a float64 state pool
        inputs.update({name: inputs[name].double() for name in STATE})
    return inputs


def errors(step, inputs: dict, steps: int = 1, padding: int = 0) -> dict[str, float]:
    """:func:`tests.kernels.step_checks.step_errors` of ``step`` against the reference."""
    return step_errors(step, gated_delta_step_reference, STATE, inputs, steps, padding)


# --- CPU: the reference is the mixer's decode path ------------------------------------------

def _paged(slots: torch.Tensor) -> PagedBatch:
    n = len(slots)
    zeros = torch.zeros(n, 1, dtype=torch.long)
    return PagedBatch(positions=zeros, slot_mapping=zeros.flatten(), block_tables=zeros,
                      state_slots=slots)


def _mixer(dtype: torch.dtype, **sizes) -> GatedDeltaNetMixer:
    """A small mixer with every parameter moved off its init value."""
    torch.manual_seed(0)
    kwargs = {"d_model": 32, "n_heads": 2, "head_k_dim": 8, "head_v_dim": 12,
              "conv_size": 4, "init_std": 0.2, **sizes}
    mixer = GatedDeltaNetMixer(**kwargs).to(dtype).eval()
    with torch.no_grad():
        for p in mixer.parameters():
            p.add_(0.1 * torch.randn_like(p))
    return mixer


def _pool(mixer: GatedDeltaNetMixer, slots: int, dtype: torch.dtype):
    pool = mixer.init_cache(slots, dtype=dtype)
    pool.state.normal_(std=0.3)
    pool.conv_state.normal_()
    return pool, type(pool)(pool.state.clone(), pool.conv_state.clone())


@pytest.mark.parametrize(("dtype", "tol"), [(torch.float64, 1e-12), (torch.float32, 0.0)])
def test_reference_is_the_mixers_paged_decode_step(dtype, tol):
    """_fused_step(reference) == RecurrentMixer.forward_paged (gather, step, scatter) over
    three steps, rows in slots out of order: to 1e-12 in float64, bit for bit in float32."""
    mixer = _mixer(dtype)
    pool, theirs = _pool(mixer, 6, dtype)
    slots = torch.tensor([4, 0, 2])
    for step in range(3):
        x = torch.randn(3, 1, 32, dtype=dtype)
        with torch.no_grad():
            ours = mixer._fused_step(gated_delta_step_reference, x, pool, slots)
            expected = RecurrentMixer.forward_paged(mixer, x, PagedView(theirs, _paged(slots)))
        torch.testing.assert_close(ours, expected, rtol=tol, atol=tol, msg=f"step {step}")
        for name in STATE:
            torch.testing.assert_close(getattr(pool, name), getattr(theirs, name), rtol=tol,
                                       atol=tol, msg=name)


def _force_step_backend(monkeypatch, fn) -> list:
    """Make the recurrent mixers' resolve answer ``gated_delta_step`` with a chosen row running
    ``fn``; returns the list of batch sizes the row was called with."""
    calls = []
    real = mixer_module.resolve

    def counted(proj, *args, **kwargs):
        calls.append(proj.shape[0])
        return fn(proj, *args, **kwargs)

    chosen = types.SimpleNamespace(role="chosen", fn=counted)
    monkeypatch.setattr(mixer_module, "resolve", lambda surface, like: (
        chosen if surface == "gated_delta_step" else real(surface, like)))
    return calls


def test_forward_paged_and_step_run_the_chosen_step_backend(monkeypatch):
    """With a chosen backend (here the reference, marked chosen), a paged decode step runs it
    on the pool rows in place and ``step`` on its cache's rows: the same outputs and states
    as the mixer's own path. With autograd on, ``step`` keeps the differentiable path."""
    mixer = _mixer(torch.float32)
    x = torch.randn(3, 1, 32)
    slots = torch.tensor([5, 1, 3])
    pool, theirs = _pool(mixer, 6, torch.float32)
    with torch.no_grad():
        expected_paged = mixer.forward_paged(x, PagedView(theirs, _paged(slots)))
        rows = type(pool)(pool.state[slots].clone(), pool.conv_state[slots].clone())
        rows_theirs = type(pool)(rows.state.clone(), rows.conv_state.clone())
        expected_step = mixer.step(x, rows_theirs)
    calls = _force_step_backend(monkeypatch, gated_delta_step_reference)
    with torch.no_grad():
        paged = mixer.forward_paged(x, PagedView(pool, _paged(slots)))
        stepped = mixer.step(x, rows)
    assert calls == [3, 3]
    torch.testing.assert_close(paged, expected_paged, rtol=0, atol=0)
    torch.testing.assert_close(stepped, expected_step, rtol=0, atol=0)
    for name in STATE:
        torch.testing.assert_close(getattr(pool, name), getattr(theirs, name), rtol=0, atol=0)
        torch.testing.assert_close(getattr(rows, name), getattr(rows_theirs, name), rtol=0,
                                   atol=0)
    mixer.step(x, rows)  # autograd on: the reference step, the backend not called
    assert calls == [3, 3]


def test_prefill_and_fresh_rows_keep_the_chunked_path(monkeypatch):
    """Only a decode step (one token, no reset, not fresh) reaches the step backend."""
    mixer = _mixer(torch.float32)
    calls = _force_step_backend(monkeypatch, gated_delta_step_reference)
    pool, _ = _pool(mixer, 4, torch.float32)
    slots = torch.tensor([2, 0])
    with torch.no_grad():
        mixer.forward_paged(torch.randn(2, 3, 32), PagedView(pool, _paged(slots)))
        fresh = _paged(slots)
        fresh.fresh = True
        mixer.forward_paged(torch.randn(2, 1, 32), PagedView(pool, fresh))
    assert calls == []


def test_compiled_decode_runs_the_reference_step_without_asking_the_catalog():
    """Under torch.compile (the engine's compile_decode) the mixer does not resolve
    ``gated_delta_step`` (a first selection is a graph break there) and runs the reference
    step."""
    from megacpp.kernels.runtime import chosen_kernels, clear_resolutions

    mixer = _mixer(torch.float32)
    pool, theirs = _pool(mixer, 3, torch.float32)
    batch = _paged(torch.tensor([2, 0]))
    clear_resolutions()
    with torch.no_grad():
        mixer(torch.randn(1, 3, 32))  # the eager forward's own selections (conv, chunked op)
        step = torch.compile(lambda x: mixer.forward_paged(x, PagedView(pool, batch)),
                             fullgraph=True, backend="eager")
        x = torch.randn(2, 1, 32)
        out = step(x)
        assert "gated_delta_step" not in chosen_kernels()
        expected = RecurrentMixer.forward_paged(mixer, x, PagedView(theirs, batch))
    torch.testing.assert_close(out, expected)


def test_bad_shapes_name_the_tensor():
    inputs = make_inputs("check", torch.float32)
    inputs["conv_weight"] = inputs["conv_weight"][:-1]
    with pytest.raises(ValueError, match="conv_weight has shape"):
        gated_delta_step_reference(**inputs)
    inputs = make_inputs("check", torch.float32)
    inputs["proj"] = inputs["proj"][:, :-1]
    with pytest.raises(ValueError, match="proj has shape"):
        gated_delta_step_reference(**inputs)
    inputs = make_inputs("check", torch.float32)
    inputs["slots"] = inputs["slots"].float()
    with pytest.raises(ValueError, match="slots must be int32 or int64"):
        gated_delta_step_reference(**inputs)


def test_catalog_row_is_forward_only_with_reference_fallback():
    from megacpp.kernels.registry import default_catalog

    catalog = default_catalog()
    assert catalog.surface("gated_delta_step").grad_args == ()
    assert catalog.of("gated_delta_step", "fallback")[0].fn is gated_delta_step_reference
    chosen = catalog.backend("gated_delta_step", "triton_fused")
    assert chosen.role == "chosen" and chosen.requirements.devices == ("cuda",)
    assert chosen.requirements.min_capability == (8, 0)


# --- the Triton kernel under the CPU interpreter --------------------------------------------

def interpreter_check() -> dict:
    """Run in a fresh process with TRITON_INTERPRET=1; raises on a tolerance miss. bfloat16
    with the interpreter's f32 -> bf16 casts rounding to nearest even, as the GPU's do."""
    from megacpp.kernels.ops.gated_delta_step.triton import gated_delta_step_triton
    from tests.kernels.interpreter import patch_bf16_rounding

    patch_bf16_rounding()
    results = {}
    tolerances = {torch.float32: 2e-6, torch.float64: 1e-12, torch.bfloat16: 2e-3}
    for dtype, tol in tolerances.items():
        for shape in SHAPES:
            if dtype == torch.bfloat16 and shape not in ("check", "nam56r-350m"):
                continue
            steps = 2 if shape in ("check", "odd") else 1
            padding = 2 if shape in ("check", "odd") else 0
            errs = errors(gated_delta_step_triton, make_inputs(shape, dtype), steps, padding)
            results[f"{shape}/{dtype}"] = errs
            assert all(e <= tol for e in errs.values()), (shape, dtype, errs)
    results["mixer"] = _mixer_check(gated_delta_step_triton)
    results["generate_greedy"] = _generate_check()
    return results


def _mixer_check(kernel) -> float:
    """The mixer's fused step through the kernel == its reference decode path (float32)."""
    mixer = _mixer(torch.float32, d_model=48, head_k_dim=16, head_v_dim=24)
    pool, theirs = _pool(mixer, 4, torch.float32)
    slots = torch.tensor([3, 1])
    x = torch.randn(2, 1, 48)
    with torch.no_grad():
        ours = mixer._fused_step(kernel, x, pool, slots)
        expected = RecurrentMixer.forward_paged(mixer, x, PagedView(theirs, _paged(slots)))
    err = rel(ours, expected)
    assert err < 1e-5, err
    for name in STATE:
        assert rel(getattr(pool, name), getattr(theirs, name)) < 1e-5, name
    return err


def _generate_check() -> int:
    """The tiny model's greedy decode (LockstepCache: the engine's paged mixer code) with the
    catalog's triton_fused row routed in by the mixer's hook == with the reference path; the
    hook ran once per decode step and R layer."""
    import dataclasses

    from megacpp.kernels.registry import default_catalog
    from megacpp.model.config import load_config
    from megacpp.model.model import HybridLM

    torch.manual_seed(0)
    cfg = dataclasses.replace(load_config("tiny"), vocab_size=256, init_std=0.3)
    model = HybridLM(cfg).float().eval()
    prompt = torch.randint(0, 256, (2, 5), generator=torch.Generator().manual_seed(3))
    expected = model.generate_greedy(prompt, 6)
    fused = default_catalog().backend("gated_delta_step", "triton_fused")
    calls = []
    real_resolve = mixer_module.resolve

    def resolve(surface, like):
        if surface != "gated_delta_step":
            return real_resolve(surface, like)
        calls.append(like.shape)
        return fused

    mixer_module.resolve = resolve
    try:
        got = model.generate_greedy(prompt, 6)
    finally:
        mixer_module.resolve = real_resolve
    r_layers = cfg.pattern.count("R")
    assert len(calls) == 5 * r_layers and all(s == (2, 1, cfg.d_model) for s in calls), calls
    assert torch.equal(got, expected), (got, expected)
    return len(calls)


def test_triton_step_under_the_interpreter():
    run_interpreter_check(__file__, "interpreter_check")


# --- GPU --------------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("batch", [1, 64])
def test_bf16_at_nam56r_shapes(batch):
    """bf16 in_proj output and parameters, float32 state: the kernel against the float64
    reference of the same inputs, no further from it than the bf16 reference is."""
    from megacpp.kernels.ops.gated_delta_step.triton import gated_delta_step_triton

    case = {**SURFACE.cases["nam56r_b1"], "batch": batch, "pool": batch + 3}
    inputs = SURFACE.make_inputs(case, torch.bfloat16, "cuda",
                                 torch.Generator(device="cuda").manual_seed(0))
    check_bf16_against_float64(gated_delta_step_triton, gated_delta_step_reference, STATE, inputs)


@pytest.mark.gpu
def test_kernel_replays_in_a_cuda_graph():
    """Captured once, replayed on new in_proj outputs: equals the eager reference (float32)."""
    from megacpp.kernels.ops.gated_delta_step.triton import gated_delta_step_triton

    check_graph_replay(gated_delta_step_triton, gated_delta_step_reference, STATE,
                       make_inputs("nam56r-350m", torch.float32, "cuda"))


@pytest.mark.parametrize(("proj", "state"), [("bf16", "fp32"), ("fp32", "fp32"),
                                             ("fp64", "fp64")])
def test_step_kernel_compiles_for_hopper_without_spills(proj, state):
    """The kernel at nam56r-350m's shape (4 heads, K 64, V 128, 4 taps) compiles for sm_90
    with Triton's own compiler and ptxas (no GPU needed) at the shipped warps and spills no
    registers in float32 math. The divisibility hints are the launch's: every pointer, and the strides that
    are multiples of 16 at that shape (not proj's row stride, 1544)."""
    pytest.importorskip("triton")  # a CPU torch without triton: nothing to compile with
    import triton.language as tl

    from megacpp.kernels.ops.gated_delta_step import triton as step
    from megacpp.kernels.ops.gated_delta_step.configs import CONFIGS
    from tests.kernels.test_triton_compile import _compile, _ptxas_spills

    tl_dtype = {"bf16": tl.bfloat16, "fp32": tl.float32, "fp64": tl.float64}
    pointers = {"PROJ": proj, "STATE": state, "CONV": state, "SLOTS": "i64", "CONV_W": proj,
                "A_LOG": proj, "DT_BIAS": proj, "NORM_W": proj, "Y": proj}
    signature = {name: f"*{t}" for name, t in pointers.items()}
    signature.update({name: "i32" for name in ("stride_proj", "stride_y", "s_state", "s_conv",
                                               "H")})
    constexprs = {"K": 64, "V": 128, "W": 4, "EPS": 1e-5, "BK": 64, "BV": 128, "BW": 4,
                  "CDT": tl.float64 if proj == "fp64" else tl.float32,
                  "IN_DT": tl_dtype[proj], "ST_DT": tl_dtype[state], "CONV_DT": tl_dtype[state]}
    signature.update({name: "constexpr" for name in constexprs})
    div16 = (*pointers, "stride_y", "s_state", "s_conv")
    warps = CONFIGS["default"].warps(64 * 128, proj == "fp64")
    kernel = _compile(step._gated_delta_step_kernel, signature, constexprs, div16,
                      num_warps=warps)
    regs, spills = _ptxas_spills(kernel)
    # float64 (the precision path) spills a few hundred bytes at any warp count (configs.py)
    assert spills <= (512 if proj == "fp64" else 0), (regs, spills)
