"""Fine-tuning through the real trainer: init_from (a run, a checkpoint, an HF export),
freezing, LoRA through peft (adapters in peft's format, merged on export, exact resume)."""

from __future__ import annotations

import io
import json
import shutil
import sys
from pathlib import Path

import pytest
import torch
from rich.console import Console
from safetensors.torch import load_file

from megacpp.data.loader import PackedLoader
from megacpp.data.shards import ShardedDataset
from megacpp.export.hf import export_run
from megacpp.model.config import ModelConfig
from megacpp.model.model import HybridLM
from megacpp.train.checkpoint import load_trained_model
from megacpp.train.config import load_run_config
from megacpp.train.finetune import (
    FineTuning,
    LoraState,
    add_lora,
    direct_weight_linears,
    lora_targets,
    merge_lora,
    name_matches,
)
from megacpp.train.trainer import TrainingFailed, train
from tests.train.helpers import megacpp, run_config, train_losses, write_config

TORCHRUN = (sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2")

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

LORA_TARGETS = ["mixer.q_proj", "mixer.kv_proj", "mixer.out_proj", "o_proj"]


def _train(tmp_path: Path, dataset: Path, name: str, **sections):
    path = write_config(tmp_path / f"{name}.toml", run_config(dataset, tmp_path / name,
                                                                 **sections))
    log = io.StringIO()
    result = train(load_run_config(path), console=Console(file=log, width=400),
                   show_progress=False)
    return result, log.getvalue()


@pytest.fixture(scope="module")
def source_run(tmp_path_factory, cpp_dataset) -> Path:
    """A trained run to fine-tune from (4 steps)."""
    tmp = tmp_path_factory.mktemp("source")
    result, _ = _train(tmp, cpp_dataset, "src", train={"steps": 4, "eval_every": 0},
                       checkpoint={"every": 2, "keep_last": 2})
    return result.run_dir


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory, cpp_dataset, source_run) -> tuple[Path, str]:
    """A LoRA run from ``source_run``: 6 steps, checkpoints at 2, 4 and 6 (the last two kept)."""
    tmp = tmp_path_factory.mktemp("lora")
    result, log = _train(tmp, cpp_dataset, "lora",
                         train={"steps": 6, "eval_every": 0, "init_from": str(source_run)},
                         optim={"lr": 1e-2}, lora={"r": 2, "targets": LORA_TARGETS},
                         checkpoint={"every": 2, "keep_last": 2})
    return result.run_dir, log


def load_model(run_dir: Path, **kwargs) -> HybridLM:
    """The model of a run's newest complete checkpoint."""
    return load_trained_model(run_dir, **kwargs)


def first_batch(dataset: Path) -> dict[str, torch.Tensor]:
    """The first training micro-batch of the helpers' run config (seed 0, 4 rows)."""
    loader = PackedLoader(ShardedDataset.open(dataset), "train", seed=0, shuffle=True,
                          batch_size=4, rank=0, world_size=1)
    return next(iter(loader))


# -- init_from --------------------------------------------------------------------------------
def test_init_from_a_run_starts_from_its_weights(tmp_path, cpp_dataset, source_run):
    """Step 1's loss (computed before its update) is the source model's on that batch, and
    the prepared model's logits are the source's, for a run, a checkpoint and an HF export."""
    source = load_model(source_run)
    result, log = _train(tmp_path, cpp_dataset, "ft", train={"steps": 1, "eval_every": 0,
                                                              "init_from": str(source_run)})
    assert f"init_from {source_run}: loaded" in log
    batch = first_batch(cpp_dataset)
    with torch.no_grad():
        expected = source.train()(batch["input_ids"], doc_ids=batch["doc_ids"],
                                  labels=batch["labels"]).lm_loss.item()
    assert train_losses(result.run_dir)[0] == pytest.approx(expected, abs=1e-5)

    hf_dir = export_run(source_run, tmp_path / "hf")
    ids = torch.tensor([[1, 50, 60, 70, 80, 90]])
    with torch.no_grad():
        want = source.eval()(ids).logits
    for init_from in (source_run, source_run / "checkpoints" / "step_000002", hf_dir):
        cfg = load_run_config(write_config(tmp_path / "x.toml", run_config(
            cpp_dataset, tmp_path / "x", train={"steps": 1, "init_from": str(init_from)})))
        model = HybridLM(cfg.model_config(vocab_size=512))
        FineTuning(cfg).prepare(model, restoring=False, log=lambda _: None)
        with torch.no_grad():
            got = model.eval()(ids).logits
        if init_from.name == "step_000002":
            assert not torch.equal(got, want)  # the older checkpoint: other weights
            step2 = load_trained_model(init_from).eval()
            assert torch.equal(got, step2(ids).logits)
        else:
            assert (got - want).abs().max().item() <= 1e-6


