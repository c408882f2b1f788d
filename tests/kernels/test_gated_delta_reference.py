"""The gated delta rule's two reference forms agree, follow the paper's equation, reset cleanly
and count their FLOPs the way FlopCounterMode does."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

from megacpp.kernels.ops.gated_delta import (
    flops_per_token,
    gated_delta_rule_chunked,
    gated_delta_rule_recurrent,
)

B, H, K, V = 2, 3, 8, 6


def make_inputs(
    seq_len: int, dtype: torch.dtype, seed: int, *, g_scale: float = 1.0, reset_rate: float = 0.0
) -> dict[str, torch.Tensor]:
    """Random inputs in fla's layout: unit-norm keys, g <= 0, beta in (0, 1)."""
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, dtype=dtype)

    reset = torch.rand(B, seq_len, generator=gen) < reset_rate
    return {
        "q": randn(B, seq_len, H, K),
        "k": F.normalize(randn(B, seq_len, H, K), dim=-1),
        "v": randn(B, seq_len, H, V),
        "g": g_scale * F.logsigmoid(randn(B, seq_len, H)),
        "beta": torch.sigmoid(randn(B, seq_len, H)),
        "initial_state": randn(B, H, K, V),
        "reset": reset,
    }


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual - expected).abs().max() / expected.abs().max()).item()


@pytest.mark.parametrize("dtype, tol", [(torch.float64, 1e-10), (torch.float32, 1e-5)])
@pytest.mark.parametrize("chunk_size", [1, 5, 16, 64])
@pytest.mark.parametrize("with_state, reset_rate", [(False, 0.0), (True, 0.0), (True, 0.15)])
def test_chunked_matches_recurrent(dtype, tol, chunk_size, with_state, reset_rate):
    seq_len = 45  # not a multiple of 5 or 16, shorter than 64
    inputs = make_inputs(
        seq_len, dtype, seed=chunk_size * 10 + int(with_state), reset_rate=reset_rate
    )
    if not with_state:
        inputs["initial_state"] = None
    o_ref, state_ref = gated_delta_rule_recurrent(**inputs)
    o, state = gated_delta_rule_chunked(**inputs, chunk_size=chunk_size)
    assert o.dtype == dtype and o.shape == (B, seq_len, H, V)
    assert state.shape == (B, H, K, V)
    assert relative_error(o, o_ref) < tol
    assert relative_error(state, state_ref) < tol


def test_gradients_match_in_float64():
    inputs = make_inputs(23, torch.float64, seed=7, reset_rate=0.1)
    inputs["reset"][0, 9] = True  # at least one reset mid-chunk
    leaves = ["q", "k", "v", "g", "beta", "initial_state"]
    gen = torch.Generator().manual_seed(8)
    o_weight = torch.randn(B, 23, H, V, generator=gen, dtype=torch.float64)
    state_weight = torch.randn(B, H, K, V, generator=gen, dtype=torch.float64)

    def grads(op, **kwargs):
        leaf_inputs = {n: t.clone().requires_grad_(n in leaves) for n, t in inputs.items()}
        o, state = op(**leaf_inputs, **kwargs)
        ((o * o_weight).sum() + (state * state_weight).sum()).backward()
        return {n: leaf_inputs[n].grad for n in leaves}

    expected = grads(gated_delta_rule_recurrent)
    actual = grads(gated_delta_rule_chunked, chunk_size=8)
    for name in leaves:
        assert relative_error(actual[name], expected[name]) < 1e-9, name


def test_recurrent_follows_the_paper_equation():
    """S_t = alpha_t S_{t-1} (I - beta_t k_t k_t^T) + beta_t v_t k_t^T, o_t = S_t q_t * scale,
    in the paper's [V, K] orientation; our state is its transpose."""
    inputs = make_inputs(6, torch.float64, seed=3)
    q, k, v, g, beta, state0 = (inputs[n] for n in ("q", "k", "v", "g", "beta", "initial_state"))
    o, state = gated_delta_rule_recurrent(q, k, v, g, beta, initial_state=state0)

    eye = torch.eye(K, dtype=torch.float64)
    for b in range(B):
        for h in range(H):
            s = state0[b, h].T  # [V, K]
            for t in range(6):
                kt, alpha, beta_t = k[b, t, h], g[b, t, h].exp(), beta[b, t, h]
                s = alpha * s @ (eye - beta_t * torch.outer(kt, kt)) + beta_t * torch.outer(
                    v[b, t, h], kt
                )
                torch.testing.assert_close(o[b, t, h], s @ q[b, t, h] * K**-0.5)
            torch.testing.assert_close(state[b, h], s.T)


