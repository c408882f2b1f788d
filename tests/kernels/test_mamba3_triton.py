"""Our Triton Mamba-3 scan against the float64 reference: y, final state, every input grad.

GPU tests run the compiled kernels (float32 and bf16 operands, with and without document
resets, lengths that are not a multiple of the chunk). One CPU test runs the same kernels
through the Triton interpreter (skipped when triton is not importable, as in CI).
"""

from __future__ import annotations

import functools
import importlib.util
import math
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

from megacpp.kernels.ops.mamba3_scan.reference import mamba3_scan_chunked
from tests.kernels.interpreter import run_interpreter_check

GRAD_ARGS = ("q", "k", "v", "adt", "dt", "trap", "q_bias", "k_bias", "angles", "D", "z")


def make_inputs(batch, seqlen, groups, nheads, d_state, headdim, n_angles, dtype, device, seed,
                with_reset=True):
    """Model-like inputs: q/k RMS-normed, dt ~ softplus, adt = A dt <= 0, all random."""
    g = torch.Generator(device="cpu").manual_seed(seed)

    def randn(*shape, scale=1.0):
        return torch.randn(*shape, generator=g) * scale

    dt = F.softplus(randn(batch, seqlen, nheads) - 2)
    inputs = {
        "q": F.rms_norm(randn(batch, seqlen, groups, d_state), (d_state,)).to(dtype),
        "k": F.rms_norm(randn(batch, seqlen, groups, d_state), (d_state,)).to(dtype),
        "v": randn(batch, seqlen, nheads, headdim).to(dtype),
        "adt": -torch.rand(batch, seqlen, nheads, generator=g) * dt,  # float32 as in the model
        "dt": dt,
        "trap": randn(batch, seqlen, nheads).to(dtype),
        "q_bias": 1 + 0.1 * randn(nheads, d_state),
        "k_bias": 1 + 0.1 * randn(nheads, d_state),
        "angles": randn(batch, seqlen, nheads, n_angles, scale=2.0).to(dtype),
        "D": randn(nheads),
        "z": randn(batch, seqlen, nheads, headdim).to(dtype),
    }
    inputs = {n: t.to(device).requires_grad_() for n, t in inputs.items()}
    reset = None
    if with_reset:
        reset = torch.rand(batch, seqlen, generator=g) < 0.02
        reset[0, min(seqlen - 1, 16)] = True  # on a chunk boundary (chunk 16)
        reset[-1, seqlen // 2] = True
        reset[:, 0] = False
        reset = reset.to(device)
    return inputs, reset


def rel(actual: torch.Tensor, expected: torch.Tensor) -> float:
    actual, expected = actual.detach().double().cpu(), expected.detach().double().cpu()
    if not torch.isfinite(actual).all():
        return float("nan")
    return float((actual - expected).norm() / expected.norm().clamp_min(1e-30))


def angle_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """Largest wrapped difference of two angle tensors, in radians."""
    diff = actual.detach().double().cpu() - expected.detach().double().cpu()
    return float((torch.remainder(diff + math.pi, 2 * math.pi) - math.pi).abs().max())


def compare(scan, inputs, reset, chunk_size, tol) -> dict[str, float]:
    """Run ``scan`` and the float64 reference with one random cotangent; relative errors."""
    ours = {n: t.detach().clone().requires_grad_() for n, t in inputs.items()}
    ref = {n: t.detach().double().requires_grad_() for n, t in inputs.items()}
    y, state = scan(**ours, reset=reset, chunk_size=chunk_size)
    y_ref, state_ref = mamba3_scan_chunked(**ref, reset=reset, chunk_size=chunk_size)
    assert y.dtype == inputs["v"].dtype and y.shape == y_ref.shape
    cot = torch.randn(y_ref.shape, dtype=torch.float64, device=y_ref.device)
    grads = torch.autograd.grad((y.float() * cot.float()).sum(),
                                [ours[n] for n in GRAD_ARGS])
    grads_ref = torch.autograd.grad((y_ref * cot).sum(), [ref[n] for n in GRAD_ARGS])
    errors = {"y": rel(y, y_ref)}
    for name in ("ssm", "k", "v"):
        errors[f"state.{name}"] = rel(getattr(state, name), getattr(state_ref, name))
    errors["state.angle"] = angle_error(state.angle, state_ref.angle) / (2 * math.pi)
    for name, g, g_ref in zip(GRAD_ARGS, grads, grads_ref):
        assert g.dtype == inputs[name].dtype and g.shape == inputs[name].shape, name
        errors[f"d{name}"] = rel(g, g_ref)
    bad = {k: v for k, v in errors.items() if not v <= tol}  # NaN never passes
    assert not bad, f"errors over {tol}: {bad}\nall: {errors}"
    return errors


def same_without_final_state(scan, inputs, reset, chunk_size) -> None:
    """``output_final_state=False`` gives no state and the same y and input grads, bit for bit
    (the training path: only the final-state kernel is left out)."""
    runs = []
    for keep in (True, False):
        ours = {n: t.detach().clone().requires_grad_() for n, t in inputs.items()}
        y, state = scan(**ours, reset=reset, chunk_size=chunk_size, output_final_state=keep)
        assert (state is None) == (not keep)
        cot = torch.ones_like(y).mul_(torch.arange(y.shape[-1], device=y.device) - 3.0)
        runs.append((y, *torch.autograd.grad(y, [ours[n] for n in GRAD_ARGS], cot)))
    for name, a, b in zip(("y", *GRAD_ARGS), *runs):
        assert torch.equal(a, b), name


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton")
def test_state_tiles_halve_until_the_grid_fills_the_device() -> None:
    from megacpp.kernels.launch import DEFAULT
    from megacpp.kernels.ops.mamba3_scan.configs import CONFIGS
    from megacpp.kernels.ops.mamba3_scan.op import _state_pairs

    # (B * H, pairs padded to a power of two, SMs) -> pairs per program; at least 2 programs
    # per SM, never under 16 pairs, never over N2B
    config = CONFIGS[DEFAULT]
    assert _state_pairs(8 * 24, 32, 132, config) == 16  # nam56r step: 192 programs of 32 -> 384
    assert _state_pairs(8 * 32, 64, 132, config) == 32  # the bench: 512 programs of 32
    assert _state_pairs(2 * 4, 64, 132, config) == 16
    assert _state_pairs(8 * 24, 16, 132, config) == 16
    assert _state_pairs(4, 64, 1, config) == 32  # the interpreter's one "SM"


# -- CPU: the Triton interpreter ---------------------------------------------------------------
def _interpreter_check() -> list[dict[str, float]]:
    """Run in a fresh process with TRITON_INTERPRET=1 (set before triton is first imported)."""
    import numpy as np
    import triton.runtime.interpreter as interp

    original = interp._patch_lang_tensor

    def patch(tensor, scope):  # numpy >= 2.4 refuses int() of a 1-element 1-D array
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(np.ravel(self.handle.data)[0]))

    interp._patch_lang_tensor = patch
    from megacpp.kernels.launch import DEFAULT
    from megacpp.kernels.ops.mamba3_scan.configs import CONFIGS
    from megacpp.kernels.ops.mamba3_scan.op import mamba3_scan_triton

    def scan(**changes):  # the op under the default settings with ``changes``
        return functools.partial(mamba3_scan_triton, config=replace(CONFIGS[DEFAULT], **changes))

    # 3 chunks of 16 (the last one partial), packed documents, 2 heads per q/k group,
    # odd d_state / headdim / rotated pairs (strided pair loads); the final angle summed over
    # the chunks 2 at a time (the last load partial)
    inputs, reset = make_inputs(batch=2, seqlen=45, groups=1, nheads=2, d_state=10, headdim=12,
                                n_angles=3, dtype=torch.float32, device="cpu", seed=0)
    errors = compare(scan(final_chunks=2), inputs, reset, chunk_size=16, tol=1e-5)
    # d_state 2 N2B (q, k rows loaded whole and split in two), in two 16-pair state tiles and
    # two 16-pair _bwd_dqk tiles, the second one partly rotated (20 of 32 pairs)
    inputs, reset = make_inputs(batch=1, seqlen=20, groups=1, nheads=2, d_state=64, headdim=16,
                                n_angles=20, dtype=torch.float32, device="cpu", seed=1)
    errors = [errors, compare(scan(dqk_pairs=16, pairs=16), inputs, reset, chunk_size=16,
                              tol=1e-5)]
    # 2 q/k groups of 2 heads, 3 chunks of 32 (dq, dk summed over a group's heads)
    inputs, reset = make_inputs(batch=2, seqlen=70, groups=2, nheads=4, d_state=12, headdim=8,
                                n_angles=2, dtype=torch.float32, device="cpu", seed=3)
    errors = [*errors, compare(scan(), inputs, reset, chunk_size=32, tol=1e-5)]
    same_without_final_state(scan(), inputs, reset, chunk_size=32)
    # two state tiles of pairs (d_state 40 -> 32 padded pairs, strided pair loads), two
    # 16-pair _bwd_dqk tiles (its scalar grads summed from per-tile shares)
    inputs, reset = make_inputs(batch=1, seqlen=40, groups=1, nheads=2, d_state=40, headdim=16,
                                n_angles=9, dtype=torch.float32, device="cpu", seed=4)
    return [*errors, compare(scan(dqk_pairs=16, pairs=16), inputs, reset, chunk_size=16,
                             tol=1e-5)]


