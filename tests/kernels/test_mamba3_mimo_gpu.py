"""GPU: the Mamba-3 MIMO scan against mamba_ssm's MIMO (``is_mimo``) on the same tensors.

Skipped without CUDA (tests/conftest.py) and without mamba_ssm + tilelang. Run:

    PYTHONPATH=src python -m pytest -q -m gpu tests/kernels/test_mamba3_mimo_gpu.py -s
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from megacpp.kernels.ops.mamba3_mimo_scan import mamba3_mimo_scan_chunked
from megacpp.kernels.registry import default_catalog

pytestmark = pytest.mark.gpu


def _require_peer() -> None:
    for package in ("mamba_ssm", "tilelang"):
        if importlib.util.find_spec(package) is None:
            pytest.skip(f"needs {package} (mamba_ssm's MIMO kernels are TileLang)")


def _rel(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual.float() - expected.float()).norm() / expected.float().norm()).item()


def _inputs(case: str, seq: int | None = None) -> dict:
    surface = default_catalog().surface("mamba3_mimo_scan")
    shape = {**surface.cases[case], "final_state": 0, **({"seq": seq} if seq else {})}
    return surface.make_inputs(shape, torch.bfloat16, torch.device("cuda"),
                               torch.Generator(device="cuda").manual_seed(0))


@pytest.mark.parametrize("case,seq", [("check", None), ("seq4096", 2048)])
@pytest.mark.parametrize("down", [True, False])
def test_forward_and_backward_agree_with_mamba_ssm_within_bf16(case, seq, down):
    """y and the gradients of every input: mamba_ssm's bf16 TileLang op against our chunked
    reference computing in float32 on the same bf16 tensors (relative L2 error). ``down``:
    with mimo_o (the R outputs summed) or without (the R outputs returned, what the mixer
    asks for with its output norm)."""
    _require_peer()
    from megacpp.kernels.peers import mamba3_mimo_tilelang

    inputs = _inputs(case, seq)
    if not down:
        inputs["mimo_o"] = None
    grads = [n for n, t in inputs.items() if isinstance(t, torch.Tensor) and t.requires_grad]
    results = []
    for scan in (mamba3_mimo_tilelang, mamba3_mimo_scan_chunked):
        fresh = {n: (t.detach().clone().requires_grad_() if n in grads else t)
                 for n, t in inputs.items()}
        out = scan(**fresh)
        y = out[0] if isinstance(out, tuple) else out
        cot = torch.randn(y.shape, generator=torch.Generator(device="cuda").manual_seed(1),
                          device="cuda", dtype=y.dtype)
        results.append((y, torch.autograd.grad(y, [fresh[n] for n in grads], cot)))
    (y_peer, g_peer), (y_ref, g_ref) = results
    errors = {"y": _rel(y_peer, y_ref)}
    errors.update({f"d{n}": _rel(a, b) for n, a, b in zip(grads, g_peer, g_ref, strict=True)})
    print(case, "down" if down else "per-rank", {k: f"{v:.2e}" for k, v in errors.items()})
    assert errors["y"] < 2e-2, errors
    assert all(v < 5e-2 for v in errors.values()), errors


def test_mixer_equals_mamba_ssm_mamba3_is_mimo():
    """Our Mamba3MimoMixer (outproj_norm off: mamba_ssm's default) and mamba_ssm's
    ``Mamba3(is_mimo=True)`` with the same weights (the parameter names and in_proj layout
    are the same) give the same output on the same input (bf16)."""
    _require_peer()
    from megacpp.kernels.peers import _mamba_ssm_module
    from megacpp.model.mamba3_mimo import Mamba3MimoMixer

    Mamba3 = _mamba_ssm_module("mamba_ssm.modules.mamba3").Mamba3
    torch.manual_seed(0)
    shape = {"d_model": 256, "d_state": 64, "headdim": 64, "expand": 2, "chunk_size": 16}
    ours = Mamba3MimoMixer(**shape, mimo_rank=4, outproj_norm=False).cuda()
    peer = Mamba3(**shape, is_mimo=True, mimo_rank=4, is_outproj_norm=False,
                  device="cuda").cuda()
    with torch.no_grad():
        for p in (ours.mimo_x, ours.mimo_z, ours.mimo_o, ours.B_bias, ours.C_bias, ours.D):
            p.add_(0.1 * torch.randn_like(p))
    state = {name: p for name, p in ours.state_dict().items()}
    missing, unexpected = peer.load_state_dict(state, strict=False)
    assert not missing and not unexpected, (missing, unexpected)
    ours, peer = ours.bfloat16(), peer.bfloat16()
    x = torch.randn(2, 512, 256, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        y_ours, y_peer = ours(x), peer(x)
    err = _rel(y_peer, y_ours)
    print("mixer rel err", f"{err:.2e}")
    assert err < 3e-2
