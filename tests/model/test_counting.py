"""Analytic counts vs. the real modules and vs. torch's FlopCounterMode.

FlopCounterMode has no FLOP formula for SDPA's CPU flash kernel, so the validation forces
SDPA's math backend, whose bmm's it does count (same QK^T and AV work).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from megacpp.model.config import list_presets, load_config
from megacpp.model.counting import _ShapesOnly, count_model
from megacpp.model.model import HybridLM
from tests.model.conftest import small_config


def test_param_counts_match_independent_formulas_and_the_real_model():
    cfg = small_config("AEDMR")
    cost = count_model(cfg, seq_len=64)
    D, a, e = cfg.d_model, cfg.attention, cfg.moe
    layer = {c.family: c for c in cost.layers}
    norm = D  # each sublayer's pre-norm
    attn = D * (a.n_heads + 2 * a.n_kv_heads) * a.head_dim + a.n_heads * a.head_dim * D
    assert layer["A"].params == norm + attn + 2 * a.head_dim  # + QK-norm weights
    expert = 3 * D * e.expert_ffn
    moe = D * e.n_experts + e.n_experts * expert + e.n_shared_experts * expert
    assert layer["E"].params == norm + moe
    assert layer["E"].active_params == layer["E"].params - (e.n_experts - e.top_k) * expert
    assert layer["D"].params == norm + 3 * D * cfg.mlp.ffn
    real = HybridLM(cfg)
    assert cost.params == sum(p.numel() for p in real.parameters())


@pytest.mark.parametrize("preset", list_presets())
@pytest.mark.parametrize("pattern", [None, "A:gqa E M R D", "A:mla A:dsa E"])
def test_counting_without_initialisation_counts_what_a_built_model_holds(preset, pattern):
    """count_model builds the module tree with its initialisation skipped (_ShapesOnly);
    every parameter and buffer a normally built tree holds is counted all the same."""
    cfg = load_config(preset)
    if pattern is not None:
        cfg = dataclasses.replace(cfg, pattern=pattern)
    with torch.device("meta"):
        built = HybridLM(cfg)
        with _ShapesOnly():
            skipped = HybridLM(cfg)
    shapes = {name: t.shape for name, t in [*built.named_parameters(), *built.named_buffers()]}
    assert shapes == {name: t.shape for name, t in [*skipped.named_parameters(),
                                                    *skipped.named_buffers()]}
    assert count_model(cfg).params == sum(p.numel() for p in built.parameters())


@pytest.mark.parametrize("pattern", ["AEMRD", "NAM56R"])
def test_flops_match_flop_counter_within_5_percent(pattern):
    cfg = small_config(pattern)
    seq_len, batch = 32, 2
    model = HybridLM(cfg).eval()
    ids = torch.randint(0, cfg.vocab_size, (batch, seq_len))
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter, torch.no_grad():
        model(ids)
    measured = counter.get_flop_counts()
    cost = count_model(cfg, seq_len=seq_len)
    tokens = batch * seq_len
    for layer in cost.layers:
        got = sum(measured[f"HybridLM.blocks.{layer.index}"].values()) / tokens
        assert got == pytest.approx(layer.fwd_flops_per_token, rel=0.05), layer
    total = sum(measured["Global"].values()) / tokens
    assert total == pytest.approx(cost.fwd_flops_per_token, rel=0.05)
    assert cost.train_flops_per_token == 3 * cost.fwd_flops_per_token


def test_presets_hit_their_advertised_sizes():
    sizes = {
        name: count_model(load_config(name)).params
        for name in ("tiny", "nam56r-small", "nam56r-350m", "nam56r-1b")
    }
    assert 2e6 <= sizes["tiny"] <= 5e6
    assert sizes["nam56r-small"] == pytest.approx(125e6, rel=0.05)
    assert sizes["nam56r-350m"] == pytest.approx(350e6, rel=0.05)
    assert sizes["nam56r-1b"] == pytest.approx(1e9, rel=0.05)


def test_attention_cache_bytes_and_recurrent_state():
    cost = count_model(load_config("tiny"))
    a = load_config("tiny").attention
    per_attn = 2 * a.n_kv_heads * a.head_dim * 2  # K and V in bf16
    n_attn = sum(layer.family == "A" for layer in cost.layers)
    assert cost.cache_bytes_per_token == n_attn * per_attn
    assert all((layer.state_bytes > 0) == (layer.family in "MR") for layer in cost.layers)