def test_interpreter_matches_reference() -> None:
    run_interpreter_check(__file__, "_interpreter_check")


def _no_gate_backward_check() -> str:
    """Without z the forward runs and the backward is refused with one clear error (the
    compiled backward without z faulted on an H100) before any kernel starts."""
    from megacpp.errors import MegaCppError
    from megacpp.kernels.ops.mamba3_scan.op import mamba3_scan_triton

    inputs, reset = make_inputs(batch=1, seqlen=20, groups=1, nheads=2, d_state=8, headdim=8,
                                n_angles=2, dtype=torch.float32, device="cpu", seed=5)
    kept = {n: t for n, t in inputs.items() if n != "z"}
    y, _ = mamba3_scan_triton(**kept, reset=reset, chunk_size=16)
    ref, _ = mamba3_scan_chunked(**{n: t.detach().double() for n, t in kept.items()},
                                 reset=reset, chunk_size=16)
    assert rel(y, ref) < 1e-5
    try:
        y.sum().backward()
    except MegaCppError as exc:
        assert "no backward without z" in str(exc), exc
        return str(exc)
    raise AssertionError("the backward without z ran")


def test_interpreter_backward_without_the_gate_is_refused() -> None:
    run_interpreter_check(__file__, "_no_gate_backward_check")


