"""The run config: loading, overrides, validation errors, the resolved TOML round trip."""

from __future__ import annotations

import pytest

from megacpp.errors import ConfigError
from megacpp.train.config import RunConfig, load_run_config, parse_value, to_toml
from tests.train.helpers import run_config, write_config


def test_shipped_tiny_cpu_config_loads():
    cfg = load_run_config("tiny-cpu")
    assert cfg.run.name == "tiny-cpu" and cfg.model_preset == "tiny"
    assert cfg.model_overrides["vocab_size"] == "dataset"
    assert cfg.model_config(vocab_size=777).vocab_size == 777
    assert cfg.train.steps > 0 and cfg.optim.muon


def test_overrides_are_applied_and_recorded(tmp_path):
    path = write_config(tmp_path / "r.toml", run_config(tmp_path / "data", tmp_path / "run"))
    cfg = load_run_config(path, ["train.steps=11", "optim.lr=1e-3", "model.attention.n_heads=4",
                                 "run.out_dir=/x/y", "parallel.activation_checkpointing=ME"])
    assert cfg.train.steps == 11 and cfg.optim.lr == 1e-3
    assert cfg.model_config(vocab_size=512).attention.n_heads == 4
    assert cfg.run.out_dir == "/x/y" and cfg.parallel.activation_checkpointing == "ME"
    assert cfg.overrides == ("train.steps=11", "optim.lr=1e-3", "model.attention.n_heads=4",
                             "run.out_dir=/x/y", "parallel.activation_checkpointing=ME")


def test_parse_value_reads_toml_literals_else_strings():
    assert parse_value("10") == 10 and parse_value("3e-4") == 3e-4
    assert parse_value("true") is True and parse_value("[1, 2]") == [1, 2]
    assert parse_value("/tmp/data") == "/tmp/data" and parse_value('"x y"') == "x y"


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("train.stepz=3", "unknown key(s) ['stepz'] in [train]"),
        ("train.steps=0", "train.steps = 0 is invalid; allowed: an integer >= 1"),
        ("train.steps=many", "train.steps = 'many': expected an integer"),
        ("schedule.kind=linear", "schedule.kind = 'linear' is invalid; allowed: cosine | wsd"),
        ("parallel.activation_checkpointing=MX", "block letters from A E M R D"),
        ("model.attention.n_kv_heads=3", "attention.n_kv_heads = 3 is invalid"),
        ("model.d_modle=3", "unknown key(s) ['d_modle'] in [model]"),
        ("optim.beta2=1.0", "optim.beta2 = 1.0 is invalid"),
        ("debug.nan_step=3", "debug.nan_target"),
        ("extra.x=1", "unknown table(s) ['extra']"),
        ("steps=1", "expected TABLE.KEY=VALUE"),
        ("preflight.skip=cuda-driver", "[preflight] skip must be a list"),
    ],
)
def test_bad_values_name_the_key(tmp_path, override, message):
    path = write_config(tmp_path / "r.toml", run_config(tmp_path / "data", tmp_path / "run"))
    with pytest.raises(ConfigError) as err:
        load_run_config(path, [override])
    assert message in str(err.value)


def test_missing_and_malformed_files_are_clear_errors(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        load_run_config("no-such-config")
    with pytest.raises(ConfigError, match="run config .* does not exist"):
        load_run_config(tmp_path / "missing.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("[train\nsteps = 3\n")
    with pytest.raises(ConfigError, match="is not valid TOML"):
        load_run_config(bad)
    no_model = tmp_path / "nomodel.toml"
    no_model.write_text('[data]\ndir = "x"\n[train]\nsteps = 1\n')
    with pytest.raises(ConfigError, match="model.preset is required"):
        load_run_config(no_model)


def test_resolved_config_round_trips_through_toml(tmp_path):
    cfg = load_run_config(write_config(tmp_path / "r.toml",
                                       run_config(tmp_path / "data", tmp_path / "run")))
    model = cfg.model_config(vocab_size=512)
    resolved = tmp_path / "resolved.toml"
    resolved.write_text(to_toml(cfg.to_dict(model), header="resolved"))
    again = load_run_config(resolved)
    assert again.model_config() == model  # vocab_size is now a number: no dataset needed
    assert again.to_dict(model) == cfg.to_dict(model)
    assert isinstance(again, RunConfig) and again.model_overrides["vocab_size"] == 512
