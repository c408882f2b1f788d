"""Mamba3MimoMixer: chunked forward == recurrent scan (values and gradients), prefill/decode
against the full forward, packing, causality, FLOPs, cache, init and config."""

from __future__ import annotations

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from megacpp.errors import ConfigError
from megacpp.model.blocks import build_mixer
from megacpp.model.config import ModelConfig
from megacpp.model.mamba3_mimo import Mamba3MimoMixer
from tests.model.conftest import small_config

F64 = torch.float64
CONFIG = {"d_model": 32, "d_state": 16, "headdim": 8, "expand": 2, "ngroups": 2,
          "chunk_size": 8, "init_std": 0.2, "mimo_rank": 3}


def make_mixer(dtype=F64, seed=0, perturb=True, **overrides) -> Mamba3MimoMixer:
    """A mixer whose per-rank parameters differ (the init makes every rank the same copy)."""
    torch.manual_seed(seed)
    mixer = Mamba3MimoMixer(**{**CONFIG, **overrides}).to(dtype)
    if perturb:
        with torch.no_grad():
            for p in (mixer.mimo_x, mixer.mimo_z, mixer.mimo_o, mixer.B_bias, mixer.C_bias,
                      mixer.D):
                p.add_(0.3 * torch.randn_like(p))
            if mixer.norm_weight is not None:
                mixer.norm_weight.add_(0.3 * torch.randn_like(mixer.norm_weight))
    return mixer


def make_x(batch=2, seqlen=21, dtype=F64, seed=1) -> torch.Tensor:
    return torch.randn(batch, seqlen, CONFIG["d_model"], dtype=dtype,
                       generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("outproj_norm", [True, False])
def test_forward_and_gradients_equal_the_recurrent_scan(outproj_norm):
    """The mixer's chunked forward against the same projections through the token-by-token
    recurrence: outputs, and the gradients of every parameter and of the input."""
    mixer = make_mixer(outproj_norm=outproj_norm)
    x = make_x().requires_grad_()
    doc_ids = torch.zeros(2, 21, dtype=torch.long)
    doc_ids[:, 13:] = 1
    weight = torch.randn(2, 21, 32, dtype=F64, generator=torch.Generator().manual_seed(5))
    results = []
    for form in ("chunked", "recurrent"):
        if form == "chunked":
            y = mixer(x, doc_ids=doc_ids)
        else:
            reset = torch.zeros(2, 21, dtype=torch.bool)
            reset[:, 13] = True
            y_scan, _ = mixer._recurrent_scan(**mixer._scan_inputs(x), reset=reset)
            y = mixer._output(y_scan)
        params = [x, *mixer.parameters()]
        results.append((y, torch.autograd.grad((y * weight).sum(), params)))
    (y, grads), (y_ref, grads_ref) = results
    torch.testing.assert_close(y, y_ref, rtol=1e-10, atol=1e-12)
    names = ["x", *(name for name, _ in mixer.named_parameters())]
    for name, g, g_ref in zip(names, grads, grads_ref, strict=True):
        assert g_ref.abs().max() > 0, name
        torch.testing.assert_close(g, g_ref, rtol=1e-9, atol=1e-11, msg=name)


@pytest.mark.parametrize("prefill_lengths", [[13], [1], [5, 9], [8, 1, 3]])
def test_prefill_then_step_equals_full_forward(prefill_lengths):
    mixer = make_mixer()
    x = make_x(batch=2, seqlen=21)
    y_full = mixer(x)
    cache = mixer.init_cache(2, dtype=F64)
    outputs, start = [], 0
    for n in prefill_lengths:  # prefill, possibly in several pieces
        outputs.append(mixer(x[:, start:start + n], cache=cache))
        start += n
    for t in range(start, 21):  # then decode token by token
        outputs.append(mixer.step(x[:, t:t + 1], cache))
    torch.testing.assert_close(torch.cat(outputs, dim=1), y_full, rtol=1e-10, atol=1e-12)


def test_doc_ids_equal_running_each_document_alone():
    mixer = make_mixer()
    x = make_x(batch=1, seqlen=20)
    doc_ids = torch.tensor([[0] * 7 + [1] * 9 + [2] * 4])
    y = mixer(x, doc_ids=doc_ids)
    for lo, hi in ((0, 7), (7, 16), (16, 20)):
        torch.testing.assert_close(y[:, lo:hi], mixer(x[:, lo:hi]), rtol=1e-10, atol=1e-12)


def test_causal():
    mixer = make_mixer()
    x = make_x(batch=1, seqlen=20)
    x2 = x.clone()
    x2[:, 9] += 1.0
    y, y2 = mixer(x), mixer(x2)
    torch.testing.assert_close(y2[:, :9], y[:, :9], rtol=0, atol=1e-13)
    assert (y2[:, 9] - y[:, 9]).abs().max() > 1e-4
    assert (y2[:, 10:] - y[:, 10:]).abs().max() > 1e-4


def test_every_parameter_gets_a_gradient_in_float32():
    mixer = make_mixer(torch.float32, perturb=False)
    mixer(make_x(dtype=torch.float32)).square().mean().backward()
    for name, p in mixer.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), name
        assert p.grad.abs().max() > 0, name