# -- GPU -------------------------------------------------------------------------------------
def _gpu_scan():
    from megacpp.kernels.ops.mamba3_scan.op import mamba3_scan_triton

    return mamba3_scan_triton


F32, BF16 = torch.float32, torch.bfloat16
GPU_CASES = [  # (batch, seqlen, groups, nheads, d_state, headdim, n_angles, chunk, dtype, reset)
    # the model's shape, L not a multiple of the chunk
    *[(2, 300, 2, 8, 128, 64, 32, 64, dtype, reset) for dtype in (F32, BF16)
      for reset in (False, True)],
    (2, 77, 1, 3, 20, 24, 7, 16, F32, True),  # odd everything, chunk 16
    (2, 77, 1, 3, 20, 24, 7, 16, BF16, True),
    (1, 130, 2, 4, 64, 32, 32, 32, BF16, True),  # every pair rotated, chunk 32
    (2, 300, 1, 4, 64, 64, 16, 64, BF16, True),  # the flagship's d_state 64 (32 pairs), chunk 64
    (1, 4096, 1, 32, 128, 64, 32, 64, BF16, True),  # the benchmark's row length and heads
    (8, 256, 1, 32, 128, 64, 32, 64, BF16, True),  # enough heads for 32-pair state tiles
]


@pytest.mark.gpu
@pytest.mark.parametrize("case", GPU_CASES, ids=str)
def test_gpu_matches_reference(case) -> None:
    *shape, chunk, dtype, with_reset = case
    inputs, reset = make_inputs(*shape, dtype=dtype, device="cuda", seed=len(str(case)),
                                with_reset=with_reset)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    print(case, compare(_gpu_scan(), inputs, reset, chunk, tol))