def test_init_from_mismatch_fails_closed_naming_the_tensor(tmp_path, cpp_dataset, source_run):
    with pytest.raises(TrainingFailed, match=r"train.init_from = .* does not fit this run's "
                       r"model: tensor embed.weight has shape \[512, 32\] there and \[512, 48\]"):
        _train(tmp_path, cpp_dataset, "wide", model={"d_model": 48},
               train={"steps": 1, "init_from": str(source_run)})
    with pytest.raises(TrainingFailed, match="train.init_from = .*: not found"):
        _train(tmp_path, cpp_dataset, "gone", train={"steps": 1,
                                                      "init_from": str(tmp_path / "nope")})


# -- freezing ---------------------------------------------------------------------------------
def test_freeze_leaves_frozen_params_bit_identical(tmp_path, cpp_dataset, source_run):
    freeze = ["embed", "blocks.0", "blocks.*.norm"]
    result, log = _train(tmp_path, cpp_dataset, "frozen",
                         train={"steps": 3, "eval_every": 0, "init_from": str(source_run),
                                "freeze": freeze})
    before = dict(load_model(source_run).named_parameters())
    after = dict(load_trained_model(result.checkpoint).named_parameters())
    frozen = [n for n in before if any(name_matches(n, p) for p in freeze)]
    assert "embed.weight" in frozen and "blocks.0.mixer.q_proj.weight" in frozen
    assert "blocks.3.norm.weight" in frozen
    for name in frozen:
        assert torch.equal(before[name], after[name]), name
    assert not torch.equal(before["blocks.2.mixer.out_proj.weight"],
                           after["blocks.2.mixer.out_proj.weight"])
    trainable = sum(p.numel() for n, p in before.items() if n not in frozen)
    assert f"trainable parameters: {trainable:,} of " in log


def test_fine_tuning_config_errors_are_one_line(tmp_path, cpp_dataset, source_run, capsys):
    from megacpp.cli.main import main

    cases = [
        ({"train": {"steps": 1, "freeze": ["nothing_here"]}}, ("train.freeze: 'nothing_here' "
         "names no parameter")),
        ({"train": {"steps": 1, "freeze": "embed"}}, "expected a list of strings"),
        ({"train": {"steps": 1}, "lora": {"r": 2, "targets": ["router"]}},
         "lora.targets: 'router' names blocks.1.mixer.router, which LoRA cannot adapt"),
        ({"train": {"steps": 1}, "lora": {"r": 2, "targets": ["qq_proj"]}},
         "lora.targets: 'qq_proj' names no linear layer"),
        ({"train": {"steps": 1}, "lora": {"r": -1}}, "lora.r = -1 is invalid"),
        ({"train": {"steps": 1}, "lora": {"rank": 2}}, "unknown key(s) ['rank'] in [lora]"),
    ]
    for i, (sections, needle) in enumerate(cases):
        path = write_config(tmp_path / f"c{i}.toml",
                            run_config(cpp_dataset, tmp_path / f"c{i}", **sections))
        capsys.readouterr()
        with pytest.raises(SystemExit) as exit_info:
            main(["train", "--config", str(path), "--no-progress"])
        lines = capsys.readouterr().err.strip().splitlines()
        assert exit_info.value.code == 2, lines
        assert len(lines) == 1 and lines[0].startswith("error:") and needle in lines[0], lines


