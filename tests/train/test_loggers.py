"""[run] loggers: TensorBoard event files and an offline W&B run hold exactly the numbers of
metrics.jsonl, step for step (read back with tensorboard's plugin EventAccumulator and from
the .wandb file); unknown loggers and missing extras fail closed naming the pip extra."""

from __future__ import annotations

import json
import os
import struct
import sys
import zlib
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console

from megacpp.cli.main import main
from megacpp.train.config import RunConfig
from megacpp.train.loggers import scalars
from megacpp.train.metrics import read_metrics
from megacpp.train.trainer import train
from tests.train.helpers import run_config, write_config

LOGGERS = ["jsonl", "tensorboard", "wandb"]


@pytest.fixture(scope="module")
def logged_run(tmp_path_factory, cpp_dataset) -> Path:
    run_dir = tmp_path_factory.mktemp("loggers") / "run"
    cfg = RunConfig.from_dict(run_config(cpp_dataset, run_dir, run={"loggers": LOGGERS},
                                         train={"steps": 4, "eval_every": 2}))
    saved = {k: os.environ.get(k) for k in ("WANDB_MODE", "WANDB_PROJECT")}
    os.environ.update(WANDB_MODE="offline", WANDB_PROJECT="megacpp-tests")
    try:
        train(cfg, console=Console(quiet=True))
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
    return run_dir


def _expected(run_dir: Path) -> dict[tuple[int, str], float]:
    out = {}
    for record in read_metrics(run_dir / "metrics.jsonl"):
        if record["type"] == "setup":  # the run's modes and batch: recorded, not a metric
            continue
        for tag, value in scalars(record).items():
            out[(record["step"], tag)] = value
    return out


def test_scalars_are_every_number_of_a_record():
    record = {"type": "train", "step": 3, "loss": 2.5, "mfu": None, "spike": False, "tokens": 7}
    assert scalars(record) == {"train/loss": 2.5, "train/spike": 0.0, "train/tokens": 7}
    assert scalars({"type": "val", "step": 4, "val_loss": 1.0}) == {"val/val_loss": 1.0}


def test_tensorboard_holds_the_jsonl_numbers_step_for_step(logged_run):
    logged = _tensorboard_scalars(logged_run / "tensorboard")
    expected = _expected(logged_run)
    assert {"train/loss", "train/lr", "val/val_loss"} <= {tag for _, tag in expected}
    assert sorted({step for step, _ in expected}) == [1, 2, 3, 4]
    assert logged == expected  # float64: the same numbers, not float32 roundings


def _tensorboard_scalars(log_dir: Path) -> dict[tuple[int, str], float]:
    # the accumulator TensorBoard's own server reads runs with (it honours purge_step)
    from tensorboard.backend.event_processing.plugin_event_accumulator import (
        TENSORS,
        EventAccumulator,
    )
    from tensorboard.util import tensor_util

    events = EventAccumulator(str(log_dir), size_guidance={TENSORS: 0})
    events.Reload()
    logged = [((event.step, tag), tensor_util.make_ndarray(event.tensor_proto).item())
              for tag in events.Tags()["tensors"] for event in events.Tensors(tag)]
    assert len(logged) == len(dict(logged)), "a (step, tag) was logged twice"
    return dict(logged)


def test_a_resumed_run_replaces_the_replayed_steps_in_tensorboard(tmp_path, cpp_dataset):
    run_dir = tmp_path / "run"
    cfg = RunConfig.from_dict(run_config(cpp_dataset, run_dir,
                                         run={"loggers": ["jsonl", "tensorboard"]},
                                         train={"steps": 4, "eval_every": 2}))
    train(cfg, console=Console(quiet=True))
    first = _expected(run_dir)
    train(cfg, resume=str(run_dir / "checkpoints" / "step_000002"), console=Console(quiet=True))
    assert len(list((run_dir / "tensorboard").glob("events.out.tfevents.*"))) == 2
    assert _tensorboard_scalars(run_dir / "tensorboard") == _expected(run_dir)
    assert _expected(run_dir).keys() == first.keys()


def test_wandb_offline_run_holds_the_jsonl_numbers_step_for_step(logged_run):
    (path,) = (logged_run / "wandb").glob("offline-run-*/run-*.wandb")
    records = _wandb_records(path)
    logged = {}
    for history in (r.history for r in records if r.WhichOneof("record_type") == "history"):
        for item in history.item:
            key = item.key or "/".join(item.nested_key)
            if not key.startswith("_"):
                logged[(history.step.num, key)] = json.loads(item.value_json)
    assert logged == _expected(logged_run)
    (run,) = (r.run for r in records if r.WhichOneof("record_type") == "run")
    config = {item.key: json.loads(item.value_json) for item in run.config.update}
    assert run.project == "megacpp-tests" and run.run_group == logged_run.name
    assert config["train"]["steps"] == 4 and config["run"]["loggers"] == LOGGERS


def _wandb_records(path: Path) -> list[Any]:
    """The protobuf records of a .wandb file. wandb 0.31 ships no Python reader (its Go core
    writes the file), so this reads the format directly: a 7-byte header (":W&B", magic,
    version), then LevelDB-log records in 32 KiB blocks, each with a CRC-32, a length and a
    fragment type (full, first, middle, last)."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B"
    block, pos, pending, payloads = 32768, 7, b"", []
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        crc, length, kind = struct.unpack_from("<IHB", data, pos)
        chunk = data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind == 0:
            break
        assert zlib.crc32(chunk, zlib.crc32(bytes([kind]))) == crc, f"corrupt record at {pos}"
        pending = chunk if kind in (1, 2) else pending + chunk
        if kind in (1, 4):
            payloads.append(pending)
    records = []
    for payload in payloads:
        record = wandb_internal_pb2.Record()
        record.ParseFromString(payload)
        records.append(record)
    return records


def _cli(capsys, *argv: str) -> tuple[int, str]:
    with pytest.raises(SystemExit) as exit_info:
        main(list(argv))
    return exit_info.value.code, capsys.readouterr().err


def test_an_unknown_logger_is_one_line(capsys):
    code, err = _cli(capsys, "train", "--config", "tiny-cpu", "--set",
                     'run.loggers=["jsonl", "mlflow"]')
    assert code == 2 and err.count("\n") == 1 and "Traceback" not in err
    assert "unknown logger 'mlflow'; allowed: jsonl, tensorboard, wandb" in err


@pytest.mark.parametrize("extra", ["tensorboard", "wandb"])
def test_a_missing_extra_names_it(capsys, monkeypatch, tmp_path, cpp_dataset, extra):
    monkeypatch.setitem(sys.modules, extra, None)  # as if the package were not installed
    config = write_config(tmp_path / "r.toml", run_config(
        cpp_dataset, tmp_path / "run", run={"loggers": ["jsonl", extra]}))
    code, err = _cli(capsys, "train", "--config", str(config))
    assert code == 2 and err.count("\n") == 1
    assert f"needs the {extra} package: pip install 'megacpp[{extra}]'" in err
    assert not (tmp_path / "run").exists()  # refused before the run started