@pytest.mark.gpu
def test_gpu_without_final_state_is_the_same_scan() -> None:
    inputs, reset = make_inputs(2, 300, 1, 4, 64, 64, 16, torch.bfloat16, "cuda", seed=5)
    same_without_final_state(_gpu_scan(), inputs, reset, chunk_size=64)


@pytest.mark.gpu
def test_gpu_no_gate_no_skip_and_fresh_inputs() -> None:
    """Without D and z; two seeds give different outputs (nothing cached or unwritten)."""
    scan = _gpu_scan()
    outs = []
    for seed in (1, 2):
        inputs, reset = make_inputs(2, 200, 1, 4, 128, 64, 32, torch.bfloat16, "cuda", seed)
        kept = {n: t for n, t in inputs.items() if n not in ("D", "z")}
        y, _ = scan(**kept, reset=reset)
        ref, _ = mamba3_scan_chunked(**{n: t.detach().double() for n, t in kept.items()},
                                     reset=reset)
        assert rel(y, ref) < 1e-2
        outs.append(y)
    assert rel(outs[0], outs[1]) > 0.5


@pytest.mark.gpu
def test_gpu_refuses_what_it_does_not_support() -> None:
    from megacpp.errors import MegaCppError
    from megacpp.kernels.ops.mamba3_scan.reference import zero_scan_state

    scan = _gpu_scan()
    inputs, _ = make_inputs(1, 32, 1, 2, 16, 16, 4, torch.bfloat16, "cuda", 0, with_reset=False)
    state = zero_scan_state(1, 2, 16, 16, 4, device="cuda")
    with pytest.raises(MegaCppError, match="initial_state"):
        scan(**inputs, initial_state=state)
    with pytest.raises(MegaCppError, match="chunk_size"):
        scan(**inputs, chunk_size=48)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_catalog_check_passes(dtype: str) -> None:
    from megacpp.kernels.check import check_backend
    from megacpp.kernels.registry import default_catalog

    catalog = default_catalog()
    result = check_backend(catalog.surface("mamba3_scan"),
                           catalog.backend("mamba3_scan", "triton_chunked"),
                           torch.device("cuda"), dtype, seed=5)
    print(result.errors)
    assert result.passed, result.errors


@pytest.mark.gpu
def test_mixer_auto_mode_uses_the_kernel_and_matches_reference_mode() -> None:
    """The M mixer under MEGACPP_KERNELS=auto: same output and grads; a cache uses the ref."""
    from megacpp.kernels.runtime import chosen_kernels, clear_resolutions, kernel_mode_override
    from megacpp.model.mamba3 import Mamba3Mixer

    torch.manual_seed(0)
    mixer = Mamba3Mixer(d_model=256, d_state=64, headdim=32).cuda().bfloat16()
    x = torch.randn(2, 200, 256, device="cuda", dtype=torch.bfloat16)
    doc_ids = torch.cumsum(torch.rand(2, 200, device="cuda") < 0.02, dim=1)
    results = {}
    for mode in ("reference", "auto"):
        clear_resolutions()
        with kernel_mode_override(mode):
            out = mixer(x, doc_ids=doc_ids)
            grads = torch.autograd.grad(out.float().square().sum(),
                                        [mixer.in_proj.weight, mixer.dt_bias, mixer.B_bias])
            results[mode] = (out.float(), [g.float() for g in grads])
            chosen = chosen_kernels()["mamba3_scan"]
        assert chosen == ("reference" if mode == "reference" else "triton_chunked")
    (ref_out, ref_grads), (out, grads) = results["reference"], results["auto"]
    assert rel(out, ref_out) < 1e-2
    for g, r in zip(grads, ref_grads):
        assert rel(g, r) < 3e-2
    with kernel_mode_override("fast"):  # a prefill from a cache runs the reference
        cache = mixer.init_cache(2, device="cuda")
        with torch.no_grad():
            prefill = mixer(x, cache=cache)
            whole = mixer(x)
        assert rel(prefill, whole) < 1e-2
