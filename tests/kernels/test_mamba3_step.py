"""The fused Mamba-3 decode step (``mamba3_step``) against its reference, and the reference
against the mixer's own paged decode path.

CPU: the reference equals ``RecurrentMixer.forward_paged`` (gather, ``step``, scatter) through
the mixer's ``_fused_step`` glue; bad shapes name the tensor. Interpreter: the Triton kernel
equals the reference in float32 / float64 over several shapes (nam56r-350m's included), slots
out of order, padding rows sharing a scratch slot, several steps in a row. GPU: bf16 at
nam56r-350m's shapes, and the kernel captured in a CUDA graph.
"""

from __future__ import annotations

import pytest
import torch

from megacpp.kernels.ops.mamba3_step.reference import mamba3_step_reference
from megacpp.kernels.ops.mamba3_step.spec import SURFACE
from megacpp.model.cache import PagedBatch, PagedView
from megacpp.model.mamba3 import Mamba3Mixer
from megacpp.model.mixer import RecurrentMixer
from tests.kernels.interpreter import run_interpreter_check
from tests.kernels.step_checks import (
    check_bf16_against_float64,
    check_graph_replay,
    rel,
    step_errors,
)

STATE = ("angle", "ssm", "k", "v")
# (batch, pool slots, heads, headdim, d_state, groups, rotated pairs, output norm)
SHAPES = {
    "check": (5, 9, 4, 64, 64, 2, 16, 1),
    "nam56r-350m": (3, 7, 24, 64, 64, 1, 16, 1),
    "odd": (4, 6, 6, 24, 40, 3, 3, 0),  # P, N not powers of two, an odd R, no output norm
}


def make_inputs(shape: str, dtype: torch.dtype, device="cpu", seed=0) -> dict:
    batch, pool, heads, headdim, d_state, groups, angles, norm = SHAPES[shape]
    case = {"batch": batch, "pool": pool, "heads": heads, "headdim": headdim,
            "d_state": d_state, "groups": groups, "angles": angles, "norm": norm}
    gen = torch.Generator(device=device).manual_seed(seed)
    inputs = SURFACE.make_inputs(case, dtype, device, gen)
    if dtype == torch.float64:  # a float64 model keeps a float64 state pool
        inputs.update({name: inputs[name].double() for name in STATE})
    return inputs


def errors(step, inputs: dict, steps: int = 1, padding: int = 0) -> dict[str, float]:
    """:func:`tests.kernels.step_checks.step_errors` of ``step`` against the reference."""
    return step_errors(step, mamba3_step_reference, STATE, inputs, steps, padding)


# --- CPU: the reference is the mixer's decode path ------------------------------------------

def _paged(slots: torch.Tensor) -> PagedBatch:
    n = len(slots)
    zeros = torch.zeros(n, 1, dtype=torch.long)
    return PagedBatch(positions=zeros, slot_mapping=zeros.flatten(), block_tables=zeros,
                      state_slots=slots)


@pytest.mark.parametrize("outproj_norm", [True, False])
def test_reference_is_the_mixers_paged_decode_step(outproj_norm):
    """_fused_step(reference) == RecurrentMixer.forward_paged (gather, step, scatter) in
    float64 over three steps, rows in slots out of order, ngroups 2."""
    torch.manual_seed(0)
    mixer = Mamba3Mixer(d_model=32, d_state=16, headdim=8, expand=2, ngroups=2,
                        outproj_norm=outproj_norm, init_std=0.2).double()
    with torch.no_grad():  # parameters off their init values, so each one is exercised
        for p in mixer.parameters():
            p.add_(0.1 * torch.randn_like(p))
    pool = mixer.init_cache(6, dtype=torch.float64)
    for t in pool.tensors():
        t.normal_()
    pool.angle.uniform_(0, 6.28)
    theirs = type(pool)(*(t.clone() for t in pool.tensors()))
    slots = torch.tensor([4, 0, 2])
    for step in range(3):
        x = torch.randn(3, 1, 32, dtype=torch.float64)
        view = PagedView(pool, _paged(slots))
        ours = mixer._fused_step(mamba3_step_reference, x, pool, slots)
        expected = RecurrentMixer.forward_paged(mixer, x, PagedView(theirs, view.batch))
        torch.testing.assert_close(ours, expected, rtol=1e-12, atol=1e-12, msg=f"step {step}")
        for name, a, b in zip(STATE, pool.tensors(), theirs.tensors(), strict=True):
            torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12, msg=name)


