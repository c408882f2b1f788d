"""The Mamba-3 scan's chunked form against its recurrent truth, and the truth against hand math."""

from __future__ import annotations

import math
from dataclasses import fields, replace

import pytest
import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

from megacpp.kernels.ops.mamba3_scan import (
    Mamba3ScanState,
    flops_per_token,
    mamba3_scan_chunked,
    mamba3_scan_recurrent,
)

F64 = torch.float64


def make_inputs(
    batch=2, seqlen=37, groups=2, nheads=4, d_state=8, headdim=4, n_angles=2,
    dtype=F64, seed=0,
) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=g, dtype=dtype)

    dt = F.softplus(randn(batch, seqlen, nheads) - 1)
    return {
        "q": F.rms_norm(randn(batch, seqlen, groups, d_state), (d_state,)),
        "k": F.rms_norm(randn(batch, seqlen, groups, d_state), (d_state,)),
        "v": randn(batch, seqlen, nheads, headdim),
        "adt": -torch.rand(batch, seqlen, nheads, generator=g, dtype=dtype) * dt,
        "dt": dt,
        "trap": randn(batch, seqlen, nheads),
        "q_bias": randn(nheads, d_state),
        "k_bias": randn(nheads, d_state),
        "angles": 2 * randn(batch, seqlen, nheads, n_angles),
        "D": randn(nheads),
        "z": randn(batch, seqlen, nheads, headdim),
    }


def random_state(inputs, seed=1) -> Mamba3ScanState:
    g = torch.Generator().manual_seed(seed)
    batch, _, nheads, headdim = inputs["v"].shape
    d_state, n_angles = inputs["q"].shape[-1], inputs["angles"].shape[-1]
    dtype = inputs["v"].dtype
    return Mamba3ScanState(
        angle=torch.rand(batch, nheads, n_angles, generator=g, dtype=dtype) * 2 * math.pi,
        ssm=torch.randn(batch, nheads, headdim, d_state, generator=g, dtype=dtype),
        k=torch.randn(batch, nheads, d_state, generator=g, dtype=dtype),
        v=torch.randn(batch, nheads, headdim, generator=g, dtype=dtype),
    )


def random_reset(batch, seqlen, seed=2) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    reset = torch.rand(batch, seqlen, generator=g) < 0.15
    reset[0, 0] = True  # a reset on the very first token drops the initial state
    reset[-1, 8] = True  # one exactly on a chunk boundary for chunk sizes 1, 4, 8
    return reset


def assert_close_rel(actual, expected, rel):
    scale = expected.abs().max().clamp(min=1.0)
    torch.testing.assert_close(actual, expected, rtol=rel, atol=rel * scale)


def assert_states_close(actual: Mamba3ScanState, expected: Mamba3ScanState, rel):
    # angles live on a circle: compare the wrapped difference
    wrapped = torch.remainder(actual.angle - expected.angle + math.pi, 2 * math.pi) - math.pi
    assert wrapped.abs().max() <= rel * 2 * math.pi
    for a, e in zip(actual.tensors()[1:], expected.tensors()[1:], strict=True):
        assert_close_rel(a, e, rel)


def slice_time(inputs, start, stop):
    per_token = {"q", "k", "v", "adt", "dt", "trap", "angles", "z"}
    return {n: (t[:, start:stop] if n in per_token else t) for n, t in inputs.items()}


@pytest.mark.parametrize("chunk_size", [1, 4, 8, 16, 64])
@pytest.mark.parametrize("with_reset", [False, True])
@pytest.mark.parametrize("with_state", [False, True])
def test_chunked_matches_recurrent_float64(chunk_size, with_reset, with_state):
    inputs = make_inputs(seed=chunk_size)
    batch, seqlen = inputs["v"].shape[:2]
    extra = {
        "reset": random_reset(batch, seqlen) if with_reset else None,
        "initial_state": random_state(inputs) if with_state else None,
    }
    y_ref, s_ref = mamba3_scan_recurrent(**inputs, **extra)
    y, s = mamba3_scan_chunked(**inputs, **extra, chunk_size=chunk_size)
    assert y.dtype == F64 and y.shape == inputs["v"].shape
    assert_close_rel(y, y_ref, 1e-10)
    assert_states_close(s, s_ref, 1e-10)


