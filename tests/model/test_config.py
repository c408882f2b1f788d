from __future__ import annotations

import pytest

from megacpp.errors import ConfigError
from megacpp.model.config import ModelConfig, list_presets, load_config


def test_every_preset_loads_and_validates():
    names = list_presets()
    assert {"tiny", "nam56r-small", "nam56r-350m", "nam56r-1b"} <= set(names)
    for name in names:
        cfg = load_config(name)
        assert ModelConfig.from_dict(cfg.to_dict()) == cfg  # round trip


@pytest.mark.parametrize(
    ("data", "needle"),
    [
        ({"model": {"d_model": 0}}, "model.d_model = 0 is invalid; allowed: a positive integer"),
        ({"model": {"d_model": "big"}}, "model.d_model = 'big': expected an integer"),
        ({"model": {"tie_embeddings": 1}}, "model.tie_embeddings = 1: expected true or false"),
        ({"model": {"dmodel": 5}}, "unknown key(s) ['dmodel'] in [model]"),
        ({"atention": {}}, "unknown config table(s) ['atention']"),
        (
            {"attention": {"n_heads": 8, "n_kv_heads": 3}},
            "attention.n_kv_heads = 3 is invalid; allowed: a divisor of attention.n_heads=8",
        ),
        ({"attention": {"head_dim": 63}}, "attention.head_dim = 63"),
        (
            {"moe": {"n_experts": 4, "top_k": 5}},
            "moe.top_k = 5 is invalid; allowed: <= moe.n_experts=4",
        ),
        (
            {"mamba": {"rope_fraction": 1.5}},
            "mamba.rope_fraction = 1.5 is invalid; allowed: in (0, 1]",
        ),
        ({"mamba": {"headdim": 48}}, "mamba.headdim = 48 is invalid; allowed: a divisor of"),
        ({"model": {"norm_eps": float("nan")}}, "model.norm_eps = nan: expected a finite number"),
        ({"moe": []}, "[moe] must be a table"),
    ],
)
def test_validation_errors_name_the_field_and_allowed_values(data, needle):
    with pytest.raises(ConfigError) as info:
        ModelConfig.from_dict(data)
    assert needle in str(info.value)


def test_toml_errors(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text("[model\nd_model = 3")
    with pytest.raises(ConfigError, match="not valid TOML"):
        ModelConfig.from_toml(bad)
    with pytest.raises(ConfigError, match="model config .*missing.toml does not exist"):
        ModelConfig.from_toml(tmp_path / "missing.toml")
    with pytest.raises(ConfigError, match="unknown preset 'nope'; presets: "):
        load_config("nope")


def test_a_saved_config_without_the_mamba_output_norm_builds_the_model_it_was():
    """A checkpoint's or export's config is complete: a mamba table without outproj_norm was
    written before the option existed, by a model without the norm; a user's config without it
    gets the default (the norm)."""
    from megacpp.model.model import HybridLM

    saved = ModelConfig.from_dict({"model": {"pattern": "AM", "vocab_size": 64, "d_model": 64},
                                   "mamba": {"d_state": 16, "headdim": 16}}).to_dict()
    assert saved["mamba"]["outproj_norm"] is True
    for written, expected in ((True, True), (False, False), (None, False)):
        data = {**saved, "mamba": dict(saved["mamba"])}
        if written is None:
            del data["mamba"]["outproj_norm"]
        else:
            data["mamba"]["outproj_norm"] = written
        cfg = ModelConfig.from_saved(data)
        assert cfg.mamba.outproj_norm is expected
        keys = HybridLM(cfg).state_dict()
        assert ("blocks.1.mixer.norm_weight" in keys) is expected
        assert ModelConfig.from_dict(data).mamba.outproj_norm is (written is not False)
