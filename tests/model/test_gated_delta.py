"""GatedDeltaNetMixer: packed documents stay apart, it is causal, prefill + decode steps equal
the training forward, every parameter learns, and its FLOP / state accounting is right."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

from megacpp.errors import ConfigError
from megacpp.model.gated_delta import GatedDeltaNetMixer, short_causal_conv

D_MODEL, N_HEADS, HEAD_K, HEAD_V = 24, 2, 8, 12


def make_mixer(seed: int = 0, chunk_size: int = 8, dtype: torch.dtype = torch.float64):
    torch.manual_seed(seed)
    return GatedDeltaNetMixer(
        d_model=D_MODEL,
        n_heads=N_HEADS,
        head_k_dim=HEAD_K,
        head_v_dim=HEAD_V,
        chunk_size=chunk_size,
    ).to(dtype)


def random_x(batch: int, seq_len: int, seed: int, dtype: torch.dtype = torch.float64):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(batch, seq_len, D_MODEL, generator=gen, dtype=dtype)


def doc_ids_from_lengths(lengths: list[int]) -> torch.Tensor:
    return torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))


def test_packed_documents_equal_each_document_alone():
    mixer = make_mixer()
    rows = [[5, 1, 11, 3], [2, 9, 9]]  # boundaries land mid-chunk and mid-conv-window
    x = random_x(2, 20, seed=1)
    doc_ids = torch.stack([doc_ids_from_lengths(r) for r in rows])
    y = mixer(x, doc_ids=doc_ids)
    for b, lengths in enumerate(rows):
        start = 0
        for n in lengths:
            alone = mixer(x[b : b + 1, start : start + n])
            torch.testing.assert_close(y[b : b + 1, start : start + n], alone)
            start += n


def test_is_causal():
    mixer = make_mixer()
    x = random_x(1, 19, seed=2)
    x_changed = x.clone()
    x_changed[:, 11] += 1.0
    y, y_changed = mixer(x), mixer(x_changed)
    torch.testing.assert_close(y[:, :11], y_changed[:, :11])
    assert not torch.allclose(y[:, 11], y_changed[:, 11])


@pytest.mark.parametrize("prefill_len", [1, 3, 9])
def test_prefill_then_steps_equal_forward(prefill_len):
    mixer = make_mixer(chunk_size=4)
    seq_len = 14
    x = random_x(2, seq_len, seed=3)
    # Row 1 starts its last document at the prefill's last token: the cached conv tail must
    # not leak the earlier document into the decode steps.
    doc_ids = torch.tensor(
        [[0] * seq_len, [0] * (prefill_len - 1) + [1] * (seq_len - prefill_len + 1)]
    )
    y_full = mixer(x, doc_ids=doc_ids)

    cache = mixer.init_cache(2, x.device, dtype=torch.float64)
    outputs = [mixer(x[:, :prefill_len], doc_ids=doc_ids[:, :prefill_len], cache=cache)]
    outputs += [mixer.step(x[:, t : t + 1], cache) for t in range(prefill_len, seq_len)]
    torch.testing.assert_close(torch.cat(outputs, dim=1), y_full)


def test_prefill_in_pieces_equals_one_prefill():
    mixer = make_mixer()
    x = random_x(1, 13, seed=4)
    doc_ids = torch.tensor([[0] * 6 + [1] * 7])
    cache_whole = mixer.init_cache(1, "cpu", dtype=torch.float64)
    y_whole = mixer(x, doc_ids=doc_ids, cache=cache_whole)

    cache = mixer.init_cache(1, "cpu", dtype=torch.float64)
    pieces = [(0, 1), (1, 7), (7, 8), (8, 13)]  # includes L == 1 prefills and a reset
    y = torch.cat(
        [mixer(x[:, a:b], doc_ids=doc_ids[:, a:b], cache=cache) for a, b in pieces], dim=1
    )
    torch.testing.assert_close(y, y_whole)
    torch.testing.assert_close(cache.state, cache_whole.state)
    torch.testing.assert_close(cache.conv_state, cache_whole.conv_state)


def fla_l2norm(x: torch.Tensor) -> torch.Tensor:
    return x / torch.sqrt(x.square().sum(-1, keepdim=True) + 1e-6)


def test_first_token_matches_hand_computation():
    """From an empty state the first token's memory is beta k v^T, so o = beta (k.q) scale v."""
    mixer = make_mixer()
    x = random_x(1, 1, seed=5)
    H, K, V = N_HEADS, HEAD_K, HEAD_V
    qkv, gate, _a, b = mixer.in_proj(x[0, 0]).split([mixer.conv_dim, mixer.value_dim, H, H])
    qkv = F.silu(mixer.conv_weight[:, -1] * qkv)  # only the current-token tap sees data
    q, k, v = qkv.split([H * K, H * K, H * V])
    q, k, v = fla_l2norm(q.view(H, K)), fla_l2norm(k.view(H, K)), v.view(H, V)
    beta = torch.sigmoid(b)
    o = (beta * (q * k).sum(-1) * K**-0.5)[:, None] * v  # [H, V]
    o = F.rms_norm(o, (V,), mixer.norm_weight, mixer.norm_eps) * F.silu(gate.view(H, V))
    expected = mixer.o_proj(o.flatten())
    torch.testing.assert_close(mixer(x)[0, 0], expected)


