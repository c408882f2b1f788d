"""Mamba3Mixer: packing, causality, prefill/decode against the full forward, grads, FLOPs."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

from megacpp.errors import ConfigError
from megacpp.model.mamba3 import Mamba3Mixer

F64 = torch.float64
CONFIG = {"d_model": 32, "d_state": 16, "headdim": 8, "expand": 2, "ngroups": 2,
          "chunk_size": 8, "init_std": 0.2}


def make_mixer(dtype=F64, seed=0, **overrides) -> Mamba3Mixer:
    torch.manual_seed(seed)
    return Mamba3Mixer(**{**CONFIG, **overrides}).to(dtype)


def make_x(batch=2, seqlen=21, dtype=F64, seed=1) -> torch.Tensor:
    return torch.randn(batch, seqlen, CONFIG["d_model"], dtype=dtype,
                       generator=torch.Generator().manual_seed(seed))


def test_forward_shape_and_dtype():
    mixer = make_mixer(torch.float32)
    y = mixer(make_x(dtype=torch.float32))
    assert y.shape == (2, 21, 32) and y.dtype == torch.float32
    assert torch.isfinite(y).all()


def test_bf16_autocast_norms_b_and_c_with_matching_dtypes(monkeypatch):
    """Under bf16 autocast the B/C projections are bf16 and the norm weights float32: every
    rms_norm the mixer calls must get one dtype for input and weight (torch's nn.RMSNorm with
    a float32 weight on bf16 input falls back to its unfused composite on CUDA); the output
    norm runs in float32 and applies its weight itself."""
    calls = []
    real = F.rms_norm

    def spy(x, shape, weight=None, eps=None):
        calls.append((x.dtype, None if weight is None else weight.dtype))
        return real(x, shape, weight, eps)

    monkeypatch.setattr(F, "rms_norm", spy)
    mixer = make_mixer(torch.float32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = mixer(make_x(dtype=torch.float32))
    assert y.dtype == torch.bfloat16 and torch.isfinite(y.float()).all()
    assert len(calls) == 3, calls
    assert all(x == w == torch.float32 for x, w in calls[:2]), calls  # B and C
    assert calls[2] == (torch.float32, None), calls  # the output norm


def test_output_norm_is_the_written_out_expression():
    """rms_norm(y * silu(z)) per head * norm_weight (Mamba-2's RMSNormGated with the gate
    first and group_size = headdim), from the gated scan."""
    from megacpp.kernels.ops.mamba3_scan.reference import mamba3_scan_chunked

    mixer = make_mixer(outproj_norm=True)
    with torch.no_grad():
        mixer.norm_weight.uniform_(0.5, 1.5)
    x = make_x()
    y, _ = mamba3_scan_chunked(**mixer._scan_inputs(x), chunk_size=mixer.chunk_size)
    w = mixer.norm_weight.view(mixer.nheads, mixer.headdim)
    gated = y * torch.rsqrt(y.square().mean(-1, keepdim=True) + mixer.norm_eps) * w
    torch.testing.assert_close(mixer(x), mixer.out_proj(gated.flatten(2)))


@pytest.mark.parametrize("outproj_norm", [True, False])
def test_output_norm_bounds_the_output_whatever_the_state_holds(outproj_norm):
    """The scan output (with its D skip) is linear in the x rows of in_proj: scaling them by
    1000 scales an unnormed mixer's output by 1000 and leaves a normed one's unchanged, which
    is what keeps the residual stream bounded when A*dt nears 0 and the state sums thousands
    of inputs."""
    mixer = make_mixer(outproj_norm=outproj_norm)
    x = make_x()
    before = mixer(x).detach()
    d = mixer.d_inner
    with torch.no_grad():
        mixer.in_proj.weight[d: 2 * d] *= 1000.0
    after = mixer(x).detach()
    if outproj_norm:
        # equal up to the norm's eps (1e-5 against the unscaled output's mean square)
        torch.testing.assert_close(after, before, rtol=1e-2, atol=1e-3 * before.abs().max())
        assert mixer.norm_weight.shape == (d,)
    else:
        torch.testing.assert_close(after, before * 1000.0)
        assert mixer.norm_weight is None and "norm_weight" not in mixer.state_dict()


def test_doc_ids_equal_running_each_document_alone():
    mixer = make_mixer()
    x = make_x(batch=2, seqlen=24)
    # row 0: boundaries mid-chunk (5) and exactly on a chunk boundary (16); row 1: one document
    lengths = [[5, 11, 8], [24]]
    doc_ids = torch.tensor([[0] * 5 + [1] * 11 + [2] * 8, [7] * 24])
    y = mixer(x, doc_ids=doc_ids)
    for row, ls in enumerate(lengths):
        start = 0
        for n in ls:
            y_alone = mixer(x[row:row + 1, start:start + n])
            torch.testing.assert_close(y[row:row + 1, start:start + n], y_alone,
                                       rtol=1e-10, atol=1e-12)
            start += n
    # without doc_ids the later documents see the earlier ones
    assert (mixer(x)[0, 5:] - y[0, 5:]).abs().max() > 1e-4


def test_causal():
    mixer = make_mixer()
    x = make_x(batch=1, seqlen=20)
    t = 9
    x2 = x.clone()
    x2[:, t] += 1.0
    y, y2 = mixer(x), mixer(x2)
    torch.testing.assert_close(y2[:, :t], y[:, :t], rtol=0, atol=1e-13)
    assert (y2[:, t] - y[:, t]).abs().max() > 1e-4
    assert (y2[:, t + 1:] - y[:, t + 1:]).abs().max() > 1e-4


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


def test_prefill_into_a_zero_cache_is_the_scan_without_initial_state():
    """A first prefill takes the catalog's backend (is_zero); it must equal continuing from
    the zero state with the reference, output and final state alike."""
    from megacpp.kernels.ops.mamba3_scan.reference import mamba3_scan_chunked

    mixer = make_mixer()
    x = make_x(batch=2, seqlen=13)
    cache = mixer.init_cache(2, dtype=F64)
    assert cache.is_zero()
    y = mixer(x, cache=cache)
    assert not cache.is_zero()
    inputs = mixer._scan_inputs(x)
    zero = mixer.init_cache(2, dtype=F64)
    y_ref, final_ref = mamba3_scan_chunked(**inputs, initial_state=zero, chunk_size=8)
    torch.testing.assert_close(y, mixer._output(y_ref), rtol=1e-12, atol=1e-13)
    for got, want in zip(cache.tensors(), final_ref.tensors(), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-13)


@pytest.mark.gpu
def test_gpu_first_prefill_uses_the_fast_scan_and_matches_the_reference():
    """Under MEGACPP_KERNELS=auto a prefill into a zero cache runs the chosen Triton scan and
    gives the reference's output and cache state (bf16); a second prefill continues it."""
    from megacpp.kernels.runtime import chosen_kernels, clear_resolutions, kernel_mode_override

    torch.manual_seed(0)
    mixer = Mamba3Mixer(d_model=256, d_state=64, headdim=32, chunk_size=32).cuda().bfloat16()
    x = torch.randn(2, 200, 256, device="cuda", dtype=torch.bfloat16)
    results = {}
    for mode in ("reference", "auto"):
        clear_resolutions()
        with kernel_mode_override(mode):
            cache = mixer.init_cache(2, device="cuda", dtype=torch.float32)
            y = torch.cat([mixer(x[:, :150], cache=cache), mixer(x[:, 150:], cache=cache)], 1)
        results[mode] = (y.float(), [t.float() for t in cache.tensors()])
        if mode == "auto":
            assert chosen_kernels()["mamba3_scan"] == "triton_chunked"
    (y_ref, s_ref), (y, s) = results["reference"], results["auto"]
    assert ((y - y_ref).norm() / y_ref.norm()).item() < 2e-2
    for a, b in zip(s, s_ref):
        assert ((a - b).norm() / b.norm()).item() < 2e-2