# -- LoRA -------------------------------------------------------------------------------------
def test_lora_trains_under_2_percent_and_the_loss_falls(lora_run, source_run, cpp_dataset):
    run_dir, log = lora_run
    line = next(x for x in log.splitlines() if x.startswith("trainable parameters"))
    trainable, total = (int(x.replace(",", "")) for x in line.split()[2:5:2])
    assert 0 < trainable / total < 0.02
    # validation loss on the same batches: the source model (= the LoRA run at step 0) vs after
    def val_losses(run: Path) -> list[float]:
        records = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
        return [r["val_loss"] for r in records if r["type"] == "val"]

    assert val_losses(run_dir)[-1] < val_losses(source_run)[-1] - 0.01
    # only the adapters changed: every base weight is the source's, bit for bit
    base = load_model(source_run).state_dict()
    tuned = load_trained_model(run_dir / "checkpoints" / "step_000006", merge_adapters=False)
    for name, tensor in tuned.state_dict().items():
        plain = name.replace(".base_layer", "")
        if "lora_" not in name:
            assert torch.equal(tensor, base[plain]), name


def test_lora_adapters_are_saved_in_peft_format_and_merge_on_export(lora_run, source_run,
                                                                    tmp_path):
    run_dir, _ = lora_run
    adapters = sorted(p.name for p in (run_dir / "adapters").iterdir())
    assert adapters == ["step_000004", "step_000006"]  # beside the kept checkpoints
    adapter_dir = run_dir / "adapters" / "step_000006"
    config = json.loads((adapter_dir / "adapter_config.json").read_text())
    assert config["peft_type"] == "LORA" and config["r"] == 2
    assert config["base_model_name_or_path"] == str(source_run)

    # base + adapter, through peft itself
    base = load_model(source_run)
    with_adapter = peft.PeftModel.from_pretrained(base, str(adapter_dir)).eval()
    merged_dir = export_run(run_dir, tmp_path / "merged")
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(merged_dir,
                                                                 trust_remote_code=True)
    ids = torch.tensor([[1, 50, 60, 70, 80, 90, 100]])
    with torch.no_grad():
        expected = with_adapter(ids).logits
        got = hf_model(ids).logits
        untuned = load_model(source_run)(ids).logits
        loaded = load_model(run_dir)(ids).logits  # what generate/serve/eval load: merged
    assert (got - expected).abs().max().item() <= 1e-5
    assert (loaded - expected).abs().max().item() <= 1e-5
    assert (got - untuned).abs().max().item() > 1e-3  # the adapter matters
    assert "LoRA | r=2" in (merged_dir / "README.md").read_text()

    adapter_only = export_run(run_dir, tmp_path / "adapter", adapter_only=True)
    assert sorted(p.name for p in adapter_only.iterdir()) == [
        "adapter_config.json", "adapter_model.safetensors"]
    exported = json.loads((adapter_only / "adapter_config.json").read_text())
    assert exported["base_model_name_or_path"] == str(source_run)  # the run's init_from
    again = peft.PeftModel.from_pretrained(load_model(source_run), str(adapter_only))
    with torch.no_grad():
        assert torch.equal(again.eval()(ids).logits, expected)


def test_lora_resume_is_exact(tmp_path, lora_run):
    """The LoRA run cut back to its step-4 checkpoint and resumed ends bit-identical."""
    run_dir, _ = lora_run
    copy = tmp_path / "copy"
    shutil.copytree(run_dir, copy)
    shutil.rmtree(copy / "checkpoints" / "step_000006")
    shutil.rmtree(copy / "adapters" / "step_000006")
    cfg = load_run_config(copy / "config.toml", [f"run.out_dir={copy}"])
    resumed = train(cfg, resume="auto", console=Console(file=io.StringIO()),
                    show_progress=False)
    assert resumed.resumed_from.name == "step_000004"
    assert train_losses(copy) == train_losses(run_dir)
    straight = load_trained_model(run_dir / "checkpoints" / "step_000006").state_dict()
    for name, tensor in load_trained_model(resumed.checkpoint).state_dict().items():
        assert torch.equal(tensor, straight[name]), name
    adapter = "adapter_model.safetensors"
    assert ((copy / "adapters" / "step_000006" / adapter).read_bytes()
            == (run_dir / "adapters" / "step_000006" / adapter).read_bytes())