def test_compiled_decode_runs_the_reference_step_without_asking_the_catalog():
    """Under torch.compile (the engine's compile_decode) the mixer does not resolve
    ``mamba3_step`` (a first selection is a graph break there) and runs the reference step."""
    from megacpp.kernels.runtime import chosen_kernels, clear_resolutions

    torch.manual_seed(0)
    mixer = Mamba3Mixer(d_model=32, d_state=16, headdim=8).eval()
    pool = mixer.init_cache(3)
    batch = _paged(torch.tensor([2, 0]))
    clear_resolutions()
    with torch.no_grad():
        mixer(torch.randn(1, 3, 32))  # the eager forward's own selections (norms, scan)
        step = torch.compile(lambda x: mixer.forward_paged(x, PagedView(pool, batch)),
                             fullgraph=True, backend="eager")
        x = torch.randn(2, 1, 32)
        theirs = type(pool)(*(t.clone() for t in pool.tensors()))
        out = step(x)
    assert "mamba3_step" not in chosen_kernels()
    expected = RecurrentMixer.forward_paged(mixer, x, PagedView(theirs, batch))
    torch.testing.assert_close(out, expected)


def test_bad_shapes_name_the_tensor():
    inputs = make_inputs("check", torch.float32)
    inputs["B_bias"] = inputs["B_bias"][:, :-1]
    with pytest.raises(ValueError, match="B_bias has shape"):
        mamba3_step_reference(**inputs)
    inputs = make_inputs("check", torch.float32)
    inputs["proj"] = inputs["proj"][:, :-1]
    with pytest.raises(ValueError, match="proj has shape"):
        mamba3_step_reference(**inputs)


def test_catalog_row_is_forward_only_with_reference_fallback():
    from megacpp.kernels.registry import default_catalog

    catalog = default_catalog()
    assert catalog.surface("mamba3_step").grad_args == ()
    assert catalog.of("mamba3_step", "fallback")[0].fn is mamba3_step_reference
    chosen = catalog.backend("mamba3_step", "triton_fused")
    assert chosen.role == "chosen" and chosen.requirements.devices == ("cuda",)
    assert chosen.requirements.min_capability == (8, 0)


# --- the Triton kernel under the CPU interpreter --------------------------------------------

def interpreter_check() -> dict:
    """Run in a fresh process with TRITON_INTERPRET=1; raises on a tolerance miss."""
    from megacpp.kernels.ops.mamba3_step.triton import mamba3_step_triton

    results = {}
    for dtype, tol in ((torch.float32, 2e-6), (torch.float64, 1e-12)):
        for shape in SHAPES:
            steps = 2 if shape == "check" else 1
            padding = 2 if shape == "check" else 0
            errs = errors(mamba3_step_triton, make_inputs(shape, dtype), steps, padding)
            results[f"{shape}/{dtype}"] = errs
            assert all(e <= tol for e in errs.values()), (shape, dtype, errs)
    results["mixer"] = _mixer_check(mamba3_step_triton)
    results["generate_greedy"] = _generate_check()
    return results


def _generate_check() -> int:
    """The tiny model's greedy decode (LockstepCache: the engine's paged mixer code) with the
    catalog's triton_fused row routed in by the mixer's hook == with the reference path; the
    hook ran once per decode step and M layer."""
    import dataclasses

    from megacpp.kernels.registry import default_catalog
    from megacpp.model import mixer
    from megacpp.model.config import load_config
    from megacpp.model.model import HybridLM

    torch.manual_seed(0)
    cfg = dataclasses.replace(load_config("tiny"), vocab_size=256, init_std=0.3)
    model = HybridLM(cfg).float().eval()
    prompt = torch.randint(0, 256, (2, 5), generator=torch.Generator().manual_seed(3))
    expected = model.generate_greedy(prompt, 6)
    fused = default_catalog().backend("mamba3_step", "triton_fused")
    calls = []

    def resolve(surface, like):
        if surface != "mamba3_step":
            return mamba3_resolve(surface, like)
        calls.append(like.shape)
        return fused

    mamba3_resolve, mixer.resolve = mixer.resolve, resolve
    try:
        got = model.generate_greedy(prompt, 6)
    finally:
        mixer.resolve = mamba3_resolve
    m_layers = cfg.pattern.count("M")
    assert len(calls) == 5 * m_layers and all(s == (2, 1, cfg.d_model) for s in calls), calls
    assert torch.equal(got, expected), (got, expected)
    return len(calls)