def test_step_with_float32_cache_on_float32_model():
    mixer = make_mixer(torch.float32)
    x = make_x(batch=1, seqlen=6, dtype=torch.float32)
    cache = mixer.init_cache(1)
    steps = torch.cat([mixer.step(x[:, t:t + 1], cache) for t in range(6)], dim=1)
    torch.testing.assert_close(steps, mixer(x), rtol=1e-4, atol=1e-5)


def test_every_parameter_gets_a_gradient():
    mixer = make_mixer(torch.float32)
    x = make_x(dtype=torch.float32)
    doc_ids = torch.zeros(2, 21, dtype=torch.long)
    doc_ids[:, 12:] = 1
    mixer(x, doc_ids=doc_ids).square().mean().backward()
    for name, p in mixer.named_parameters():
        assert p.grad is not None, name
        assert torch.isfinite(p.grad).all(), name
        assert p.grad.abs().max() > 0, name


def test_projection_is_in_proj_split_with_its_gradients():
    """The three GEMMs over row slices of in_proj's weight are in_proj(x) split (the
    definition), values and the gradients of x and the weight."""
    mixer = make_mixer()
    cots = [torch.randn(2, 21, n, dtype=F64) for n in mixer._split]
    got, want = [], []
    for out, project in ((got, mixer._project),
                         (want, lambda t: mixer.in_proj(t).split(mixer._split, dim=-1))):
        x = make_x().requires_grad_()
        pieces = project(x)
        loss = sum((p * c).sum() for p, c in zip(pieces, cots, strict=True))
        out.extend([*pieces, *torch.autograd.grad(loss, [x, mixer.in_proj.weight])])
    assert len(got) == len(want) == 10
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_in_proj_reads_the_three_copies_of_the_input():
    """With ``again`` (the pre-norm block's second and third copies of the normed input,
    INPUT_FANOUT 3) in_proj's three GEMMs read one copy each: the output is the one from x
    alone, and the three copies' gradients add up to x's gradient alone (the norm's backward
    sums them) while none carries it whole."""
    mixer = make_mixer()
    assert Mamba3Mixer.INPUT_FANOUT == 3
    doc = torch.tensor([[0] * 9 + [1] * 12, [0] * 21])
    cot = torch.randn(2, 21, CONFIG["d_model"], dtype=F64)
    x = make_x().requires_grad_()
    again = tuple(x.detach().clone().requires_grad_() for _ in range(2))
    out = mixer(x, doc_ids=doc, again=again)
    grads = torch.autograd.grad(out, [x, *again], cot)
    ref = make_x().requires_grad_()
    want = mixer(ref, doc_ids=doc)
    (d_ref,) = torch.autograd.grad(want, [ref], cot)
    torch.testing.assert_close(out, want, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(sum(grads), d_ref, rtol=1e-10, atol=1e-12)
    for g in grads:
        assert g.abs().max() > 0 and not torch.allclose(g, d_ref)


@pytest.mark.parametrize("seqlen", [64, 40])
def test_flops_per_token_matches_flop_counter(seqlen):
    mixer = make_mixer(torch.float32)
    x = make_x(batch=2, seqlen=seqlen, dtype=torch.float32)
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        mixer(x)
    measured = counter.get_total_flops() / (2 * seqlen)
    assert abs(mixer.flops_per_token(seqlen) - measured) <= 0.05 * measured


def test_cache_layout_and_bytes():
    mixer = make_mixer(torch.float32)
    cache = mixer.init_cache(3)
    H, P, N, R = mixer.nheads, 8, 16, 4  # rope_fraction 0.5 of N = 16 -> 4 rotated pairs
    assert cache.angle.shape == (3, H, R)
    assert cache.ssm.shape == (3, H, P, N)
    assert cache.k.shape == (3, H, N)
    assert cache.v.shape == (3, H, P)
    assert cache.nbytes() == mixer.state_bytes(batch=3) == 3 * H * (R + P * N + N + P) * 4
    assert mixer.init_cache(2, dtype=F64).nbytes() == mixer.state_bytes(2, F64)
    with pytest.raises(ConfigError, match="cache dtype"):
        mixer.init_cache(1, dtype=torch.bfloat16)


def test_init_matches_mamba_ssm_conventions():
    mixer = Mamba3Mixer(d_model=64, d_state=32, headdim=16)
    dt = torch.nn.functional.softplus(mixer.dt_bias)
    assert ((dt >= 1e-3 * 0.999) & (dt <= 0.1 * 1.001)).all()
    assert torch.equal(mixer.D, torch.ones(8))
    assert torch.equal(mixer.B_bias, torch.ones(8, 32)) and torch.equal(mixer.C_bias, mixer.B_bias)
    # in_proj: z, x (2 * 128), B, C (2 * 32), dd_dt, dd_A, trap (3 * 8), angles (32 * 0.5 / 2)
    assert mixer.in_proj.weight.shape == (128 + 128 + 64 + 24 + 8, 64)
    assert abs(mixer.in_proj.weight.std().item() - 0.02) < 0.002


@pytest.mark.parametrize("overrides,field", [
    ({"headdim": 7}, "headdim"),
    ({"ngroups": 3}, "ngroups"),
    ({"rope_fraction": 0.0}, "rope_fraction"),
    ({"d_state": 2, "rope_fraction": 0.5}, "rope_fraction"),
    ({"chunk_size": 0}, "chunk_size"),
])
def test_bad_config_fails_closed(overrides, field):
    with pytest.raises(ConfigError, match=field):
        Mamba3Mixer(**{**CONFIG, **overrides})


def test_bad_call_shapes_are_named():
    mixer = make_mixer()
    cache = mixer.init_cache(2, dtype=F64)
    with pytest.raises(ValueError, match=r"\[B, 1, d_model\]"):
        mixer.step(make_x(seqlen=2), cache)
    with pytest.raises(ValueError, match="doc_ids"):
        mixer(make_x(), doc_ids=torch.zeros(2, 20, dtype=torch.long))


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_gates_match_the_written_out_expression(dtype):
    """_Gates (backward from saved sigmoids and the clamp mask) against autograd of
    dt = softplus(dd_dt + bias), a = -max(softplus(dd_A), floor): values and all three
    gradients, with inputs across the clamp bound and past softplus's linear threshold."""
    from megacpp.model.mamba3 import _Gates

    g = torch.Generator().manual_seed(0)
    floor = 0.05
    dd_dt = (torch.randn(3, 40, 6, generator=g) * 8).to(dtype)  # some dd_dt + bias > 20
    dd_dt[0, 0, 0] = 30.0
    dd_a = (torch.randn(3, 40, 6, generator=g) * 3 - 2).to(dtype)  # softplus below the floor too
    bias = torch.randn(6, generator=g, dtype=torch.float64 if dtype == torch.float64 else None)
    cot = [torch.randn(3, 40, 6, generator=g, dtype=bias.dtype) for _ in range(2)]
    results = []
    for fused in (True, False):
        leaves = [t.clone().requires_grad_() for t in (dd_dt, dd_a, bias)]
        if fused:
            adt, dt = _Gates.apply(*leaves, floor)
        else:
            dt = torch.nn.functional.softplus(leaves[0].to(bias.dtype) + leaves[2])
            a = -torch.nn.functional.softplus(leaves[1].to(bias.dtype)).clamp(min=floor)
            adt = a * dt
        grads = torch.autograd.grad((adt * cot[0]).sum() + (dt * cot[1]).sum(), leaves)
        results.append([adt, dt, *grads])
    assert (dd_a.to(bias.dtype).exp().log1p() < floor).any()  # the clamp is active somewhere
    tol = 1e-12 if dtype == torch.float64 else 1e-6
    for name, got, want in zip(("adt", "dt", "d_dd_dt", "d_dd_a", "d_bias"), *results):
        assert got.dtype == want.dtype, name
        err = ((got.double() - want.double()).norm() / want.double().norm()).item()
        assert err < tol, (name, err)