@pytest.mark.parametrize("chunk_size", [7, 32])
def test_chunked_matches_recurrent_float32(chunk_size):
    inputs = make_inputs(seqlen=53, dtype=torch.float32, seed=3)
    reset = random_reset(2, 53)
    state = random_state(inputs)
    y_ref, s_ref = mamba3_scan_recurrent(**inputs, reset=reset, initial_state=state)
    y, s = mamba3_scan_chunked(**inputs, reset=reset, initial_state=state, chunk_size=chunk_size)
    assert y.dtype == torch.float32
    assert_close_rel(y, y_ref, 1e-5)
    assert_states_close(s, s_ref, 1e-5)


def test_optional_skip_and_gate_match():
    inputs = make_inputs(seqlen=11, seed=4)
    inputs.update(D=None, z=None)
    y_ref, _ = mamba3_scan_recurrent(**inputs)
    y, _ = mamba3_scan_chunked(**inputs, chunk_size=4)
    assert_close_rel(y, y_ref, 1e-10)


@pytest.mark.parametrize("scan", [mamba3_scan_recurrent, mamba3_scan_chunked])
def test_final_state_continues_the_sequence(scan):
    inputs = make_inputs(seqlen=30, seed=5)
    y_full, s_full = scan(**inputs)
    y_a, s_a = scan(**slice_time(inputs, 0, 13))
    y_b, s_b = scan(**slice_time(inputs, 13, 30), initial_state=s_a)
    assert_close_rel(torch.cat([y_a, y_b], dim=1), y_full, 1e-10)
    assert_states_close(s_b, s_full, 1e-10)


def test_chunked_without_final_state_returns_none_and_the_same_y():
    inputs = make_inputs(seqlen=30, seed=7)
    y, state = mamba3_scan_chunked(**inputs, chunk_size=8)
    y_only, none = mamba3_scan_chunked(**inputs, chunk_size=8, output_final_state=False)
    assert none is None and state is not None
    assert torch.equal(y_only, y)


@pytest.mark.parametrize("scan", [mamba3_scan_recurrent, mamba3_scan_chunked])
def test_reset_isolates_documents_including_angles(scan):
    """After a reset the output equals the new document run alone from a zero state, although
    the packed row arrives there with an accumulated angle and a non-zero initial state."""
    inputs = make_inputs(batch=1, seqlen=29, seed=6)
    start = 11
    reset = torch.zeros(1, 29, dtype=torch.bool)
    reset[0, start] = True
    y, _ = scan(**inputs, reset=reset, initial_state=random_state(inputs))
    y_alone, _ = scan(**slice_time(inputs, start, 29))
    assert_close_rel(y[:, start:], y_alone, 1e-10)
    # and the reset really matters: without it the suffix differs
    y_no_reset, _ = scan(**inputs, initial_state=random_state(inputs))
    assert (y_no_reset[:, start:] - y_alone).abs().max() > 1e-3


