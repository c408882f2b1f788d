"""The Mamba-3 MIMO scan: chunked form against the recurrent truth (values, final state,
gradients), the truth against hand math, and rank 1 against the SISO scan."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

from megacpp.kernels.ops.mamba3_mimo_scan import (
    flops_per_token,
    mamba3_mimo_scan_chunked,
    mamba3_mimo_scan_recurrent,
)
from megacpp.kernels.ops.mamba3_scan import Mamba3ScanState, mamba3_scan_recurrent
from tests.kernels.test_mamba3_scan_reference import (
    assert_close_rel,
    assert_states_close,
    random_reset,
)

F64 = torch.float64


def make_inputs(
    batch=2, seqlen=23, rank=3, groups=2, nheads=4, d_state=8, headdim=4, n_angles=2,
    dtype=F64, seed=0, down=True,
) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=g, dtype=dtype)

    dt = F.softplus(randn(batch, seqlen, nheads) - 1)
    inputs = {
        "q": F.rms_norm(randn(batch, seqlen, rank, groups, d_state), (d_state,)),
        "k": F.rms_norm(randn(batch, seqlen, rank, groups, d_state), (d_state,)),
        "v": randn(batch, seqlen, nheads, headdim),
        "adt": -torch.rand(batch, seqlen, nheads, generator=g, dtype=dtype) * dt,
        "dt": dt,
        "trap": randn(batch, seqlen, nheads),
        "q_bias": randn(nheads, rank, d_state),
        "k_bias": randn(nheads, rank, d_state),
        "mimo_v": randn(nheads, rank, headdim) / rank,
        "angles": 2 * randn(batch, seqlen, nheads, n_angles),
        "mimo_z": randn(nheads, rank, headdim),
        "D": randn(nheads),
        "z": randn(batch, seqlen, nheads, headdim),
    }
    if down:
        inputs["mimo_o"] = randn(nheads, rank, headdim) / rank
    return inputs


def random_state(inputs, seed=1) -> Mamba3ScanState:
    g = torch.Generator().manual_seed(seed)
    batch, _, nheads, headdim = inputs["v"].shape
    rank, d_state = inputs["q"].shape[2], inputs["q"].shape[-1]
    dtype = inputs["v"].dtype
    return Mamba3ScanState(
        angle=torch.rand(batch, nheads, inputs["angles"].shape[-1], generator=g,
                         dtype=dtype) * 2 * math.pi,
        ssm=torch.randn(batch, nheads, headdim, d_state, generator=g, dtype=dtype),
        k=torch.randn(batch, rank, nheads, d_state, generator=g, dtype=dtype),
        v=torch.randn(batch, nheads, headdim, generator=g, dtype=dtype),
    )


@pytest.mark.parametrize("chunk_size", [1, 4, 8, 64])
@pytest.mark.parametrize("with_reset", [False, True])
@pytest.mark.parametrize("with_state", [False, True])
def test_chunked_matches_recurrent_float64(chunk_size, with_reset, with_state):
    inputs = make_inputs(seed=chunk_size)
    batch, seqlen = inputs["v"].shape[:2]
    extra = {
        "reset": random_reset(batch, seqlen) if with_reset else None,
        "initial_state": random_state(inputs) if with_state else None,
    }
    y_ref, s_ref = mamba3_mimo_scan_recurrent(**inputs, **extra)
    y, s = mamba3_mimo_scan_chunked(**inputs, **extra, chunk_size=chunk_size)
    assert y.dtype == F64 and y.shape == inputs["v"].shape
    assert s.k.shape == (batch, 3, 4, 8) and s.v.shape == (batch, 4, 4)
    assert_close_rel(y, y_ref, 1e-10)
    assert_states_close(s, s_ref, 1e-10)


def test_chunked_matches_recurrent_float32_and_per_rank_outputs():
    inputs = make_inputs(seqlen=41, dtype=torch.float32, seed=3, down=False)
    reset, state = random_reset(2, 41), random_state(inputs)
    y_ref, s_ref = mamba3_mimo_scan_recurrent(**inputs, reset=reset, initial_state=state)
    y, s = mamba3_mimo_scan_chunked(**inputs, reset=reset, initial_state=state, chunk_size=16)
    assert y.dtype == torch.float32 and y.shape == (2, 41, 3, 4, 4)  # [B, L, R, H, P]
    assert_close_rel(y, y_ref, 1e-5)
    assert_states_close(s, s_ref, 1e-5)


def test_gradients_of_every_input_and_the_initial_state_agree():
    inputs = make_inputs(seqlen=13, seed=5)
    state = random_state(inputs)
    reset = random_reset(2, 13)
    leaves = {n: t.clone().requires_grad_() for n, t in inputs.items()}
    state_leaves = Mamba3ScanState(*(t.clone().requires_grad_() for t in state.tensors()))
    weight = torch.randn(2, 13, 4, 4, generator=torch.Generator().manual_seed(9), dtype=F64)
    grads = []
    for scan, kw in ((mamba3_mimo_scan_recurrent, {}), (mamba3_mimo_scan_chunked,
                                                        {"chunk_size": 4})):
        y, final = scan(**leaves, reset=reset, initial_state=state_leaves, **kw)
        loss = (y * weight).sum() + final.ssm.square().sum() + final.k.sum()
        grads.append(torch.autograd.grad(loss, [*leaves.values(), *state_leaves.tensors()]))
    names = [*leaves, "state.angle", "state.ssm", "state.k", "state.v"]
    for name, g_ref, g in zip(names, *grads, strict=True):
        assert g_ref.abs().max() > 0 or name == "state.angle", name
        assert_close_rel(g, g_ref, 1e-9)


def test_two_tokens_by_hand():
    """The recurrence written out for L = 2, one head, rank 2, no rotation left after
    zero angles, no reset: h_1 = gamma_0 sum_r v_0r k_0r^T; h_2 = alpha_1 h_1 + beta_1 sum_r
    v_0r k_0r^T + gamma_1 sum_r v_1r k_1r^T; y_tr = (h_t q_tr + D v_tr) silu(z_tr)."""
    inputs = make_inputs(batch=1, seqlen=2, rank=2, groups=1, nheads=1, seed=7, down=False)
    inputs["angles"] = torch.full_like(inputs["angles"], 0.0)
    y, _ = mamba3_mimo_scan_recurrent(**inputs)
    q = inputs["q"][0, :, :, 0] + inputs["q_bias"][0]  # [2, R, N]
    k = inputs["k"][0, :, :, 0] + inputs["k_bias"][0]
    v = inputs["v"][0, :, 0, None, :] * inputs["mimo_v"][0]  # [2, R, P]
    zr = inputs["z"][0, :, 0, None, :] * inputs["mimo_z"][0]
    dt, adt = inputs["dt"][0, :, 0], inputs["adt"][0, :, 0]
    lam = torch.sigmoid(inputs["trap"][0, :, 0])
    kv0 = sum(torch.outer(v[0, r], k[0, r]) for r in range(2))
    kv1 = sum(torch.outer(v[1, r], k[1, r]) for r in range(2))
    h0 = lam[0] * dt[0] * kv0
    h1 = torch.exp(adt[1]) * h0 + (1 - lam[1]) * dt[1] * torch.exp(adt[1]) * kv0 \
        + lam[1] * dt[1] * kv1
    D = inputs["D"][0]
    for t, h in ((0, h0), (1, h1)):
        for r in range(2):
            want = (h @ q[t, r] + D * v[t, r]) * F.silu(zr[t, r])
            torch.testing.assert_close(y[0, t, r, 0], want, rtol=1e-12, atol=1e-12)


def test_rank_one_is_the_siso_scan_with_half_pairs():
    """At R = 1 with unit projections the MIMO scan is the SISO scan; the MIMO pairing
    (i, i + N/2) is the SISO pairing (2i, 2i + 1) after a permutation of the N dims."""
    inputs = make_inputs(rank=1, seqlen=17, seed=11)
    ones = torch.ones_like(inputs["mimo_v"])
    inputs.update(mimo_v=ones, mimo_z=ones, mimo_o=ones)
    reset = random_reset(2, 17)
    y, s = mamba3_mimo_scan_recurrent(**inputs, reset=reset)
    n = inputs["q"].shape[-1]
    to_siso = torch.argsort(torch.cat([torch.arange(0, n, 2), torch.arange(1, n, 2)]))
    siso = {name: inputs[name] for name in ("v", "adt", "dt", "trap", "angles", "D", "z")}
    siso.update(q=inputs["q"][:, :, 0][..., to_siso], k=inputs["k"][:, :, 0][..., to_siso],
                q_bias=inputs["q_bias"][:, 0][..., to_siso],
                k_bias=inputs["k_bias"][:, 0][..., to_siso])
    y_siso, s_siso = mamba3_scan_recurrent(**siso, reset=reset)
    torch.testing.assert_close(y, y_siso, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(s.ssm[..., to_siso], s_siso.ssm, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("seqlen,chunk", [(64, 16), (40, 16)])
def test_flops_per_token_matches_flop_counter(seqlen, chunk):
    inputs = make_inputs(seqlen=seqlen, dtype=torch.float32, seed=2)
    with FlopCounterMode(display=False) as counter:
        mamba3_mimo_scan_chunked(**inputs, chunk_size=chunk)
    measured = counter.get_total_flops() / (2 * seqlen)
    assert flops_per_token(seqlen, chunk, 4, 4, 8, 3) == pytest.approx(measured, rel=0.01)


def test_bad_inputs_are_named():
    inputs = make_inputs(seqlen=5)
    with pytest.raises(ValueError, match=r"mimo_v has shape \(4, 2, 4\)"):
        mamba3_mimo_scan_chunked(**{**inputs, "mimo_v": inputs["mimo_v"][:, :2]})
    with pytest.raises(ValueError, match="z and mimo_z come together"):
        mamba3_mimo_scan_recurrent(**{**inputs, "mimo_z": None})
    with pytest.raises(ValueError, match="initial_state.k has shape"):
        bad = random_state(inputs)
        bad.k = bad.k[:, :1]
        mamba3_mimo_scan_chunked(**inputs, initial_state=bad)


def test_float32_gradients_on_fresh_inputs_agree_with_the_recurrence():
    """The chunked form as it trains (its intermediates recomputed in backward) against the
    recurrence, float32, every input's gradient and the initial state's, resets included."""
    inputs = make_inputs(seqlen=37, dtype=torch.float32, seed=21)
    state = random_state(inputs, seed=22)
    reset = random_reset(2, 37, seed=23)
    leaves = {n: t.clone().requires_grad_() for n, t in inputs.items()}
    state_leaves = Mamba3ScanState(*(t.float().requires_grad_() for t in state.tensors()))
    weight = torch.randn(2, 37, 4, 4, generator=torch.Generator().manual_seed(24))
    results = []
    for scan, kw in ((mamba3_mimo_scan_recurrent, {}), (mamba3_mimo_scan_chunked,
                                                        {"chunk_size": 8})):
        y, final = scan(**leaves, reset=reset, initial_state=state_leaves, **kw)
        loss = (y * weight).sum() + final.ssm.square().sum() + final.k.sum()
        grads = torch.autograd.grad(loss, [*leaves.values(), *state_leaves.tensors()])
        results.append((y.detach(), final.ssm.detach(), *grads))
    for ref, got in zip(*results, strict=True):
        assert_close_rel(got, ref, 2e-5)


def test_only_the_inputs_are_kept_for_backward():
    """Under autograd the chunked form saves its inputs and nothing else (the rank-expanded
    intermediates are recomputed in backward); computed in one pass it would keep over 10x
    that. The bound is the inputs' bytes, so an intermediate kept again fails here."""
    from megacpp.kernels.ops.mamba3_mimo_scan.reference import _chunked_forward, _intra_chunk
    from megacpp.kernels.ops.mamba3_scan.reference import _pass_states
    from megacpp.kernels.recompute import saved_tensor_bytes

    inputs = make_inputs(batch=2, seqlen=64, rank=4, groups=1, nheads=4, d_state=16,
                         headdim=16, n_angles=4, dtype=torch.float32, seed=12)
    leaves = {n: t.requires_grad_() for n, t in inputs.items()}
    input_bytes = sum(t.untyped_storage().nbytes() for t in leaves.values())
    with saved_tensor_bytes() as kept:
        y, _ = mamba3_mimo_scan_chunked(**leaves, chunk_size=16)
    assert kept["bytes"] <= input_bytes
    order = ("q", "k", "v", "adt", "dt", "trap", "q_bias", "k_bias", "mimo_v", "angles",
             "mimo_z", "mimo_o", "D", "z")
    with saved_tensor_bytes() as one_pass:
        _chunked_forward(_intra_chunk, _pass_states, *(leaves[n] for n in order), None, None,
                         16, True)
    assert one_pass["bytes"] > 10 * input_bytes
    y.sum().backward()  # what was kept is enough
    assert all(t.grad is not None for t in leaves.values())