def test_short_conv_matches_conv1d_on_one_document():
    gen = torch.Generator().manual_seed(6)
    x = torch.randn(2, 10, 5, generator=gen, dtype=torch.float64)
    weight = torch.randn(5, 4, generator=gen, dtype=torch.float64)
    y, tail = short_causal_conv(x, weight, None, None)
    expected = F.silu(F.conv1d(F.pad(x.transpose(1, 2), (3, 0)), weight[:, None], groups=5))
    torch.testing.assert_close(y, expected.transpose(1, 2))
    torch.testing.assert_close(tail, x[:, -3:].transpose(1, 2))


def test_short_conv_never_reads_across_documents_or_from_before_the_state():
    """Against a per-token loop: taps that reach into an earlier document (or, for the first
    document, past the conv state) read zeros; the tail keeps only the last document."""
    gen = torch.Generator().manual_seed(9)
    B, L, C, W = 2, 9, 3, 4
    x = torch.randn(B, L, C, generator=gen, dtype=torch.float64)
    weight = torch.randn(C, W, generator=gen, dtype=torch.float64)
    state = torch.randn(B, C, W - 1, generator=gen, dtype=torch.float64)
    doc_ids = torch.tensor([[0, 0, 1, 1, 1, 1, 1, 2, 2], [0] * 9])
    y, tail = short_causal_conv(x, weight, state, doc_ids)
    seq = torch.cat([state.transpose(1, 2), x], dim=1)  # [B, W-1+L, C]
    docs = torch.cat([doc_ids[:, :1].expand(B, W - 1), doc_ids], dim=1)
    expected = torch.zeros_like(x)
    for b in range(B):
        for t in range(L):
            for tap in range(W):
                src = t + tap  # index into seq; tap W-1 is the current token
                if docs[b, src] == doc_ids[b, t]:
                    expected[b, t] += weight[:, tap] * seq[b, src]
    torch.testing.assert_close(y, F.silu(expected))
    expected_tail = seq[:, -(W - 1):].transpose(1, 2).clone()
    expected_tail[0, :, :1] = 0.0  # row 0's last document (2) starts two tokens from the end
    torch.testing.assert_close(tail, expected_tail)


def test_every_parameter_gets_a_gradient():
    mixer = make_mixer(dtype=torch.float32)
    x = random_x(2, 12, seed=7, dtype=torch.float32)
    doc_ids = torch.tensor([[0] * 12, [0] * 5 + [1] * 7])
    mixer(x, doc_ids=doc_ids).square().sum().backward()
    for name, p in mixer.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, name


def test_flops_match_flop_counter():
    mixer = make_mixer(chunk_size=16, dtype=torch.float32)
    batch, seq_len = 2, 40  # ragged: 40 is not a multiple of 16
    x = random_x(batch, seq_len, seed=8, dtype=torch.float32)
    with FlopCounterMode(display=False) as counter:
        mixer(x, doc_ids=torch.zeros(batch, seq_len, dtype=torch.long))
    # the short conv is W multiply-adds per channel done elementwise (no matmul to count)
    conv = 2 * mixer.conv_dim * mixer.conv_size
    measured = counter.get_total_flops() / (batch * seq_len) + conv
    analytic = mixer.flops_per_token(seq_len)
    assert abs(analytic - measured) / measured < 0.05


def test_cache_layout_and_bytes():
    mixer = make_mixer(dtype=torch.float32)
    cache = mixer.init_cache(3, "cpu")
    conv_dim = 2 * N_HEADS * HEAD_K + N_HEADS * HEAD_V
    assert cache.state.shape == (3, N_HEADS, HEAD_K, HEAD_V)
    assert cache.conv_state.shape == (3, conv_dim, 3)
    assert (
        cache.nbytes()
        == mixer.state_bytes(batch=3)
        == 4 * 3 * (N_HEADS * HEAD_K * HEAD_V + conv_dim * 3)
    )
    assert mixer.init_cache(1, "cpu", torch.bfloat16).nbytes() == mixer.state_bytes(
        1, torch.bfloat16
    )


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"n_heads": 0}, "n_heads"),
        ({"conv_size": 2.5}, "conv_size"),
        ({"norm_eps": 0.0}, "norm_eps"),
    ],
)
def test_rejects_bad_config(kwargs, field):
    config = {"d_model": D_MODEL, "n_heads": N_HEADS, "head_k_dim": HEAD_K,
              "head_v_dim": HEAD_V} | kwargs
    with pytest.raises(ConfigError, match=field):
        GatedDeltaNetMixer(**config)


def test_rejects_mismatched_inputs():
    mixer = make_mixer()
    x = random_x(2, 6, seed=9)
    with pytest.raises(ValueError, match="doc_ids must be an integer tensor of shape"):
        mixer(x, doc_ids=torch.zeros(2, 5, dtype=torch.long))
    with pytest.raises(ValueError, match="cache.state must have shape"):
        mixer(x, cache=mixer.init_cache(1, "cpu", torch.float64))
    with pytest.raises(ValueError, match=r"step takes x of shape \[B, 1, d_model\]"):
        mixer.step(x, mixer.init_cache(2, "cpu", torch.float64))
    with pytest.raises(ValueError, match="x must be"):
        mixer(random_x(2, 6, seed=9)[..., :-1])