@pytest.mark.parametrize("seqlen", [64, 40])
def test_flops_per_token_matches_flop_counter(seqlen):
    mixer = make_mixer(torch.float32)
    x = make_x(batch=2, seqlen=seqlen, dtype=torch.float32)
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        mixer(x)
    measured = counter.get_total_flops() / (2 * seqlen)
    assert mixer.flops_per_token(seqlen) == pytest.approx(measured, rel=0.01)


def test_cache_layout_and_bytes():
    mixer = make_mixer(torch.float32)
    cache = mixer.init_cache(3)
    H, P, N, A, R = mixer.nheads, 8, 16, 4, 3  # rope_fraction 0.5 of N = 16 -> 4 pairs
    assert cache.angle.shape == (3, H, A)
    assert cache.ssm.shape == (3, H, P, N)
    assert cache.k.shape == (3, R, H, N)
    assert cache.v.shape == (3, H, P)
    assert cache.nbytes() == mixer.state_bytes(batch=3) == 3 * H * (A + P * N + R * N + P) * 4
    with pytest.raises(ConfigError, match="cache dtype"):
        mixer.init_cache(1, dtype=torch.bfloat16)


def test_init_matches_mamba_ssm_conventions():
    mixer = Mamba3MimoMixer(d_model=64, d_state=32, headdim=16, mimo_rank=4)
    H, R, P, N = 8, 4, 16, 32
    assert torch.equal(mixer.mimo_x, torch.full((H, R, P), 0.25))
    assert torch.equal(mixer.mimo_z, torch.ones(H, R, P))
    assert torch.equal(mixer.mimo_o, torch.full((H, R, P), 0.25))
    assert torch.equal(mixer.B_bias, torch.ones(H, R, N)) and torch.equal(mixer.C_bias,
                                                                         mixer.B_bias)
    # in_proj: z, x (2 * 128), B, C (2 * R * N), dd_dt, dd_A, trap (3 * 8), angles (32 / 4)
    assert mixer.in_proj.weight.shape == (128 + 128 + 2 * 4 * 32 + 24 + 8, 64)
    assert all(p._no_weight_decay for p in (mixer.mimo_x, mixer.mimo_z, mixer.mimo_o))


def test_built_from_the_config_by_the_pattern():
    cfg = small_config("AM:mimo")
    assert (cfg.mamba.mimo_rank, cfg.mamba.mimo_chunk_size, cfg.mamba.chunk_size) == (4, 16, 4)
    mixer = build_mixer("M", "mimo", cfg)
    assert isinstance(mixer, Mamba3MimoMixer) and mixer.mimo_rank == 4
    assert mixer.chunk_size == 16  # mimo_chunk_size; M:siso layers keep chunk_size
    assert mixer.B_bias.shape == (mixer.nheads, 4, cfg.mamba.d_state)


@pytest.mark.parametrize("rank,message", [(0, "mamba.mimo_rank = 0 is invalid"),
                                          (17, "mamba.mimo_rank = 17 is invalid")])
def test_bad_mimo_rank_is_refused_naming_the_field(rank, message):
    with pytest.raises(ConfigError, match=message):
        ModelConfig.from_dict({"model": {"pattern": "M:mimo"}, "mamba": {"mimo_rank": rank}})
    with pytest.raises(ConfigError, match="mamba.mimo_chunk_size = 0 is invalid"):
        ModelConfig.from_dict({"model": {"pattern": "M:mimo"}, "mamba": {"mimo_chunk_size": 0}})
    with pytest.raises(ConfigError, match="mimo_rank must be a positive int"):
        Mamba3MimoMixer(**{**CONFIG, "mimo_rank": 0})


def test_bad_call_shapes_are_named():
    mixer = make_mixer()
    with pytest.raises(ValueError, match=r"\[B, 1, d_model\]"):
        mixer.step(make_x(seqlen=2), mixer.init_cache(2, dtype=F64))
    with pytest.raises(ValueError, match="doc_ids"):
        mixer(make_x(), doc_ids=torch.zeros(2, 20, dtype=torch.long))


def test_training_forward_keeps_no_rank_expanded_tensor():
    """Saved-for-backward bytes per token of a training forward (float32, measured at two
    lengths) stay within the design's bound: in_proj's outputs, the B/C norms' saves, the
    gates', out_proj's input, and nothing [R, H, P] (the scan and the output norm recompute
    theirs in backward). One more [R, H, P] float32 tensor per token breaks the bound."""
    from megacpp.kernels.recompute import saved_tensor_bytes

    mixer = make_mixer(torch.float32)
    H, P, G, N, R = mixer.nheads, mixer.headdim, mixer.ngroups, mixer.d_state, mixer.mimo_rank
    saved = []
    for seqlen in (32, 64):
        x = make_x(batch=2, seqlen=seqlen, dtype=torch.float32).requires_grad_()
        with saved_tensor_bytes((x, *mixer.parameters())) as counted:
            y = mixer(x)
        y.sum().backward()  # what was kept is enough
        saved.append(counted["bytes"])
    per_token = (saved[1] - saved[0]) / (2 * 32)
    # elements: in_proj's outputs, each norm's input/output (2 x 2RGN) and rstd (2RG), the
    # gates' five [H] tensors, out_proj's input; slack of half an [R, H, P] tensor
    design = sum(mixer._split) + 2 * 2 * R * G * N + 2 * R * G + 5 * H + H * P
    assert per_token <= 4 * (design + R * H * P / 2), (per_token, design)