def test_recurrent_matches_hand_computed_two_tokens():
    """Pins the semantics (trapezoid weights, rotation direction, bias, skip, gate) on H=1,
    N=4 with one rotated pair, P=1, written out without the reference's helpers."""
    inputs = make_inputs(batch=1, seqlen=2, groups=1, nheads=1, d_state=4, headdim=1,
                         n_angles=1, seed=7)
    y, state = mamba3_scan_recurrent(**inputs)

    def rot(vec, theta):  # rotates dims (0, 1); dims 2, 3 untouched
        c, s = math.cos(theta), math.sin(theta)
        m = torch.eye(4, dtype=F64)
        m[0, 0], m[0, 1], m[1, 0], m[1, 1] = c, -s, s, c
        return m @ vec

    h = torch.zeros(1, 4, dtype=F64)
    theta, k_prev, v_prev, expected = 0.0, torch.zeros(4, dtype=F64), 0.0, []
    for t in range(2):
        dt = inputs["dt"][0, t, 0].item()
        lam = 1 / (1 + math.exp(-inputs["trap"][0, t, 0].item()))
        alpha = math.exp(inputs["adt"][0, t, 0].item())
        theta += math.pi * math.tanh(inputs["angles"][0, t, 0, 0].item()) * dt
        q_t = rot(inputs["q"][0, t, 0] + inputs["q_bias"][0], theta)
        k_t = rot(inputs["k"][0, t, 0] + inputs["k_bias"][0], theta)
        v_t = inputs["v"][0, t, 0, 0].item()
        h = alpha * h + (1 - lam) * dt * alpha * v_prev * k_prev + lam * dt * v_t * k_t
        out = (h @ q_t).item() + inputs["D"][0].item() * v_t
        z = inputs["z"][0, t, 0, 0].item()
        expected.append(out * z / (1 + math.exp(-z)))
        k_prev, v_prev = k_t, v_t

    torch.testing.assert_close(y.flatten(), torch.tensor(expected, dtype=F64), rtol=1e-12, atol=0)
    torch.testing.assert_close(state.ssm[0, 0], h, rtol=1e-12, atol=0)
    torch.testing.assert_close(state.k[0, 0], k_prev, rtol=1e-12, atol=0)


def test_gradients_chunked_match_recurrent():
    inputs = make_inputs(batch=1, seqlen=13, seed=8)
    state = random_state(inputs)
    reset = torch.zeros(1, 13, dtype=torch.bool)
    reset[0, 6] = True
    leaves = list(inputs.values()) + list(state.tensors())

    def grads(scan, **kw):
        xs = [t.detach().clone().requires_grad_() for t in leaves]
        named = dict(zip(inputs, xs[: len(inputs)]))
        y, final = scan(**named, reset=reset, initial_state=Mamba3ScanState(*xs[len(inputs):]),
                        **kw)
        w = torch.randn(y.shape, generator=torch.Generator().manual_seed(9), dtype=F64)
        loss = (y * w).sum() + final.ssm.square().sum() + final.k.sum() + final.angle.sum()
        return torch.autograd.grad(loss, xs)

    for g_chunk, g_ref, name in zip(
        grads(mamba3_scan_chunked, chunk_size=4), grads(mamba3_scan_recurrent),
        list(inputs) + [f"initial_state.{f.name}" for f in fields(Mamba3ScanState)],
    ):
        assert g_ref.abs().max() > 0, name
        assert_close_rel(g_chunk, g_ref, 1e-9)


@pytest.mark.parametrize("seqlen,chunk_size", [(64, 16), (50, 16), (40, 64)])
def test_flops_per_token_matches_flop_counter(seqlen, chunk_size):
    inputs = make_inputs(batch=2, seqlen=seqlen, nheads=4, d_state=16, headdim=8, n_angles=4,
                         dtype=torch.float32)
    with FlopCounterMode(display=False) as counter:
        mamba3_scan_chunked(**inputs, chunk_size=chunk_size)
    measured = counter.get_total_flops() / (2 * seqlen)
    predicted = flops_per_token(seqlen, chunk_size, nheads=4, headdim=8, d_state=16)
    assert measured > 0
    assert abs(predicted - measured) <= 0.05 * measured


def test_bad_shapes_are_named():
    inputs = make_inputs(seqlen=5)
    with pytest.raises(ValueError, match="dt has shape"):
        mamba3_scan_chunked(**{**inputs, "dt": inputs["dt"][:, :4]})
    with pytest.raises(ValueError, match="initial_state.ssm"):
        state = random_state(inputs)
        mamba3_scan_recurrent(**inputs, initial_state=replace(state, ssm=state.ssm[..., :3]))
    with pytest.raises(ValueError, match="reset must be a bool"):
        mamba3_scan_chunked(**inputs, reset=torch.zeros(2, 5, dtype=torch.long))