def test_lora_targets_only_linears_called_as_modules():
    """Unmerged LoRA layers give the merged model's numbers on every path (training forward,
    cached prefill and decode): no supported target is bypassed. A bypassed one (the MoE
    router, applied through its stacked weight) would not."""
    cfg = ModelConfig.from_dict({
        "model": {"pattern": "A E M R D A:mla A:dsa", "vocab_size": 97, "d_model": 32},
        "attention": {"n_heads": 2, "n_kv_heads": 1, "head_dim": 16},
        "mamba": {"d_state": 8, "headdim": 16, "chunk_size": 4},
        "rnn": {"n_heads": 2, "head_k_dim": 8, "head_v_dim": 16, "chunk_size": 4},
        "moe": {"n_experts": 4, "top_k": 2, "expert_ffn": 16}, "mlp": {"ffn": 48},
        "mla": {"n_heads": 2, "kv_lora_rank": 16, "qk_nope_head_dim": 8, "qk_rope_head_dim": 8,
                "v_head_dim": 8},
        "dsa": {"index_n_heads": 2, "index_head_dim": 8, "top_k": 4, "query_chunk": 4},
        "mtp": {"depth": 1, "pattern": "AE"},
    })
    torch.manual_seed(0)
    model = HybridLM(cfg)
    targets = lora_targets(model, ())
    unsupported = direct_weight_linears(model)
    assert {"blocks.1.mixer.router", "blocks.1.mixer.shared.in_proj", "blocks.2.mixer.in_proj",
            "blocks.5.mixer.kv_up", "blocks.6.mixer.attn.kv_up"} <= set(unsupported)
    assert "mtp.depths.0.in_proj" in targets and not set(targets) & set(unsupported)

    def outputs(m: HybridLM) -> tuple[torch.Tensor, torch.Tensor]:
        ids = torch.tensor([[1, 5, 9, 13, 17, 21, 25, 29, 33, 37]])
        with torch.no_grad():
            return m.eval()(ids).logits, m.generate_greedy(ids, 6)

    def with_random_adapters(names: list[str]) -> HybridLM:
        torch.manual_seed(0)
        m = HybridLM(cfg)
        add_lora(m, LoraState(r=2, alpha=4.0, dropout=0.0, targets=tuple(names)))
        with torch.no_grad():
            for name, p in m.named_parameters():
                if "lora_B" in name:
                    p.normal_(std=0.5)
        return m

    adapted = with_random_adapters(targets)
    logits, tokens = outputs(adapted)
    merged_logits, merged_tokens = outputs(merge_lora(adapted))
    assert (logits - merged_logits).abs().max().item() <= 1e-5
    assert torch.equal(tokens, merged_tokens)
    assert (logits - outputs(HybridLM(cfg))[0]).abs().max().item() > 1e-3

    bypassed = with_random_adapters(["blocks.1.mixer.router"])
    logits, _ = outputs(bypassed)
    assert (logits - outputs(merge_lora(bypassed))[0]).abs().max().item() > 1e-4


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_lora_under_two_processes_matches_one(strategy, tmp_path, cpp_dataset, source_run):
    """torchrun, 2 processes (gloo): the LoRA run's losses are the one-process run's of the
    same global batch, and rank 0 writes the whole adapter (gathered under FSDP2)."""
    sections = {"train": {"steps": 2, "eval_every": 0, "init_from": str(source_run)},
                "optim": {"lr": 1e-2}, "lora": {"r": 2, "targets": LORA_TARGETS}}
    one, _ = _train(tmp_path, cpp_dataset, "one", **sections)
    config = write_config(tmp_path / "two.toml", run_config(
        cpp_dataset, tmp_path / "two", **{**sections, "train": {
            **sections["train"], "micro_batch_size": 2}}, parallel={"strategy": strategy}))
    megacpp("train", "--config", str(config), "--no-progress", launcher=TORCHRUN)
    assert train_losses(tmp_path / "two") == pytest.approx(train_losses(one.run_dir), rel=2e-5)
    adapter = "adapters/step_000002/adapter_model.safetensors"
    expected, got = load_file(one.run_dir / adapter), load_file(tmp_path / "two" / adapter)
    assert set(got) == set(expected)
    for name, tensor in expected.items():
        torch.testing.assert_close(got[name], tensor, rtol=1e-4, atol=1e-6)
