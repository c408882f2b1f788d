"""End-to-end CPU training in-process: determinism, the run directory, the receipt,
gradient accumulation, activation checkpointing, and bad input."""

from __future__ import annotations

import io
import json
import math
import tomllib

import pytest
import torch
from rich.console import Console

from megacpp.errors import MegaCppError
from megacpp.receipts import read_receipt
from megacpp.train.checkpoint import load_trained_model
from megacpp.train.config import RunConfig, load_run_config
from megacpp.train.trainer import TrainingFailed, train
from tests.train.helpers import DSA_MTP_MODEL, run_config, train_losses, write_config


def _train(tmp_path, dataset, name="run", *, overrides=(), skip_preflight=(), **sections):
    path = write_config(tmp_path / f"{name}.toml", run_config(dataset, tmp_path / name, **sections))
    cfg = load_run_config(path, list(overrides))
    records = []
    result = train(cfg, on_record=records.append, console=Console(file=io.StringIO()),
                   skip_preflight=skip_preflight)
    return result, records


def test_same_config_and_seed_give_bitwise_identical_losses(tmp_path, cpp_dataset):
    first, records = _train(tmp_path, cpp_dataset, "a")
    second, _ = _train(tmp_path, cpp_dataset, "b")
    losses = train_losses(first.run_dir)
    assert losses == train_losses(second.run_dir)  # equality, not closeness
    assert len(losses) == 6 and all(math.isfinite(x) for x in losses)
    assert losses[-1] < losses[0]  # it learns
    assert [r["step"] for r in records if r["type"] == "train"] == list(range(1, 7))
    other_seed, _ = _train(tmp_path, cpp_dataset, "c", run={"seed": 1})
    assert train_losses(other_seed.run_dir) != losses


def test_run_directory_metrics_and_receipt(tmp_path, cpp_dataset):
    result, _ = _train(tmp_path, cpp_dataset, overrides=["train.steps=4", "run.plots=true"],
                       skip_preflight=["device-profile"])
    run = result.run_dir
    assert result.steps == 4 and result.checkpoint == run / "checkpoints" / "step_000004"
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == [
        "step_000002", "step_000004"]
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    step = next(r for r in records if r["type"] == "train")
    for key in ("loss", "grad_norm", "lr", "tokens_per_s", "peak_mem_bytes", "moe_balance"):
        assert isinstance(step[key], float | int) and step[key] > 0, key
    assert step["mfu"] is None  # no fp32 peak for a CPU: n/a, never a made-up number
    assert step["tokens"] == 4 * 64
    vals = [r for r in records if r["type"] == "val"]
    assert [r["step"] for r in vals] == [3, 4] and vals[-1]["val_loss"] == result.final_val_loss
    assert (run / "plots" / "loss.png").stat().st_size > 0

    config = tomllib.loads((run / "config.toml").read_text())
    assert config["model"]["vocab_size"] == 512 and config["train"]["steps"] == 4
    assert "overrides: train.steps=4 run.plots=true" in (run / "config.toml").read_text()

    receipt = read_receipt(result.receipt)
    assert receipt.kind == "train" and receipt.metrics["completed"] == 1.0
    assert receipt.metrics["steps"] == 4 and receipt.metrics["final_loss"] == result.final_loss
    assert "mfu" not in receipt.metrics
    assert receipt.config["outcome"]["status"] == "completed"
    assert receipt.config["outcome"]["mfu"].startswith("n/a")
    assert receipt.config["overrides"] == ["train.steps=4", "run.plots=true"]
    assert receipt.preflight["ok"] is True and receipt.preflight["skipped"] == ["device-profile"]
    assert receipt.config["invocation"]["skip_preflight"] == ["device-profile"]
    assert {a.path for a in receipt.artifacts} == {
        "config.toml", "metrics.jsonl", "checkpoints/step_000004/COMPLETE"}


def test_resolved_config_reproduces_the_run(tmp_path, cpp_dataset):
    first, _ = _train(tmp_path, cpp_dataset, overrides=["train.steps=3"])
    again = load_run_config(first.run_dir / "config.toml",
                            [f"run.out_dir={tmp_path / 'again'}"])
    result = train(again, console=Console(file=io.StringIO()))
    assert train_losses(result.run_dir) == train_losses(first.run_dir)


def test_the_mtp_loss_and_the_dsa_indexer_loss_train_their_parameters(tmp_path, cpp_dataset):
    """The trainer optimizes the model's whole loss: the MTP module's cross-entropy and the
    DSA indexer's KL are the only paths to the MTP output norm and the indexer's weights."""
    result, records = _train(tmp_path, cpp_dataset, model=DSA_MTP_MODEL,
                             train={"steps": 4, "eval_every": 0})
    train_records = [r for r in records if r["type"] == "train"]
    assert all(math.isfinite(r["mtp_loss"]) and r["mtp_loss"] > 0 for r in train_records)
    assert all(r["aux_loss"] > 0 for r in train_records)  # MoE balance + indexer KL
    checkpoints = result.run_dir / "checkpoints"
    early = load_trained_model(checkpoints / "step_000002").state_dict()
    late = load_trained_model(checkpoints / "step_000004").state_dict()
    trained_only_by_them = [n for n in late if n.startswith("mtp.depths.0.norm.")
                            or ".indexer." in n]
    assert any(n.startswith("mtp.") for n in trained_only_by_them)
    assert any(".indexer." in n for n in trained_only_by_them)
    unchanged = [n for n in trained_only_by_them if torch.equal(early[n], late[n])]
    assert not unchanged, f"not trained between steps 2 and 4: {unchanged}"


