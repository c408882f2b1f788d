"""Validation in bits per byte, the run clock, time budgets and time-based validation."""

from __future__ import annotations

import io
import math

import pytest
import torch
import torch.nn.functional as F
from rich.console import Console

from megacpp.data.loader import IGNORE_INDEX, PackedLoader
from megacpp.data.shards import ShardedDataset
from megacpp.errors import ConfigError
from megacpp.receipts import read_receipt
from megacpp.train.checkpoint import load_trained_model
from megacpp.train.config import ScheduleSection, load_run_config
from megacpp.train.metrics import RunClock, bits_per_byte, process_age_s, target_bytes
from megacpp.train.schedule import lr_factor_by_progress
from megacpp.train.trainer import train
from tests.train.helpers import run_config, write_config


def _train(tmp_path, dataset, name="run", **sections):
    path = write_config(tmp_path / f"{name}.toml", run_config(dataset, tmp_path / name, **sections))
    records = []
    result = train(load_run_config(path), on_record=records.append,
                   console=Console(file=io.StringIO()), show_progress=False)
    return result, records


def test_bits_per_byte_by_hand() -> None:
    # vocabulary: 0 = EOS (a special: 0 bytes), 1 = "ab" (2 bytes), 2 = "c" (1), 3 = "é" (2)
    token_nbytes = torch.tensor([0, 2, 1, 2])
    labels = torch.tensor([[1, 3, IGNORE_INDEX], [2, 0, IGNORE_INDEX]])
    assert target_bytes(labels, token_nbytes, IGNORE_INDEX) == 2 + 2 + 1 + 0
    # the four targets' NLLs 1.0, 0.5, 2.0 and 0.25 nats: 3.75 nats over 5 bytes
    assert bits_per_byte(3.75, 5) == pytest.approx(3.75 / math.log(2) / 5)
    assert bits_per_byte(3.75, 5) == pytest.approx(1.0820212806)
    assert bits_per_byte(1.0, 0) is None


def test_process_age_and_the_clock_pause() -> None:
    age = process_age_s()
    assert age is not None and 0 < age < 24 * 3600  # this process started a while ago
    clock = RunClock(from_process_start=True)
    assert clock() >= age
    local = RunClock()
    assert local.startup_s == 0.0 and local() < 1.0
    with local.paused():
        before = local()
        torch.ones(1)  # any work: its time is not counted
        _ = sum(range(200_000))
    assert local() - before < 0.05
    clocked = local()  # read before wall_s, so wall_s can only be later
    assert local.paused_s > 0 and local.wall_s() >= clocked + local.paused_s - 1e-9


def test_progress_schedule() -> None:
    cosine = ScheduleSection(kind="cosine", warmup_steps=4, min_lr_ratio=0.1)
    assert lr_factor_by_progress(2, 0.9, cosine) == 0.5  # warmup is by step
    assert lr_factor_by_progress(5, 0.0, cosine) == 1.0
    assert lr_factor_by_progress(5, 0.5, cosine) == pytest.approx(0.55)
    assert lr_factor_by_progress(5, 1.0, cosine) == pytest.approx(0.1)
    assert lr_factor_by_progress(5, 7.0, cosine) == pytest.approx(0.1)  # past the budget
    wsd = ScheduleSection(kind="wsd", warmup_steps=0, min_lr_ratio=0.0, decay_fraction=0.2)
    assert lr_factor_by_progress(1, 0.8, wsd) == 1.0
    assert lr_factor_by_progress(1, 0.9, wsd) == pytest.approx(0.5)


def test_validation_bpb_matches_an_independent_computation(tmp_path, cpp_dataset) -> None:
    """The trainer's final val_bpb equals the summed cross-entropy of the trained model over
    the same validation batches (computed here from its logits) over the UTF-8 bytes of the
    decoded targets (computed here from the text, not from token_nbytes)."""
    result, records = _train(tmp_path, cpp_dataset, train={"steps": 4, "eval_every": 0},
                             checkpoint={"every": 0})
    val = [r for r in records if r["type"] == "val"]
    assert len(val) == 1 and val[0]["step"] == 4 and val[0]["tokens"] == 4 * 4 * 64
    model = load_trained_model(result.checkpoint)
    dataset = ShardedDataset.open(cpp_dataset)
    tokenizer = dataset.tokenizer()
    specials = {tokenizer.bos_id, tokenizer.eos_id, tokenizer.pad_id}
    nll, n_bytes, n_targets = 0.0, 0, 0
    loader = PackedLoader(dataset, "validation", batch_size=4, shuffle=False)
    with torch.no_grad():
        for i, batch in enumerate(loader):
            if i == 2:  # data.val_batches = 2
                break
            logits = model(batch["input_ids"], doc_ids=batch["doc_ids"]).logits.float()
            mask = batch["labels"] != IGNORE_INDEX
            nll += F.cross_entropy(logits[mask], batch["labels"][mask], reduction="sum").item()
            n_targets += int(mask.sum())
            for row, row_mask in zip(batch["labels"], mask):
                ids = [t for t in row[row_mask].tolist() if t not in specials]
                n_bytes += len(tokenizer.decode(ids).encode("utf-8"))
    assert val[0]["val_tokens"] == n_targets
    assert val[0]["val_bytes"] == n_bytes
    assert val[0]["val_bpb"] == pytest.approx(nll / (math.log(2) * n_bytes), rel=1e-5)
    assert result.final_val_bpb == val[0]["val_bpb"]
    metrics = read_receipt(result.receipt).metrics
    assert metrics["final_val_bpb"] == pytest.approx(val[0]["val_bpb"])


def test_a_time_budget_ends_the_run_and_drives_the_schedule(tmp_path, cpp_dataset) -> None:
    budget = 4.0
    result, records = _train(
        tmp_path, cpp_dataset,
        train={"steps": 100_000, "eval_every": 0, "time_budget_s": budget, "eval_every_s": 1.0},
        schedule={"kind": "cosine", "warmup_steps": 2, "min_lr_ratio": 0.1},
        checkpoint={"every": 0})
    steps = [r for r in records if r["type"] == "train"]
    val = [r for r in records if r["type"] == "val"]
    assert 3 <= result.steps < 100_000 and len(steps) == result.steps
    assert result.clock_s >= budget
    clocks = [r["clock_s"] for r in val]
    assert clocks == sorted(clocks) and len(val) >= 3  # every ~1 s of the clock, then the end
    assert val[-1]["step"] == result.steps and clocks[-1] >= budget
    periods = [math.floor(c) for c in clocks[:-1]]  # one timed validation per second passed
    assert periods == sorted(set(periods)) and periods[0] >= 1
    lrs = [r["lr"] for r in steps[2:]]  # after the warmup the lr only falls, toward 0.1 x
    assert lrs == sorted(lrs, reverse=True)
    assert lrs[-1] < 0.2 * 3e-3
    assert all(r["val_bpb"] is not None and r["val_bpb"] > 0 for r in val)
    metrics = read_receipt(result.receipt).metrics
    assert metrics["clock_s"] >= budget and metrics["startup_s"] == 0.0


def test_time_settings_are_validated(tmp_path, cpp_dataset) -> None:
    for key in ("time_budget_s", "eval_every_s"):
        path = write_config(tmp_path / f"{key}.toml",
                            run_config(cpp_dataset, tmp_path / key, train={key: -1}))
        with pytest.raises(ConfigError, match=f"train.{key}"):
            load_run_config(path)
