"""The nam56r-cut13 preset: 1 MLA + 3 DSA + 4 MoE + 4 Mamba-3/recurrent + 1 MTP."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from megacpp.model.cache import LockstepCache
from megacpp.model.config import ModelConfig, load_config
from megacpp.model.counting import count_model
from megacpp.model.model import HybridLM, next_token_labels
from megacpp.pattern import load
from tests.model.conftest import small_config


def small_cut13() -> ModelConfig:
    """The preset's pattern, MTP and DSA mode at test width (top-k 5 < the test rows)."""
    data = load_config("nam56r-cut13").to_dict()
    small = small_config().to_dict()
    for table in ("attention", "mamba", "rnn", "moe", "mlp"):
        data[table] = small[table]
    data["model"].update(vocab_size=97, d_model=32)
    data["mla"].update(
        n_heads=4, q_lora_rank=12, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4,
        v_head_dim=6,
    )  # fmt: skip
    data["dsa"].update(index_n_heads=16, index_head_dim=8, top_k=5, query_chunk=4)
    return ModelConfig.from_dict(data)


def _model(dtype=torch.float64):
    torch.manual_seed(0)
    return HybridLM(small_cut13()).to(dtype).eval()


def _tokens(B, L, seed=1):
    return torch.randint(0, 97, (B, L), generator=torch.Generator().manual_seed(seed))


def test_preset_is_the_13_layer_cut():
    cfg = load_config("nam56r-cut13")
    plan = load(cfg.pattern)
    assert plan.label_counts == {"A:mla": 1, "E": 4, "M:siso": 3, "A:dsa": 3, "R": 1}
    assert cfg.mtp.depth == 1 and cfg.dsa.mode == "sparse"
    cost = count_model(cfg)
    assert len(cost.layers) == 13 and cost.layers[-1].letter == "mtp1[A:mlaE]"
    attention = [layer for layer in cost.layers if layer.family == "A"]
    assert all(a.cache_bytes_per_token < a.gqa_cache_bytes_per_token for a in attention)
    assert cost.cache_bytes_per_token == (128 + 32) * 2 + 3 * (128 + 32 + 64) * 2


def test_small_cut13_forward_backward_reaches_every_parameter():
    model = _model(torch.float32).train()
    ids = _tokens(2, 16)
    doc_ids = torch.tensor([[0] * 9 + [1] * 7, [0] * 16])
    out = model(ids, doc_ids=doc_ids, labels=next_token_labels(ids, doc_ids))
    assert out.logits.shape == (2, 16, 97) and len(out.mtp_logits) == 1
    for loss in (out.loss, out.lm_loss, out.aux_loss, out.mtp_loss):
        assert loss.ndim == 0 and torch.isfinite(loss)
    out.loss.backward()
    missing = [n for n, p in model.named_parameters() if p.grad is None or p.grad.abs().sum() == 0]
    assert not missing, missing


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-9), (torch.float32, 2e-4)])
def test_small_cut13_paged_decode_reproduces_full_forward(dtype, tol):
    model = _model(dtype)
    ids = _tokens(2, 14)
    full = model(ids).logits
    cache = LockstepCache(model, 2, 14, dtype=dtype, block_size=4)
    prefill = model.forward_paged(ids[:, :6], cache.layers, cache.advance(6), all_positions=True)
    steps = [model.forward_paged(ids[:, t : t + 1], cache.layers, cache.advance(1))
             for t in range(6, 14)]
    torch.testing.assert_close(
        torch.cat([prefill, torch.stack(steps, 1)], 1), full, rtol=tol, atol=tol
    )
    cached = {b.family for b, pool in zip(model.blocks, cache.layers, strict=True) if pool}
    assert cached == {"A", "M", "R"}


def test_small_cut13_greedy_generation_matches_full_forward_argmax():
    model = _model()
    seq = model.generate_greedy(_tokens(2, 5), max_new_tokens=8)
    assert torch.equal(seq[:, 5:], model(seq[:, :-1]).logits[:, 4:].argmax(-1))


def test_small_cut13_counts_match_the_real_model_and_flop_counter():
    cfg = small_cut13()
    model = HybridLM(cfg).train()
    seq_len, batch = 16, 2
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter, torch.no_grad():
        model(_tokens(batch, seq_len))
    cost = count_model(cfg, seq_len=seq_len)
    assert cost.params == sum(p.numel() for p in model.parameters())
    measured = counter.get_flop_counts()
    for layer in cost.layers[:-1]:
        got = sum(measured[f"HybridLM.blocks.{layer.index}"].values()) / (batch * seq_len)
        assert got == pytest.approx(layer.fwd_flops_per_token, rel=0.05), layer
    total = sum(measured["Global"].values()) / (batch * seq_len)
    assert total == pytest.approx(cost.fwd_flops_per_token, rel=0.05)


def test_model_describe_shows_the_preset_and_the_cache_comparison():
    from typer.testing import CliRunner

    from megacpp.cli.model import app

    table = CliRunner().invoke(app, ["describe", "--config", "nam56r-cut13"])
    assert table.exit_code == 0, table.output
    for needle in ("A:mla", "A:dsa", "mtp1[A:mlaE]", "320 B", "448 B", "nam56r-cut13"):
        assert needle in table.output, needle
    cmd = ["model", "describe", "--config", "nam56r-cut13", "--json"]  # the real entry point
    out = subprocess.run(
        [sys.executable, "-m", "megacpp", *cmd], capture_output=True, text=True, check=False
    )
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    assert len(data["layers"]) == 13
    assert data["totals"]["cache_bytes_per_token"] == 1664
    assert data["totals"]["gqa_cache_bytes_per_token"] == 4 * 512  # 4 A layers as A:gqa
