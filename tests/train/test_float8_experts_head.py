"""More of the step in float8: the routed experts (``parallel.float8_experts``, torchao's float8
grouped GEMM over 16-row padded expert groups) and the LM head inside the fused cross-entropy
(``parallel.float8_head``). CPU: the knobs' validation, failing closed, the report, the
padding plan, the expert path's data movement and gradients (through a plain grouped GEMM),
the float8 head itself (``torch._scaled_mm`` runs float8 on the CPU) and the receipts'
contract field. GPU: both float8 paths against the bf16 reference, forward and backward, and
a short training run that follows bf16."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from megacpp.contract import capture_fingerprint, contract_differences, with_numerics
from megacpp.errors import ConfigError
from megacpp.kernels.ops.linear_cross_entropy.float8 import (
    E5M2,
    grad_scale,
    linear_cross_entropy_float8,
)
from megacpp.kernels.ops.linear_cross_entropy.reference import linear_cross_entropy_reference
from megacpp.kernels.ops.moe_experts.float8 import (
    ALIGN,
    moe_experts_float8,
    padded_plan,
    padded_rows,
)
from megacpp.kernels.ops.moe_experts.grouped import dispatch_plan_torch
from megacpp.kernels.ops.moe_experts.reference import moe_experts_reference
from megacpp.model.config import load_config
from megacpp.model.model import HybridLM, next_token_labels
from megacpp.receipts import read_receipt, write_receipt
from megacpp.receipts.compare import DriftError, compare_receipts
from megacpp.train.config import ParallelSection
from megacpp.train.float8 import lane_name, parse_lane, require_float8
from megacpp.train.modes import plan_execution
from tests.train.helpers import single_thread_env

CPU = torch.device("cpu")


def _cos(a: torch.Tensor, b: torch.Tensor) -> float:
    return F.cosine_similarity(a.double().flatten(), b.double().flatten(), dim=0).item()


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


# -- configuration, failing closed, receipts -------------------------------------------------
def test_the_knobs_need_the_lane_on_and_booleans():
    ParallelSection(float8="tensorwise", float8_experts=True, float8_head=True).validate()
    ParallelSection(float8="rowwise", float8_head=True).validate()
    for name in ("float8_experts", "float8_head"):
        with pytest.raises(ConfigError) as caught:
            ParallelSection(**{name: True}).validate()
        assert str(caught.value).startswith(f"parallel.{name} = True is invalid")
        assert "parallel.float8 is" in str(caught.value) and "\n" not in str(caught.value)
        with pytest.raises(ConfigError, match=f"parallel.{name} = 'yes' is invalid; allowed: "
                                              "true | false"):
            ParallelSection(float8="tensorwise", **{name: "yes"}).validate()


def test_the_lane_name_is_the_setting():
    assert lane_name("off", True, True) == "off"
    assert lane_name("tensorwise") == "tensorwise"
    assert lane_name("tensorwise", experts=True) == "tensorwise+experts"
    assert lane_name("rowwise", head=True) == "rowwise+head"
    assert lane_name("tensorwise", True, True) == "tensorwise+experts+head"
    for recipe in ("tensorwise", "rowwise"):
        for experts in (False, True):
            for head in (False, True):
                name = lane_name(recipe, experts, head)
                assert parse_lane(name) == (recipe, experts, head)
    assert parse_lane("off") == ("off", False, False)
    for bad in ("off+head", "tensorwise+head+experts", "tensorwise+", "fp8", "rowwise+mlp"):
        with pytest.raises(ConfigError, match=f"float8 setting '{re.escape(bad)}' not one of"):
            parse_lane(bad)


def test_the_cpu_stops_the_new_design_with_one_line():
    with pytest.raises(ConfigError, match="need parallel.float8"):
        require_float8("off", CPU, experts=True)
    section = ParallelSection(float8="tensorwise", float8_experts=True, float8_head=True)
    with pytest.raises(ConfigError) as caught:
        plan_execution(section, CPU, "single", 1)
    message = str(caught.value)
    assert "\n" not in message
    assert message.startswith('parallel.float8 = "tensorwise+experts+head" cannot run on this '
                               "device (cpu): needs device cuda, have cpu")
    assert "compute capability 9.0" in message and 'parallel.float8 = "off"' in message


def _receipt(tmp_path, name: str, float8: str) -> object:
    path = tmp_path / f"{name}.json"
    fingerprint = with_numerics(capture_fingerprint(), float8=float8)
    write_receipt(path, "train", {"run": name}, {"tokens_per_s": 1.0}, fingerprint=fingerprint)
    return read_receipt(path)


def test_receipts_with_and_without_the_knobs_are_other_settings(tmp_path):
    first = _receipt(tmp_path, "first", lane_name("tensorwise"))
    second = _receipt(tmp_path, "second", lane_name("tensorwise", True, True))
    experts = _receipt(tmp_path, "experts", lane_name("tensorwise", experts=True))
    with pytest.raises(DriftError,
                       match=r"numerics.float8: 'tensorwise' -> 'tensorwise\+experts\+head'"):
        compare_receipts(first, second)
    with pytest.raises(DriftError, match="numerics.float8"):
        compare_receipts(experts, second)
    again = _receipt(tmp_path, "again", "tensorwise+experts+head")
    assert compare_receipts(second, again).drift == []
    base = capture_fingerprint()
    drift = contract_differences(with_numerics(base, float8="tensorwise+head"),
                                 with_numerics(base, float8="tensorwise"))
    assert [d.field for d in drift] == ["numerics.float8"]


def test_cli_knob_without_the_lane_fails_with_one_line(tmp_path):
    cmd = [sys.executable, "-m", "megacpp", "train", "--config", "tiny-cpu", "--no-progress",
           "--set", "data.dir=unused", "--set", f"run.out_dir={tmp_path / 'run'}",
           "--set", "parallel.float8_experts=true"]
    result = subprocess.run(cmd, capture_output=True, text=True, env=single_thread_env(),
                            timeout=120, check=False)
    assert result.returncode == 2, result.stdout + result.stderr
    errors = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(errors) == 1 and errors[0].startswith(
        "error: run config tiny-cpu: parallel.float8_experts = True is invalid"), errors
    assert "Traceback" not in result.stdout + result.stderr


# -- the report ------------------------------------------------------------------------------
def _tiny(**overrides) -> HybridLM:
    torch.manual_seed(0)
    cfg = load_config("tiny")
    if overrides:
        tables = cfg.to_dict()
        for key, value in overrides.items():
            if isinstance(value, dict):
                tables[key] = {**tables[key], **value}
            else:
                tables["model"][key] = value
        cfg = type(cfg).from_dict(tables)
    return HybridLM(cfg)


def test_the_report_lists_the_float8_experts_and_head():
    pytest.importorskip("torchao")
    from megacpp.model.moe import MoE
    from megacpp.train.float8 import apply_float8

    model = _tiny(tie_embeddings=False)
    report = apply_float8(model, "tensorwise", min_dim=16, emulate=True, experts=True,
                          head=True)
    moes = [name for name, m in model.named_modules() if isinstance(m, MoE)]
    assert report.experts == moes and len(moes) == 3
    assert all(m.float8_experts for m in model.modules() if isinstance(m, MoE))
    assert report.head == ["lm_head"] and model.float8_head
    assert report.lane == "tensorwise+experts+head"
    lines = report.lines()
    assert lines[0] == (f"float8 (tensorwise+experts+head): {len(report.converted)} linear "
                        "layers converted, routed experts of 3 MoE layers, the LM head, "
                        f"{len(report.kept)} kept in bf16")
    assert ("  float8  blocks.*.mixer.w_in|out_proj x3: routed-expert grouped GEMMs (torchao "
            "float8 grouped GEMM, row-wise scales, expert groups padded to 16 rows)") in lines
    assert any(line.startswith("  float8  lm_head: the fused linear cross-entropy") for line in lines)
    kept = [name for name, _ in report.kept]
    assert "lm_head" not in kept and not any("w_in|out_proj" in name for name in kept)
    summary = report.to_dict()
    assert summary["lane"] == "tensorwise+experts+head"
    assert summary["experts"] == 3 and summary["head"] is True

    tied = _tiny()
    off = apply_float8(tied, "tensorwise", min_dim=16, emulate=True)
    assert off.lane == "tensorwise" and not off.experts and not off.head
    assert not tied.float8_head
    assert ("lm_head (tied: embed.weight)", off.kept[-1][1]) in off.kept
    assert "parallel.float8_head = true" in dict(off.kept)["lm_head (tied: embed.weight)"]


def test_shapes_the_float8_gemms_cannot_take_stay_bf16_with_why():
    pytest.importorskip("torchao")
    from megacpp.model.moe import MoE
    from megacpp.train.float8 import apply_float8

    model = _tiny(vocab_size=4100, moe={"expert_ffn": 72})
    report = apply_float8(model, "tensorwise", min_dim=16, emulate=True, experts=True,
                          head=True)
    assert report.experts == [] and report.head == [] and report.lane == "tensorwise"
    assert not model.float8_head
    assert not any(m.float8_experts for m in model.modules() if isinstance(m, MoE))
    kept = dict(report.kept)
    assert kept["blocks.1.mixer.w_in|out_proj"] == (
        "routed-expert grouped GEMMs: expert_ffn = 72 not a multiple of 16 (the float8 "
        "grouped GEMM needs them)")
    assert kept["lm_head (tied: embed.weight)"] == (
        "the LM head: vocab x d_model 4100x128 not multiples of 16 (the float8 GEMM needs "
        "them)")


# -- the padding plan and the expert path's data movement (CPU, plain grouped GEMM) ----------
def _routing(n_tokens: int, n_experts: int, k: int, gen: torch.Generator,
             skew: bool = False) -> torch.Tensor:
    scores = torch.rand(n_tokens, n_experts, generator=gen)
    if skew:  # most tokens to the first experts, some experts empty
        scores[:, : n_experts // 2] += 2.0
    return scores.topk(k, dim=-1).indices


@pytest.mark.parametrize("skew", [False, True])
def test_the_padded_plan_aligns_every_group_and_keeps_each_rows_place(skew):
    gen = torch.Generator().manual_seed(3)
    n_tokens, n_experts, k = 37, 8, 2
    expert_idx = _routing(n_tokens, n_experts, k, gen, skew)
    _, inv, ends, _ = dispatch_plan_torch(expert_idx, n_experts)
    slots, padded_ends, rows = padded_plan(expert_idx, inv, ends)
    counts = torch.bincount(expert_idx.flatten(), minlength=n_experts)
    assert padded_ends.dtype == torch.int32
    assert torch.all(padded_ends % ALIGN == 0)
    sizes = torch.diff(padded_ends.long(), prepend=torch.zeros(1, dtype=torch.long))
    aligned = ((counts + ALIGN - 1) // ALIGN * ALIGN).clamp(min=ALIGN)  # no empty group
    assert torch.equal(sizes[:-1], aligned[:-1])
    assert not skew or (counts == 0).any()  # the skewed routing leaves experts unchosen
    assert rows == padded_rows(n_tokens * k, n_experts) and padded_ends[-1] == rows
    assert sizes[-1] >= aligned[-1]  # the last group takes the spare rows
    flat = slots.flatten()
    assert flat.unique().numel() == flat.numel()  # one row per (token, choice)
    starts = padded_ends.long() - sizes
    for e in range(n_experts):  # expert e's rows: the start of its group, in sorted order
        mine = expert_idx.flatten() == e
        rows_e = flat[mine]
        assert torch.equal(rows_e.sort().values,
                           torch.arange(starts[e], starts[e] + counts[e]))
        assert torch.equal(rows_e.argsort(), inv.flatten()[mine].argsort())


def test_padded_rows_bounds_the_worst_case():
    for n_rows, n_experts in ((1, 1), (8, 8), (17, 4), (4096, 64)):
        # worst cases: every group 1 row past a multiple of 16 (or as many groups as rows),
        # the other groups empty (each still 16 rows)
        groups = min(n_rows, n_experts)
        per = n_rows // groups
        sizes = [per + (i < n_rows % groups) for i in range(groups)]
        worst = sum(max(ALIGN, -(-c // ALIGN) * ALIGN) for c in sizes)
        worst += ALIGN * (n_experts - groups)
        assert padded_rows(n_rows, n_experts) >= worst
        assert padded_rows(n_rows, n_experts) % ALIGN == 0


def _checked_grouped_mm(seen: list[torch.Tensor]):
    """torch._grouped_mm (float32) that checks what the float8 grouped GEMM requires: group
    ends multiples of 16 covering every row, the weights column-major per expert."""
    def grouped_mm(a: torch.Tensor, b_t: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
        assert ends.dtype == torch.int32 and torch.all(ends % ALIGN == 0)
        assert ends[-1] == a.shape[0]  # no row outside a group (the GEMM would not write it)
        assert a.is_contiguous() and b_t.stride(-2) == 1
        seen.append(ends)
        return torch._grouped_mm(a, b_t, offs=ends)
    return grouped_mm


def test_the_float8_expert_path_moves_rows_and_gradients_like_the_reference():
    gen = torch.Generator().manual_seed(4)
    n_tokens, d_model, ffn, n_experts, k = 45, 32, 16, 6, 2

    def leaf(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) * scale).requires_grad_()

    x, addend = leaf(n_tokens, d_model), leaf(n_tokens, d_model)
    weights = torch.rand(n_tokens, k, generator=gen).requires_grad_()
    w_in, w_out = leaf(n_experts, 2 * ffn, d_model, scale=0.2), leaf(n_experts, d_model, ffn,
                                                                     scale=0.2)
    expert_idx = _routing(n_tokens, n_experts, k, gen, skew=True)
    seen: list[torch.Tensor] = []
    inputs = (x, weights, w_in, w_out, addend)
    out = moe_experts_float8(x, expert_idx, weights, w_in, w_out, addend,
                             grouped_mm=_checked_grouped_mm(seen))
    ref = moe_experts_reference(x, expert_idx, weights, w_in, w_out, addend)
    assert len(seen) == 2 and out.shape == ref.shape
    torch.testing.assert_close(out, ref)
    dout = torch.randn(out.shape, generator=gen)
    grads = torch.autograd.grad(out, inputs, dout)
    ref_grads = torch.autograd.grad(ref, inputs, dout)
    for name, got, want in zip(("x", "weights", "w_in", "w_out", "addend"), grads, ref_grads,
                               strict=True):
        assert torch.isfinite(got).all(), name
        torch.testing.assert_close(got, want, msg=name)


# -- the float8 head (torch._scaled_mm runs float8 on the CPU) -------------------------------
def test_the_gradient_scale_fits_e5m2_for_any_count():
    top = torch.finfo(E5M2).max
    for n_kept in (1, 3, 1000, 65536, 10**7):
        inv_n = torch.tensor(1.0 / n_kept)
        scale = grad_scale(inv_n)
        assert inv_n * scale <= top / 2 and inv_n * scale > top / 4
        assert torch.log2(scale) == torch.log2(scale).round()  # a power of two


@pytest.mark.parametrize("chunk", [64, 200])
def test_the_float8_head_follows_the_fp32_reference_on_the_cpu(chunk):
    gen = torch.Generator().manual_seed(5)
    n_tokens, d_model, vocab = 200, 64, 1024
    h = torch.randn(n_tokens, d_model, generator=gen).bfloat16().requires_grad_()
    weight = (torch.randn(vocab, d_model, generator=gen) * d_model**-0.5).requires_grad_()
    labels = torch.randint(0, vocab, (n_tokens,), generator=gen)
    labels[::7] = -100
    loss = linear_cross_entropy_float8(h, weight, labels, chunk_tokens=chunk)
    dh, dw = torch.autograd.grad(loss * 3, (h, weight))
    ref = linear_cross_entropy_reference(h, weight, labels)
    ref_dh, ref_dw = torch.autograd.grad(ref * 3, (h, weight))
    assert loss.dtype == torch.float32 and dh.dtype == h.dtype and dw.dtype == weight.dtype
    if chunk == 200:  # 200 rows: not a multiple of 16, so the chunk runs in bf16
        assert abs(loss.item() - ref.item()) < 1e-3 * ref.item()
        assert _rel(dw, ref_dw) < 0.01 and _rel(dh, ref_dh) < 0.01
        return
    assert loss.item() != ref.item()  # the GEMMs did round through float8
    assert abs(loss.item() - ref.item()) < 0.01 * ref.item()
    for got, want in ((dh, ref_dh), (dw, ref_dw)):
        assert _cos(got, want) > 0.99 and _rel(got, want) < 0.06


def test_the_model_takes_the_float8_head_when_switched():
    model = _tiny()
    gen = torch.Generator().manual_seed(6)
    ids = torch.randint(0, model.cfg.vocab_size, (2, 32), generator=gen)
    h = torch.randn(2, 32, model.cfg.d_model, generator=gen)
    labels = next_token_labels(ids)
    ref_loss, ref_logits = model.lm_loss(h, labels)
    assert ref_logits is not None  # the CPU's reference path goes through the logits
    model.float8_head = True
    loss, logits = model.lm_loss(h, labels)
    assert logits is None and loss.item() != ref_loss.item()
    assert abs(loss.item() - ref_loss.item()) < 0.01 * ref_loss.item()


# -- GPU: the float8 paths against bf16, and training ----------------------------------------
def _need_float8_experts() -> None:
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("needs a CUDA GPU of sm_90 or newer")
    from megacpp.train.float8 import experts_rejection

    reason = experts_rejection(torch.device("cuda"))
    if reason is not None:
        pytest.skip(reason)


@pytest.mark.gpu
@pytest.mark.parametrize("skew", [False, True], ids=["even", "skewed"])
def test_float8_experts_follow_bf16_on_the_gpu(skew):
    _need_float8_experts()
    gen = torch.Generator().manual_seed(7)
    n_tokens, d_model, ffn, n_experts, k = 4096, 512, 256, 16, 2
    dev = torch.device("cuda")

    def leaf(*shape: int, scale: float = 1.0, dtype=torch.bfloat16) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) * scale).to(dev, dtype).requires_grad_()

    x = leaf(n_tokens, d_model)
    weights = torch.rand(n_tokens, k, generator=gen).to(dev).requires_grad_()
    w_in = leaf(n_experts, 2 * ffn, d_model, scale=d_model**-0.5, dtype=torch.float32)
    w_out = leaf(n_experts, d_model, ffn, scale=ffn**-0.5, dtype=torch.float32)
    expert_idx = _routing(n_tokens, n_experts, k, gen, skew).to(dev)
    inputs = (x, weights, w_in, w_out)
    with torch.autocast("cuda", torch.bfloat16):
        out = moe_experts_float8(x, expert_idx, weights, w_in, w_out)
    ref = moe_experts_reference(x.float(), expert_idx, weights, w_in, w_out)
    assert out.dtype == torch.bfloat16
    dout = torch.randn(out.shape, generator=gen).to(dev, torch.bfloat16)
    grads = torch.autograd.grad(out, inputs, dout)
    ref_grads = torch.autograd.grad(ref, inputs, dout.float())
    assert _cos(out, ref) > 0.99 and _rel(out, ref) < 0.08
    for name, got, want in zip(("x", "weights", "w_in", "w_out"), grads, ref_grads, strict=True):
        assert got.dtype == inputs[("x", "weights", "w_in", "w_out").index(name)].dtype, name
        assert _cos(got, want) > 0.99, name
        assert _rel(got, want) < 0.08, name


@pytest.mark.gpu
def test_float8_head_follows_bf16_on_the_gpu():
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("needs a CUDA GPU of sm_89 or newer")
    gen = torch.Generator().manual_seed(8)
    n_tokens, d_model, vocab = 4096, 1024, 32768
    dev = torch.device("cuda")
    h = torch.randn(n_tokens, d_model, generator=gen).to(dev, torch.bfloat16).requires_grad_()
    weight = (torch.randn(vocab, d_model, generator=gen) * d_model**-0.5).to(dev
                                                                            ).requires_grad_()
    labels = torch.randint(0, vocab, (n_tokens,), generator=gen).to(dev)
    labels[::11] = -100
    with torch.autocast("cuda", torch.bfloat16):
        loss = linear_cross_entropy_float8(h, weight, labels, chunk_tokens=1024)
    dh, dw = torch.autograd.grad(loss, (h, weight))
    ref = linear_cross_entropy_reference(h, weight, labels)
    ref_dh, ref_dw = torch.autograd.grad(ref, (h, weight))
    assert dh.dtype == torch.bfloat16 and dw.dtype == torch.float32
    assert loss.item() != ref.item()
    assert abs(loss.item() - ref.item()) < 0.01 * ref.item()
    for got, want in ((dh, ref_dh), (dw, ref_dw)):
        assert _cos(got, want) > 0.99 and _rel(got, want) < 0.08


def _fp8_gpu_run(tmp_path, dataset, name: str, parallel: dict):
    import io

    from rich.console import Console

    from megacpp.train.config import RunConfig
    from megacpp.train.trainer import train
    from tests.train.helpers import run_config

    cfg = RunConfig.from_dict(run_config(dataset, tmp_path / name, run={"device": "cuda"},
                                         train={"steps": 8, "micro_batch_size": 8},
                                         parallel=parallel))
    log = io.StringIO()
    return train(cfg, console=Console(file=log, width=200)), log.getvalue()


@pytest.mark.gpu
@pytest.mark.parametrize("modes", [
    {"compile": False, "cuda_graph": False, "kernels": "reference"},
    {"compile": True, "cuda_graph": True, "kernels": "auto"},  # graphs must capture them
], ids=["eager", "compiled-graphed"])
def test_float8_experts_and_head_training_follows_bf16(tmp_path, cpp_dataset, modes):
    from tests.train.helpers import train_losses

    _need_float8_experts()
    bf16, _ = _fp8_gpu_run(tmp_path, cpp_dataset, "bf16", modes)
    lane = {"float8": "tensorwise", "float8_min_dim": 16, "float8_experts": True,
            "float8_head": True}
    fp8, log = _fp8_gpu_run(tmp_path, cpp_dataset, "fp8", {**modes, **lane})
    assert "float8 (tensorwise+experts+head): " in log
    assert "float8  blocks.*.mixer.w_in|out_proj" in log and "float8  lm_head" in log
    assert train_losses(fp8.run_dir) == pytest.approx(train_losses(bf16.run_dir), rel=3e-2)
    receipt = json.loads(fp8.receipt.read_text())
    assert receipt["fingerprint"]["numerics"]["float8"] == "tensorwise+experts+head"
    assert receipt["kernels"]["moe_experts"] == "torchao_float8_grouped"
    assert receipt["kernels"]["linear_cross_entropy"] == "float8_scaled_mm"
    invocation = receipt["config"]["invocation"]["float8"]
    assert invocation["experts"] > 0 and invocation["head"] is True
