"""Self-contained checkpoints: the model config and tokenizer travel inside every checkpoint,
so a run directory (or one checkpoint) moved anywhere loads, with its dataset gone."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from megacpp.export.hf import export_run
from megacpp.model.config import load_config
from megacpp.pretrained import load_pretrained
from megacpp.train import checkpoint as checkpoint_module
from megacpp.train.checkpoint import (
    MARKER,
    CheckpointError,
    CheckpointManager,
    load_checkpoint_tokenizer,
    load_trained_model,
    resolve_checkpoint,
)
from megacpp.train.config import RunConfig, to_toml
from megacpp.train.parallelize import DistEnv
from megacpp.train.trainer import train
from tests.train.helpers import build_dataset, megacpp, run_config

PROMPT = "template <typename T>\nT twice(T x) {\n"


def _train(dataset: Path, run_dir: Path, steps: int = 2) -> Path:
    from rich.console import Console

    cfg = RunConfig.from_dict(run_config(dataset, run_dir, train={"steps": steps,
                                                                  "eval_every": steps},
                                         checkpoint={"every": steps, "keep_last": 1}))
    train(cfg, console=Console(quiet=True))
    return run_dir


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory, cpp_dataset) -> Path:
    return _train(cpp_dataset, tmp_path_factory.mktemp("portable") / "run")


def test_a_checkpoint_holds_its_model_config_and_tokenizer(run_dir, cpp_dataset):
    step = run_dir / "checkpoints" / "step_000002"
    assert resolve_checkpoint(run_dir) == step == resolve_checkpoint(step)
    listed = json.loads((step / MARKER).read_text())["files"]
    assert {"model.toml", "tokenizer.json"} <= set(listed)  # hashed like every other file
    model = load_trained_model(run_dir)  # a run directory, not only a step directory
    assert load_config(step / "model.toml") == model.cfg
    assert (step / "tokenizer.json").read_bytes() == (cpp_dataset / "tokenizer.json").read_bytes()
    assert load_checkpoint_tokenizer(run_dir).vocab_size == model.cfg.vocab_size


def test_one_checkpoint_copied_elsewhere_loads_alone(run_dir, tmp_path):
    copy = tmp_path / "somewhere" / "model"
    shutil.copytree(run_dir / "checkpoints" / "step_000002", copy)
    loaded = load_pretrained(copy)
    assert loaded.source == copy and not loaded.model.training
    reference = load_pretrained(run_dir)
    assert loaded.generate(PROMPT, max_new_tokens=8, seed=1) == reference.generate(
        PROMPT, max_new_tokens=8, seed=1)


def test_loading_hashes_each_checkpoint_file_once(run_dir, tmp_path, monkeypatch):
    """load_pretrained and export_run verify the checkpoint once: each file is hashed one time
    (a large checkpoint's sha256 pass is its slowest part)."""
    hashed: list[str] = []
    real_sha256 = checkpoint_module.sha256_file

    def counting_sha256(file: Path) -> str:
        hashed.append(Path(file).name)
        return real_sha256(file)

    monkeypatch.setattr(checkpoint_module, "sha256_file", counting_sha256)
    listed = set(json.loads((run_dir / "checkpoints" / "step_000002" / MARKER).read_text())
                 ["files"])
    load_pretrained(run_dir)
    assert sorted(hashed) == sorted(listed)
    hashed.clear()
    export_run(run_dir, tmp_path / "hf")
    assert sorted(hashed) == sorted(listed)


def test_errors_name_what_was_looked_for_and_found(run_dir, tmp_path):
    (tmp_path / "notes.txt").write_text("x")
    with pytest.raises(CheckpointError, match=r"neither a run directory \(no checkpoints/ "
                                              r"folder\) nor a checkpoint .*found: notes.txt"):
        resolve_checkpoint(tmp_path)
    with pytest.raises(CheckpointError, match="checkpoint or run directory not found"):
        resolve_checkpoint(tmp_path / "absent")
    (tmp_path / "empty-run" / "checkpoints").mkdir(parents=True)
    with pytest.raises(CheckpointError, match=r"has no checkpoint: looked for .*step_NNNNNN, "
                                              r"found: nothing \(empty\)"):
        load_trained_model(tmp_path / "empty-run")
    broken = tmp_path / "broken-run"
    shutil.copytree(run_dir, broken)
    (broken / "checkpoints" / "step_000002" / MARKER).unlink()
    with pytest.raises(CheckpointError, match="step_000002 has no COMPLETE marker"):
        load_pretrained(broken)


def _legacy_run(root: Path, dataset: Path, source_run: Path) -> Path:
    """A run whose checkpoint has no model.toml or tokenizer.json inside: the tokenizer is
    found only through ``[data] dir`` of its config.toml."""
    model = load_trained_model(source_run)
    env = DistEnv(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"),
                  strategy="single")
    state = {"step": 2, "model_config": model.cfg.to_dict(), "world_size": 1}
    CheckpointManager(root, keep_last=1, env=env).save(2, model, [], state, {})
    (root / "config.toml").write_text(to_toml({"data": {"dir": str(dataset)}}))
    return root


def test_a_checkpoint_without_its_tokenizer_uses_the_runs_dataset(run_dir, cpp_dataset, tmp_path):
    legacy = _legacy_run(tmp_path / "legacy", cpp_dataset, run_dir)
    assert not (legacy / "checkpoints" / "step_000002" / "tokenizer.json").exists()
    loaded = load_pretrained(legacy)
    assert loaded.generate(PROMPT, max_new_tokens=6, seed=2) == load_pretrained(
        run_dir).generate(PROMPT, max_new_tokens=6, seed=2)
    (legacy / "config.toml").write_text(to_toml({"data": {"dir": str(tmp_path / "gone")}}))
    with pytest.raises(CheckpointError, match=r"looked for .*step_000002/tokenizer.json and for "
                                              r"the run's dataset tokenizer .*gone/tokenizer.json"):
        load_pretrained(legacy)
    (legacy / "config.toml").unlink()
    with pytest.raises(CheckpointError, match=r"no tokenizer.json, and its run's dataset cannot "
                                              r"be read from .*config.toml"):
        load_pretrained(legacy)
    # an explicit tokenizer still works
    assert load_pretrained(legacy, tokenizer=cpp_dataset / "tokenizer.json").source.is_dir()


def test_generate_on_a_moved_run_without_its_dataset(tmp_path):
    """The real CLI: train, move the run directory, delete the dataset, generate."""
    dataset = build_dataset(tmp_path / "data")
    run = _train(dataset, tmp_path / "run")
    expected = load_pretrained(run).generate(PROMPT, max_new_tokens=8, temperature=0.8,
                                             top_p=0.95, seed=5)
    moved = tmp_path / "elsewhere" / "my-model"
    moved.parent.mkdir()
    shutil.move(run, moved)
    shutil.rmtree(tmp_path / "data")
    out = megacpp("generate", "--checkpoint", str(moved), "--prompt", PROMPT, "--max-new-tokens",
                  "8", "--temperature", "0.8", "--top-p", "0.95", "--seed", "5", "--json")
    (record,) = [json.loads(line) for line in out.stdout.splitlines()]
    assert record["completion"] == expected
    assert record["checkpoint"] == str(moved / "checkpoints" / "step_000002")