def test_a_model_without_mtp_records_no_mtp_loss(tmp_path, cpp_dataset):
    _, records = _train(tmp_path, cpp_dataset, train={"steps": 2, "eval_every": 0})
    assert [r["mtp_loss"] for r in records if r["type"] == "train"] == [None, None]


def test_gradient_accumulation_matches_the_same_global_batch(tmp_path, cpp_dataset):
    whole, _ = _train(tmp_path, cpp_dataset, "whole", train={"steps": 4})
    accum, _ = _train(tmp_path, cpp_dataset, "accum",
                      train={"steps": 4, "micro_batch_size": 2, "grad_accum_steps": 2})
    assert train_losses(accum.run_dir) == pytest.approx(train_losses(whole.run_dir), rel=1e-5)


def test_activation_checkpointing_recomputes_the_same_numbers(tmp_path, cpp_dataset):
    plain, _ = _train(tmp_path, cpp_dataset, "plain", train={"steps": 4})
    recompute, _ = _train(tmp_path, cpp_dataset, "ac", train={"steps": 4},
                          parallel={"activation_checkpointing": "AEMR"})
    assert train_losses(recompute.run_dir) == train_losses(plain.run_dir)


def test_clipping_folded_into_muon_trains_as_clipping_every_gradient(tmp_path, cpp_dataset,
                                                                     monkeypatch):
    """With clipping active at every step, the clip folded into Muon's momentum pass (the
    coefficient handed to Muon, its gradients not rewritten) gives the losses of torch's clip
    over every gradient, bit for bit; and without clipping nothing is scaled."""
    from megacpp.train.optim import Optimizers

    folded, records = _train(tmp_path, cpp_dataset, "folded", train={"steps": 4,
                                                                     "max_grad_norm": 0.05})
    norms = [r["grad_norm"] for r in records if r["type"] == "train"]
    assert min(norms) > 0.05  # the clip scaled every step
    monkeypatch.setattr(Optimizers, "muon_takes_grad_scale", property(lambda self: False))
    plain, _ = _train(tmp_path, cpp_dataset, "plain", train={"steps": 4, "max_grad_norm": 0.05})
    assert train_losses(folded.run_dir) == train_losses(plain.run_dir)
    unclipped, _ = _train(tmp_path, cpp_dataset, "unclipped", train={"steps": 4,
                                                                     "max_grad_norm": 0.0})
    assert train_losses(unclipped.run_dir) != train_losses(plain.run_dir)


def test_without_muon_every_parameter_uses_adamw(tmp_path, cpp_dataset):
    muon, _ = _train(tmp_path, cpp_dataset, "muon", train={"steps": 3})
    adamw, _ = _train(tmp_path, cpp_dataset, "adamw", train={"steps": 3}, optim={"muon": False})
    first_muon, first_adamw = train_losses(muon.run_dir), train_losses(adamw.run_dir)
    assert first_muon[0] == first_adamw[0]  # same init, same first batch
    assert first_muon[1:] != first_adamw[1:]  # different updates


def test_refuses_to_overwrite_an_existing_run(tmp_path, cpp_dataset):
    first, _ = _train(tmp_path, cpp_dataset, overrides=["train.steps=2"])
    before = (first.run_dir / "metrics.jsonl").read_bytes()
    cfg = load_run_config(tmp_path / "run.toml")
    with pytest.raises(MegaCppError, match="already holds a run .*--resume auto"):
        train(cfg, console=Console(file=io.StringIO()))
    assert (first.run_dir / "metrics.jsonl").read_bytes() == before  # nothing lost


def test_bad_data_and_vocab_are_clear_errors_with_a_receipt(tmp_path, cpp_dataset):
    cfg = RunConfig.from_dict(run_config(tmp_path / "no-data", tmp_path / "r1"))
    with pytest.raises(TrainingFailed) as err:
        train(cfg, console=Console(file=io.StringIO()))
    assert str(tmp_path / "no-data") in str(err.value)
    assert read_receipt(err.value.receipt).metrics["completed"] == 0.0

    small = run_config(cpp_dataset, tmp_path / "r2")
    small["model"]["vocab_size"] = 100
    with pytest.raises(TrainingFailed, match=r"model.vocab_size = 100 is smaller than .* 512"):
        train(RunConfig.from_dict(small), console=Console(file=io.StringIO()))

    big_batch = RunConfig.from_dict(run_config(cpp_dataset, tmp_path / "r3",
                                               train={"micro_batch_size": 100000}))
    with pytest.raises(TrainingFailed, match=r"a step needs at least 100000 train rows \(micro_batch_size 100000 x 1"):
        train(big_batch, console=Console(file=io.StringIO()))