def _mixer_check(kernel) -> float:
    """The mixer's fused step through the kernel == its reference decode path (float32)."""
    torch.manual_seed(0)
    mixer = Mamba3Mixer(d_model=64, d_state=32, headdim=16, expand=2, ngroups=2,
                        init_std=0.2).float()
    pool = mixer.init_cache(4)
    for t in pool.tensors():
        t.normal_()
    theirs = type(pool)(*(t.clone() for t in pool.tensors()))
    slots = torch.tensor([3, 1])
    x = torch.randn(2, 1, 64)
    ours = mixer._fused_step(kernel, x, pool, slots)
    expected = RecurrentMixer.forward_paged(mixer, x, PagedView(theirs, _paged(slots)))
    err = rel(ours, expected)
    assert err < 1e-5, err
    for name, a, b in zip(STATE, pool.tensors(), theirs.tensors(), strict=True):
        assert rel(a, b) < 1e-5, name
    return err


def test_triton_step_under_the_interpreter():
    run_interpreter_check(__file__, "interpreter_check")


# --- GPU --------------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("batch", [1, 64])
def test_bf16_at_nam56r_shapes(batch):
    """bf16 in_proj output and parameters, float32 state: the kernel against the float64
    reference of the same inputs, no further from it than the bf16 reference is."""
    from megacpp.kernels.ops.mamba3_step.triton import mamba3_step_triton

    case = {**SURFACE.cases["nam56r_b1"], "batch": batch, "pool": batch + 3}
    inputs = SURFACE.make_inputs(case, torch.bfloat16, "cuda",
                                 torch.Generator(device="cuda").manual_seed(0))
    check_bf16_against_float64(mamba3_step_triton, mamba3_step_reference, STATE, inputs)


@pytest.mark.gpu
def test_kernel_replays_in_a_cuda_graph():
    """Captured once, replayed on new in_proj outputs: equals the eager reference (float32)."""
    from megacpp.kernels.ops.mamba3_step.triton import mamba3_step_triton

    check_graph_replay(mamba3_step_triton, mamba3_step_reference, STATE,
                       make_inputs("nam56r-350m", torch.float32, "cuda"))


@pytest.mark.parametrize(("proj", "state"), [("bf16", "fp32"), ("fp32", "fp32"),
                                             ("fp64", "fp64")])
def test_step_kernel_compiles_for_hopper_without_spills(proj, state):
    """The kernel at nam56r-350m's shape (P = N = 64, 24 heads, 16 pairs) compiles for sm_90
    with Triton's own compiler and ptxas (no GPU needed) at the shipped warps and spills no
    registers. The divisibility hints are the launch's: every pointer, and the sizes and
    strides that are multiples of 16 at that shape (not proj's row stride, 3288)."""
    pytest.importorskip("triton")  # a CPU torch without triton: nothing to compile with
    import triton.language as tl

    from megacpp.kernels.ops.mamba3_step import triton as step
    from megacpp.kernels.ops.mamba3_step.configs import CONFIGS
    from tests.kernels.test_triton_compile import _compile, _ptxas_spills

    tl_dtype = {"bf16": tl.bfloat16, "fp32": tl.float32, "fp64": tl.float64}
    pointers = {"PROJ": proj, "ANGLE": state, "SSM": state, "KS": state, "VS": state,
                "SLOTS": "i64", "DT_BIAS": proj, "BW": proj, "CW": proj, "BB": proj,
                "CB": proj, "DSKIP": proj, "NW": proj, "Y": proj}
    signature = {name: f"*{t}" for name, t in pointers.items()}
    signature.update({name: "i32" for name in ("stride_proj", "stride_y", "s_angle", "s_ssm",
                                               "s_k", "s_v", "H", "G", "P", "N", "R")})
    signature.update({"A_floor": "fp32", "eps": "fp32"})
    constexprs = {"BP": 64, "BN": 64, "HAS_NORM": True,
                  "CDT": tl.float64 if proj == "fp64" else tl.float32,
                  "IN_DT": tl_dtype[proj], "ST_DT": tl_dtype[state]}
    signature.update({name: "constexpr" for name in constexprs})
    div16 = (*pointers, "stride_y", "s_angle", "s_ssm", "s_k", "s_v", "P", "N", "R")
    warps = CONFIGS["default"].warps(64 * 64, proj == "fp64")
    kernel = _compile(step._mamba3_step_kernel, signature, constexprs, div16, num_warps=warps)
    regs, spills = _ptxas_spills(kernel)
    assert spills == 0, (regs, spills)
