"""The MIMO scan's Triton intra-chunk kernels against the chunked reference, forward and the
gradients of every input, under the Triton CPU interpreter (and on a GPU, marked gpu)."""

from __future__ import annotations

import pytest
import torch

from megacpp.kernels.ops.mamba3_mimo_scan import mamba3_mimo_scan_chunked
from megacpp.kernels.ops.mamba3_scan import Mamba3ScanState
from tests.kernels.interpreter import run_interpreter_check
from tests.kernels.test_mamba3_mimo_scan_reference import make_inputs, random_reset, random_state


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm().clamp(min=1e-30)).item()


def compare(scan, inputs: dict, reset, chunk_size: int, tol: float, state=None) -> float:
    """y, the final state and the gradient of every input (and of ``state``, an initial
    state, through y and the final state): scan against the reference (run in float64 on
    the same values). Returns the largest relative error."""
    if state is not None:
        inputs = {**inputs, **{f"state_{n}": t for n, t in zip(("angle", "ssm", "k", "v"),
                                                                 state.tensors(), strict=True)}}
    names = list(inputs)
    leaves = {n: t.detach().clone().requires_grad_() for n, t in inputs.items()}
    ref_leaves = {n: t.double().detach().requires_grad_() for n, t in leaves.items()}
    device = inputs["v"].device
    reset = None if reset is None else reset.to(device)
    results = []
    for fn, args in ((scan, leaves), (mamba3_mimo_scan_chunked, ref_leaves)):
        kw = {n: t for n, t in args.items() if not n.startswith("state_")}
        initial = None if state is None else Mamba3ScanState(
            *(args[f"state_{n}"] for n in ("angle", "ssm", "k", "v")))
        results.append(fn(**kw, reset=reset, initial_state=initial, chunk_size=chunk_size))
    (y, final), (y_ref, final_ref) = results
    g = torch.Generator().manual_seed(3)
    cot = torch.randn(y.shape, generator=g, dtype=torch.float64).to(device)
    cot_s = torch.randn(final.ssm.shape, generator=g, dtype=torch.float64).to(device)
    grads = torch.autograd.grad((y.double() * cot).sum() + (final.ssm.double() * cot_s).sum(),
                                [leaves[n] for n in names])
    grads_ref = torch.autograd.grad((y_ref * cot).sum() + (final_ref.ssm * cot_s).sum(),
                                    [ref_leaves[n] for n in names])
    errors = {"y": _rel(y, y_ref), "ssm": _rel(final.ssm, final_ref.ssm)}
    errors.update({f"d{n}": _rel(a, b) for n, a, b in zip(names, grads, grads_ref, strict=True)})
    worst = max(errors.values())
    assert worst < tol, errors
    return worst


def _interpreter_check() -> list[float]:
    from megacpp.kernels.ops.mamba3_mimo_scan.triton import mamba3_mimo_scan_triton

    errors = []
    # rank 3 (T*R = 24 rows padded to 32), 2 groups of 2 heads, resets, L not a multiple
    inputs = make_inputs(batch=2, seqlen=21, rank=3, groups=2, nheads=4, d_state=8,
                         headdim=4, n_angles=2, dtype=torch.float32, seed=4)
    errors.append(compare(mamba3_mimo_scan_triton, inputs, random_reset(2, 21), 8, 1e-5))
    # rank 4, chunk 4 (16 rows), per-rank outputs (no mimo_o), no gate, no skip
    inputs = make_inputs(batch=1, seqlen=13, rank=4, groups=1, nheads=2, d_state=16,
                         headdim=8, n_angles=4, dtype=torch.float32, seed=5, down=False)
    for name in ("z", "mimo_z", "D"):
        del inputs[name]
    errors.append(compare(mamba3_mimo_scan_triton, inputs, None, 4, 1e-5))
    # rank 1, one chunk of 20 tokens
    inputs = make_inputs(batch=1, seqlen=20, rank=1, groups=1, nheads=2, d_state=8,
                         headdim=4, n_angles=1, dtype=torch.float32, seed=6)
    errors.append(compare(mamba3_mimo_scan_triton, inputs, random_reset(1, 20), 32, 1e-5))
    # continuing from an initial state (a cached prefill), 5 chunks, no reset; a state of
    # 2 x 64 x 24 entries walks in two 1024-entry tiles of the pass kernels
    inputs = make_inputs(batch=1, seqlen=18, rank=2, groups=1, nheads=2, d_state=24,
                         headdim=64, n_angles=3, dtype=torch.float32, seed=8)
    errors.append(compare(mamba3_mimo_scan_triton, inputs, None, 4, 1e-5,
                          state=random_state(inputs)))
    # the largest tile: rank 8, chunk 16 (128 rows), two chunks, resets
    inputs = make_inputs(batch=1, seqlen=32, rank=8, groups=1, nheads=1, d_state=8,
                         headdim=4, n_angles=2, dtype=torch.float32, seed=9)
    errors.append(compare(mamba3_mimo_scan_triton, inputs, random_reset(1, 32), 16, 1e-5))
    return errors


