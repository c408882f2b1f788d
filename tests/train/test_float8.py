"""The FP8 training lane: it fails closed where the device has no FP8 GEMMs (one line, before
training), converts the linear layers that qualify and says why the others stay bf16, trains
(torchao's emulation on the CPU), and marks its receipts so a bf16 run is never compared with
it as the same setting."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from megacpp.contract import capture_fingerprint, contract_differences, with_numerics
from megacpp.errors import ConfigError
from megacpp.model.config import load_config
from megacpp.model.model import HybridLM, next_token_labels
from megacpp.receipts import read_receipt, write_receipt
from megacpp.receipts.compare import DriftError, compare_receipts
from megacpp.train.config import ParallelSection
from megacpp.train.modes import plan_execution
from tests.train.helpers import single_thread_env

pytest.importorskip("torchao")
from megacpp.train.float8 import apply_float8, linear_decisions, require_float8

CPU = torch.device("cpu")


def test_a_device_without_fp8_stops_the_run_before_anything_is_built():
    require_float8("off", CPU)  # bf16 runs anywhere
    for recipe in ("tensorwise", "rowwise"):
        with pytest.raises(ConfigError) as caught:
            plan_execution(ParallelSection(float8=recipe), CPU, "single", 1)
        message = str(caught.value)
        assert "\n" not in message
        assert message.startswith(f'parallel.float8 = "{recipe}" cannot run on this device (cpu)')
        assert "needs device cuda, have cpu" in message and 'parallel.float8 = "off"' in message
    plan = plan_execution(ParallelSection(), CPU, "single", 1)
    assert plan.float8 == "off" and plan.lines()[-1].startswith("float8: off")


def test_the_config_accepts_the_recipes_and_refuses_the_rest():
    ParallelSection(float8="rowwise").validate()
    with pytest.raises(ConfigError, match="parallel.float8"):
        ParallelSection(float8="fp4").validate()
    with pytest.raises(ConfigError, match="parallel.float8_min_dim"):
        ParallelSection(float8="tensorwise", float8_min_dim=8).validate()
    ParallelSection(float8="tensorwise", strategy="fsdp", float8_fsdp_all_gather=True).validate()
    for bad in ({"float8": "rowwise", "strategy": "fsdp"}, {"float8": "tensorwise"}):
        with pytest.raises(ConfigError, match="float8_fsdp_all_gather"):
            ParallelSection(float8_fsdp_all_gather=True, **bad).validate()


def _tiny(**overrides) -> HybridLM:
    torch.manual_seed(0)
    cfg = load_config("tiny")
    if overrides:
        cfg = type(cfg).from_dict({**cfg.to_dict(), "model": {**cfg.to_dict()["model"],
                                                              **overrides}})
    return HybridLM(cfg)


def test_the_filter_keeps_the_head_the_directly_read_and_the_odd_shapes_in_bf16():
    model = _tiny(tie_embeddings=False)
    decisions = linear_decisions(model, min_dim=64)
    assert decisions["lm_head"].startswith("the LM head")
    assert decisions["blocks.1.mixer.router"].startswith("MoE multiplies its weight itself")
    assert decisions["blocks.1.mixer.shared.in_proj"].startswith("MoE multiplies")
    assert decisions["blocks.2.mixer.in_proj"] is None  # row slices: only its in dim counts
    gathered = linear_decisions(model, min_dim=64, fsdp_float8_all_gather=True)
    assert gathered["blocks.2.mixer.in_proj"].startswith("Mamba3Mixer multiplies row slices")
    assert "not multiples of 16" in decisions["blocks.7.mixer.in_proj"]  # 128 x 388
    assert decisions["blocks.0.mixer.q_proj"] is None
    small = linear_decisions(model, min_dim=129)
    assert small["blocks.0.mixer.q_proj"] == ("in/out dims 128x128 under "
                                              "parallel.float8_min_dim = 129")
    assert all(reason is not None for reason in linear_decisions(model, 1024).values())


def _loss(model: HybridLM, ids: torch.Tensor) -> torch.Tensor:
    return model(ids, labels=next_token_labels(ids)).loss


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_converted_model_keeps_its_names_and_trains_close_to_bf16(recipe):
    from megacpp.kernels.ops.float8_linear.torchao_float8 import is_float8_linear

    model = _tiny()
    names = [n for n, _ in model.named_parameters()]
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, model.cfg.vocab_size, (2, 32), generator=gen)
    reference = _loss(model, ids)
    reference.backward()
    ref_grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()

    report = apply_float8(model, recipe, min_dim=16, emulate=True)
    assert [n for n, _ in model.named_parameters()] == names  # checkpoints load across lanes
    modules = dict(model.named_modules())
    assert report.converted and all(is_float8_linear(modules[n]) for n in report.converted)
    assert "blocks.0.mixer.q_proj" in report.converted
    assert not is_float8_linear(modules["blocks.1.mixer.router"])
    assert is_float8_linear(modules["blocks.2.mixer.in_proj"])
    assert report.sliced == ["blocks.2.mixer.in_proj", "blocks.6.mixer.in_proj"]
    lines = report.lines()
    assert lines[0] == (f"float8 ({recipe}): {len(report.converted)} linear layers converted, "
                        f"{len(report.kept)} kept in bf16")
    assert "  float8  blocks.*.mixer.q_proj x2" in lines
    assert ("  float8  blocks.*.mixer.in_proj x2 (row slices: each slice of rows a multiple of "
            "16 in float8, the rest bf16)") in lines
    assert any(line.startswith("  bf16    blocks.*.mixer.w_in|out_proj x3: routed-expert")
               for line in lines)
    assert any("embed: an embedding lookup" in line for line in lines)

    loss = _loss(model, ids)
    loss.backward()
    assert abs(loss.item() - reference.item()) < 0.01 * reference.item()
    assert loss.item() != reference.item()  # the GEMMs did round through float8
    grad = modules["blocks.0.mixer.q_proj"].weight.grad
    want = ref_grads["blocks.0.mixer.q_proj.weight"]
    # eight blocks of backward, each rounding its output gradient (e5m2 tensorwise: 2
    # mantissa bits): the direction holds, the values are some % apart
    assert torch.nn.functional.cosine_similarity(grad.flatten(), want.flatten(), dim=0) > 0.97
    assert (grad - want).norm() / want.norm() < 0.25


def _receipt(tmp_path, name: str, fingerprint: dict) -> object:
    path = tmp_path / f"{name}.json"
    write_receipt(path, "train", {"run": name}, {"tokens_per_s": 1.0}, fingerprint=fingerprint)
    return read_receipt(path)


def test_receipts_of_another_fp8_recipe_refuse_comparison(tmp_path):
    base = capture_fingerprint()
    bf16 = _receipt(tmp_path, "bf16", with_numerics(base, float8="off"))
    fp8 = _receipt(tmp_path, "fp8", with_numerics(base, float8="tensorwise"))
    legacy = _receipt(tmp_path, "legacy", base)  # no numerics recorded: bf16
    assert compare_receipts(bf16, legacy).rows[0].name == "tokens_per_s"
    with pytest.raises(DriftError, match=r"numerics.float8: 'off' -> 'tensorwise'"):
        compare_receipts(bf16, fp8)
    with pytest.raises(DriftError, match="numerics.float8"):
        compare_receipts(legacy, fp8)
    same = _receipt(tmp_path, "fp8b", with_numerics(base, float8="tensorwise"))
    assert compare_receipts(fp8, same).drift == []
    drift = contract_differences(with_numerics(base, float8="rowwise"),
                                 with_numerics(base, float8="tensorwise"))
    assert [d.field for d in drift] == ["numerics.float8"]


def test_cli_run_asking_for_fp8_on_the_cpu_fails_with_one_line(tmp_path, cpp_dataset):
    cmd = [sys.executable, "-m", "megacpp", "train", "--config", "tiny-cpu", "--no-progress",
           "--set", f"data.dir={cpp_dataset}", "--set", f"run.out_dir={tmp_path / 'run'}",
           "--set", "parallel.float8=rowwise", "--set", "train.steps=2"]
    result = subprocess.run(cmd, capture_output=True, text=True, env=single_thread_env(),
                            timeout=120, check=False)
    assert result.returncode == 2, result.stdout + result.stderr
    errors = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(errors) == 1 and errors[0].startswith(
        'error: parallel.float8 = "rowwise" cannot run on this device (cpu)')
    assert "Traceback" not in result.stdout + result.stderr
    receipt = json.loads((tmp_path / "run" / "receipt.json").read_text())
    assert receipt["fingerprint"]["numerics"] == {"float8": "rowwise", "torchao": receipt[
        "fingerprint"]["numerics"]["torchao"]}
    assert not (tmp_path / "run" / "metrics.jsonl").exists() or all(
        json.loads(line)["type"] != "train"
        for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines())


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
    {"compile": True, "cuda_graph": True, "kernels": "auto"},  # graphs must capture float8
], ids=["eager", "compiled-graphed"])
def test_fp8_training_on_the_gpu_follows_bf16(tmp_path, cpp_dataset, modes):
    from tests.train.helpers import train_losses

    if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("needs a CUDA GPU of sm_89 or newer")
    bf16, _ = _fp8_gpu_run(tmp_path, cpp_dataset, "bf16", modes)
    fp8, log = _fp8_gpu_run(tmp_path, cpp_dataset, "fp8",
                            {**modes, "float8": "tensorwise", "float8_min_dim": 16})
    assert "float8 (tensorwise): " in log and "float8  blocks.*.mixer.q_proj" in log
    assert train_losses(fp8.run_dir) == pytest.approx(train_losses(bf16.run_dir), rel=3e-2)
    receipt = json.loads(fp8.receipt.read_text())
    assert receipt["fingerprint"]["numerics"]["float8"] == "tensorwise"
    assert receipt["kernels"]["float8_linear"] == "torchao_tensorwise"
    assert receipt["config"]["invocation"]["float8"]["converted"] > 0
    assert receipt["config"]["invocation"]["modes"]["cuda_graph"] is modes["cuda_graph"]