@pytest.mark.parametrize("op", [gated_delta_rule_recurrent, gated_delta_rule_chunked])
def test_reset_starts_a_fresh_document(op):
    seq_len, start = 30, 13
    inputs = make_inputs(seq_len, torch.float64, seed=11)
    inputs["reset"][:, start] = True
    o, state = op(**inputs)

    head = {n: t[:, :start] for n, t in inputs.items() if n != "initial_state"}
    tail = {n: t[:, start:] for n, t in inputs.items() if n != "initial_state"}
    o_head, _ = op(**head, initial_state=inputs["initial_state"])
    o_tail, state_tail = op(**tail)  # zero state: the reset drops everything before `start`
    torch.testing.assert_close(o[:, :start], o_head)
    torch.testing.assert_close(o[:, start:], o_tail)
    torch.testing.assert_close(state, state_tail)


def test_state_carries_across_calls():
    inputs = make_inputs(40, torch.float64, seed=5, reset_rate=0.05)
    o, state = gated_delta_rule_chunked(**inputs, chunk_size=16)
    first = {n: t[:, :17] for n, t in inputs.items() if n != "initial_state"}
    rest = {n: t[:, 17:] for n, t in inputs.items() if n != "initial_state"}
    o1, state1 = gated_delta_rule_chunked(
        **first, initial_state=inputs["initial_state"], chunk_size=16
    )
    o2, state2 = gated_delta_rule_chunked(**rest, initial_state=state1, chunk_size=16)
    torch.testing.assert_close(torch.cat([o1, o2], dim=1), o)
    torch.testing.assert_close(state2, state)


def test_extreme_decay_and_resets_stay_finite():
    """Strong decay makes in-chunk cumulative log-decays huge; resets must not turn into inf*0."""
    inputs = make_inputs(40, torch.float32, seed=2, g_scale=500.0, reset_rate=0.2)
    leaves = {n: t.clone().requires_grad_(n != "reset") for n, t in inputs.items()}
    o, state = gated_delta_rule_chunked(**leaves, chunk_size=32)
    (o.sum() + state.sum()).backward()
    assert torch.isfinite(o).all() and torch.isfinite(state).all()
    assert all(torch.isfinite(leaves[n].grad).all() for n in leaves if n != "reset")
    o_ref, _ = gated_delta_rule_recurrent(**inputs)
    assert relative_error(o.detach(), o_ref) < 1e-5


def test_low_precision_inputs_compute_in_float32():
    inputs = make_inputs(20, torch.float32, seed=4)
    o32, _state32 = gated_delta_rule_chunked(**inputs, chunk_size=8)
    bf16 = {n: t.to(torch.bfloat16) if t.is_floating_point() else t for n, t in inputs.items()}
    o, state = gated_delta_rule_chunked(**bf16, chunk_size=8)
    assert o.dtype == torch.bfloat16 and state.dtype == torch.float32
    assert relative_error(o.float(), o32) < 5e-2


@pytest.mark.parametrize("seq_len, chunk_size", [(64, 16), (45, 16), (10, 64)])
def test_flops_match_flop_counter(seq_len, chunk_size):
    inputs = make_inputs(seq_len, torch.float32, seed=0, reset_rate=0.1)
    with FlopCounterMode(display=False) as counter:
        gated_delta_rule_chunked(**inputs, chunk_size=chunk_size)
    measured = counter.get_total_flops() / (B * seq_len)
    analytic = flops_per_token(seq_len, H, K, V, chunk_size)
    assert measured > 0
    assert abs(analytic - measured) / measured < 0.05


def test_output_final_state_false_returns_none():
    inputs = make_inputs(9, torch.float32, seed=1)
    for op in (gated_delta_rule_recurrent, gated_delta_rule_chunked):
        _, state = op(**inputs, output_final_state=False)
        assert state is None


@pytest.mark.parametrize(
    "name, bad, message",
    [
        ("k", torch.zeros(B, 9, H, K + 1), "k must have shape"),
        ("g", torch.zeros(B, 9), "g must have shape"),
        ("initial_state", torch.zeros(B, H, V, K), "initial_state must have shape"),
        ("reset", torch.zeros(B, 9, dtype=torch.long), "reset must be a bool tensor"),
    ],
)
def test_rejects_mismatched_inputs(name, bad, message):
    inputs = make_inputs(9, torch.float32, seed=1)
    inputs[name] = bad
    for op in (gated_delta_rule_recurrent, gated_delta_rule_chunked):
        with pytest.raises(ValueError, match=message):
            op(**inputs)


def test_rejects_non_positive_chunk_size():
    with pytest.raises(ValueError, match="chunk_size must be a positive integer"):
        gated_delta_rule_chunked(**make_inputs(4, torch.float32, seed=1), chunk_size=0)
