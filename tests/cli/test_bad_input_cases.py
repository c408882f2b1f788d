"""Hostile inputs as a user types them, one test each: every one ends with one ``error:`` line
naming the thing and exit 2, or, where the input is usable, does its job. The property-based
generalisation of these classes is tests/test_bad_input.py."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import pytest
import torch

from megacpp.data.shards import MANIFEST, MARKER
from megacpp.train.checkpoint import CheckpointManager
from megacpp.train.parallelize import DistEnv
from tests.cli.test_cli_consistency import assert_one_error_line, run_cli
from tests.data.packed_fixtures import build_tiny
from tests.infer.server_helpers import tiny_model, tiny_tokenizer


def refused(*args: str) -> str:
    """Run ``megacpp ARGS``; it must print one error line and exit 2. Returns the line."""
    code, _, err = run_cli(*args)
    assert_one_error_line(code, err, args)
    return err.strip()


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> dict[str, Path]:
    """A run directory with two checkpoints (steps 1 and 2) and a tokenizer file."""
    tmp = tmp_path_factory.mktemp("run")
    model = tiny_model(tiny_tokenizer().vocab_size)
    env = DistEnv(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"),
                  strategy="single")
    manager = CheckpointManager(tmp / "run", keep_last=2, env=env)
    for step in (1, 2):
        state = {"step": step, "model_config": model.cfg.to_dict(), "world_size": 1}
        manager.save(step, model, [], state, {})
    return {"run": tmp / "run", "tokenizer": tiny_tokenizer().save(tmp / "tokenizer.json"),
            "tmp": tmp}


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> Path:
    return build_tiny(tmp_path_factory.mktemp("data"))


def copy_of(path: Path, tmp_path: Path) -> Path:
    shutil.copytree(path, tmp_path / path.name)
    return tmp_path / path.name


def generate(run: dict[str, Path], checkpoint: Path, *extra: str) -> tuple[str, ...]:
    return ("generate", "--checkpoint", str(checkpoint), "--tokenizer", str(run["tokenizer"]),
            "--max-new-tokens", "2", "--device", "cpu", *extra)


# ---- tracebacks that are one line now ---------------------------------------------------------

def test_a_directory_where_a_model_config_goes(tmp_path):
    assert "is a directory" in refused("model", "describe", "AEMR", "--config", str(tmp_path))


def test_a_garbage_dataset_marker(dataset, tmp_path):
    ds = copy_of(dataset, tmp_path)
    (ds / MARKER).write_bytes(b"\xff\xfe x")
    assert "_COMPLETE is corrupt" in refused("data", "verify", str(ds))


@pytest.mark.parametrize("out", ["/proc/megacpp-ds", "{file}/ds", "/sys/megacpp/ds"])
def test_an_unusable_data_build_out(dataset, tmp_path, out):
    (tmp_path / "file").write_text("x")
    out = out.replace("{file}", str(tmp_path / "file"))
    line = refused("data", "build", str(dataset), "--out", out, "--workers", "1")
    assert line.startswith(f"error: cannot write the dataset {out}")


def test_a_non_utf8_prompt(run):
    assert "--prompt is not valid UTF-8 text (byte 0xff" in refused(
        *generate(run, run["run"], "--prompt", os.fsdecode(b"int\xff")))


def test_a_max_new_tokens_no_memory_can_hold(run):
    line = refused(*generate(run, run["run"], "--prompt", "int"), "--max-new-tokens",
                   str(2**31 - 1), "--n", "65536")
    assert "the cache of 65536 completion(s)" in line and "available" in line


def test_checkpoint_marker_files_of_the_wrong_type(run, tmp_path):
    copy = copy_of(run["run"], tmp_path)
    marker = copy / "checkpoints" / "step_000002" / "COMPLETE"
    data = json.loads(marker.read_text())
    data["files"] = {name: "abc" for name in data["files"]}
    marker.write_text(json.dumps(data))
    assert "corrupt COMPLETE marker" in refused(*generate(run, copy, "--prompt", "x"))


def test_a_binary_line_in_metrics_jsonl(tmp_path):
    (tmp_path / "metrics.jsonl").write_bytes(
        b'{"type": "train", "step": 1, "loss": 1.0, "tokens_per_s": 1.0}\n\xff\xfe\x00\n')
    assert "metrics.jsonl:2: malformed metrics line" in refused("plot", str(tmp_path))


@pytest.mark.parametrize("wall", ["nan", "inf"])
def test_eval_run_wall_nan_or_inf(tmp_path, wall):
    (tmp_path / "a.cpp").write_text("int main() {}\n")
    assert f"--wall {wall}" in refused("eval", "run", str(tmp_path / "a.cpp"), "--wall", wall)


# ---- unbounded reads ------------------------------------------------------------------------

@pytest.mark.parametrize("args", [
    ("receipts", "show", "/dev/zero"), ("env", "diff", "/dev/zero", "/dev/zero"),
    ("train", "--config", "/dev/zero"), ("model", "describe", "--config", "/dev/zero"),
    ("eval", "run", "/dev/zero"), ("tokenizer", "encode", "{tok}", "--file", "/dev/zero"),
])
def test_dev_zero_is_refused_before_a_byte_is_read(run, args):
    args = tuple(a.replace("{tok}", str(run["tokenizer"])) for a in args)
    assert "/dev/zero is a character device; expected a regular file" in refused(*args)


# ---- silent acceptance ------------------------------------------------------------------------

def test_an_empty_toml_is_not_a_model(tmp_path):
    (tmp_path / "empty.toml").write_text("")
    assert "has no [model] pattern" in refused("model", "describe", "--config",
                                               str(tmp_path / "empty.toml"))


def test_a_sequence_length_past_any_model():
    assert "--seq-len must be positive and at most" in refused(
        "model", "describe", "AEM", "--seq-len", "99999999999999999999999")


def test_train_steps_past_64_bits(tmp_path):
    config = tmp_path / "run.toml"
    config.write_text(f'[run]\nout_dir = "{tmp_path}/out"\n[model]\npreset = "tiny"\n'
                      f'[data]\ndir = "{tmp_path}"\n')
    line = refused("train", "--config", str(config), "--set",
                   "train.steps=99999999999999999999999")
    assert "train.steps = 99999999999999999999999: expected an integer (64-bit)" in line
    assert not (tmp_path / "out").exists()


def test_a_hand_edited_manifest_row_len(dataset, tmp_path):
    ds = copy_of(dataset, tmp_path)
    manifest = json.loads((ds / MANIFEST).read_text())
    manifest["row_len"] = "abc"
    text = json.dumps(manifest).encode()
    (ds / MANIFEST).write_bytes(text)
    (ds / MARKER).write_text(hashlib.sha256(text).hexdigest())  # the editor rehashed it
    assert "row_len = 'abc'" in refused("data", "verify", str(ds))


def test_generate_refuses_a_corrupt_newest_checkpoint_unless_asked(run, tmp_path):
    copy = copy_of(run["run"], tmp_path)
    with open(copy / "checkpoints" / "step_000002" / "__0_0.distcp", "r+b") as f:
        f.seek(100)
        f.write(b"X")
    line = refused(*generate(run, copy, "--prompt", "int"))
    assert "step_000002: file __0_0.distcp is corrupt" in line
    assert "--fallback-to-previous" in line
    code, out, err = run_cli(*generate(run, copy, "--prompt", "int", "--json",
                                       "--fallback-to-previous"))
    assert code == 0, err
    assert "skipped: checkpoint" in err and "step_000002" in err
    assert json.loads(out.splitlines()[0])["checkpoint"].endswith("step_000001")


def test_generate_device_auto(run):
    code, out, err = run_cli("generate", "--checkpoint", str(run["run"]), "--tokenizer",
                             str(run["tokenizer"]), "--prompt", "int", "--max-new-tokens", "2",
                             "--device", "auto", "--json")
    assert code == 0 and json.loads(out.splitlines()[0])["tokens"] >= 1, err


@pytest.mark.parametrize("args", [
    ("--max-model-len", "100000000", "--max-num-seqs", "1000"),  # a KV cache of terabytes
    ("--max-model-len", "1099511627776",),
    ("--num-blocks", "2147483647", "--block-size", "4096"),
])
def test_serve_refuses_a_cache_no_memory_can_hold(run, args):
    line = refused("serve", "--checkpoint", str(run["run"]), "--tokenizer",
                   str(run["tokenizer"]), "--device", "cpu", "--port", "0", *args)
    assert "available" in line or "2^31-1" in line