def test_interpreter_matches_reference() -> None:
    run_interpreter_check(__file__, "_interpreter_check")


def test_limits_are_refused_naming_them() -> None:
    pytest.importorskip("triton")
    from megacpp.errors import MegaCppError
    from megacpp.kernels.ops.mamba3_mimo_scan.triton import mamba3_mimo_scan_triton

    inputs = make_inputs(seqlen=40, rank=4, dtype=torch.float32)
    with pytest.raises(MegaCppError, match=r"chunk_size \* rank <= 128, .* got 160"):
        mamba3_mimo_scan_triton(**inputs, chunk_size=40)
    with pytest.raises(MegaCppError, match="float64 is not supported"):
        mamba3_mimo_scan_triton(**make_inputs(seqlen=8), chunk_size=4)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-4), (torch.bfloat16, 3e-2)])
def test_gpu_matches_reference(dtype, tol) -> None:
    """The kernels compiled for the GPU: rank 4, chunk 16 (64 rows), d_state 128, headdim
    64, packed documents; bf16 against the float64 reference within bf16 rounding."""
    from megacpp.kernels.ops.mamba3_mimo_scan.triton import mamba3_mimo_scan_triton

    inputs = make_inputs(batch=2, seqlen=300, rank=4, groups=1, nheads=4, d_state=128,
                         headdim=64, n_angles=32, dtype=torch.float32, seed=7)
    inputs = {n: (t.cuda().to(dtype) if n in ("q", "k", "v", "z", "trap") else t.cuda())
              for n, t in inputs.items()}
    print(compare(mamba3_mimo_scan_triton, inputs, random_reset(2, 300), 16, tol))


@pytest.mark.gpu
def test_gpu_mixer_auto_mode_uses_the_kernel_and_matches_reference_mode() -> None:
    """Under MEGACPP_KERNELS=auto an M:mimo mixer runs triton_intra (training forward and a
    cached prefill in two pieces) and gives reference mode's output and gradients (bf16)."""
    from megacpp.kernels.runtime import chosen_kernels, clear_resolutions, kernel_mode_override
    from megacpp.model.mamba3_mimo import Mamba3MimoMixer

    torch.manual_seed(0)
    mixer = Mamba3MimoMixer(d_model=256, d_state=64, headdim=32, mimo_rank=4,
                            chunk_size=16).cuda().bfloat16()
    x = torch.randn(2, 200, 256, device="cuda", dtype=torch.bfloat16)
    results = {}
    for mode in ("reference", "auto"):
        clear_resolutions()
        mixer.zero_grad()
        with kernel_mode_override(mode):
            mixer(x).float().square().mean().backward()
            cache = mixer.init_cache(2, device="cuda")
            y = torch.cat([mixer(x[:, :150], cache=cache), mixer(x[:, 150:], cache=cache)], 1)
        grads = [p.grad.float().clone() for p in mixer.parameters()]
        results[mode] = (y.float(), grads)
        if mode == "auto":
            assert chosen_kernels()["mamba3_mimo_scan"] == "triton_intra"
    (y_ref, g_ref), (y, g) = results["reference"], results["auto"]
    assert _rel(y, y_ref) < 2e-2
    for a, b in zip(g, g_ref, strict=True):
        assert _rel(a, b) < 5e-2
