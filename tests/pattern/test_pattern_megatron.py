"""The Megatron translation, checked against the real installed megatron-core 0.16.1."""

from __future__ import annotations

import dataclasses
import importlib.metadata
import inspect
import warnings
from types import SimpleNamespace

import pytest
import torch

from megacpp.pattern import FAMILIES, LETTERS, TranslationError, load, parse
from megacpp.pattern.megatron import MEGATRON_CORE_VERIFIED, NO_MAPPING, SYMBOLS, to_megatron

# megatron-core is a pinned dev dependency: import it for real (a missing install fails here,
# it does not skip). Its import-time warnings (no Transformer Engine/Apex on CPU) are noise.
with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    from megatron.core.models.mamba.mamba_model import MambaModel
    from megatron.core.ssm import mamba_hybrid_layer_allocation as mamba_alloc
    from megatron.core.ssm.mamba_block import MambaStack
    from megatron.core.ssm.mamba_hybrid_layer_allocation import Symbols
    from megatron.core.transformer import TransformerConfig

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


# Stage splits MambaStack can express: even, first differs, last differs, both differ.
SPLIT_PATTERNS = [
    "AEMD",
    "(AEMD)x2|(AEMD)x2|(AEMD)x2",
    "(AEMD)x3|AEMD|AEMD",
    "AE|AE|AEMD",
    "AEMD|AE|AE|M",
    "A|M|D|E",
    "AEMDAE|MD",
]


def test_checked_against_megatron_core_0_16_1():
    assert importlib.metadata.version("megatron-core") == MEGATRON_CORE_VERIFIED


def test_symbol_map_matches_the_real_symbols_class():
    assert SYMBOLS == {
        "A:gqa": Symbols.ATTENTION,
        "M:siso": Symbols.MAMBA,
        "E": Symbols.MOE,
        "D": Symbols.MLP,
    }
    assert set(SYMBOLS.values()) == Symbols.VALID


def test_every_family_variant_is_mapped_or_refused_with_a_reason():
    labels = {
        FAMILIES[letter].label(v.name if v else None)
        for letter in LETTERS
        for v in (FAMILIES[letter].variants or (None,))
    }
    assert set(SYMBOLS) | set(NO_MAPPING) == labels
    assert not set(SYMBOLS) & set(NO_MAPPING)


@pytest.mark.parametrize("text", SPLIT_PATTERNS + ["(AEME)x64 D"])
def test_real_allocate_layers_accepts_the_translation(text):
    result = to_megatron(parse(text), num_experts=4)
    allocated = mamba_alloc.allocate_layers(
        result.num_layers, 0.0, 0.0, result.hybrid_override_pattern
    )
    assert allocated == list(result.hybrid_override_pattern)
    assert len(allocated) == parse(text).num_layers


def test_every_flag_sets_a_real_megatron_core_field():
    config_fields = {f.name for f in dataclasses.fields(TransformerConfig)}
    model_params = set(inspect.signature(MambaModel.__init__).parameters)
    # every flag kind at once: pattern, layers, pp size, first and last stage, experts, top-k
    result = to_megatron(parse("(AEMD)x3|AEMD|AE"), num_experts=8, moe_router_topk=2)
    assert len(result.flags) == 7
    for flag in result.flags:
        cls, field = flag.target.split(".")
        assert field in {"TransformerConfig": config_fields, "MambaModel": model_params}[cls]


def _real_config(result, **extra) -> TransformerConfig:
    kwargs = result.config_kwargs()["TransformerConfig"]
    moe = {"moe_ffn_hidden_size": 64} if "num_moe_experts" in kwargs else {}
    return TransformerConfig(
        hidden_size=64, num_attention_heads=4, pipeline_dtype=torch.float32, **moe, **kwargs
    )


@pytest.mark.parametrize("text", SPLIT_PATTERNS)
def test_real_mamba_stack_split_reproduces_our_stages(text):
    plan = parse(text)
    result = to_megatron(plan, num_experts=4)
    config = _real_config(result)  # TransformerConfig.__post_init__ validates the split
    for rank, stage in enumerate(plan.stages):
        fake_stack = SimpleNamespace(
            config=config,
            pp_group=SimpleNamespace(rank=lambda r=rank: r, size=lambda: plan.num_stages),
        )
        layer_list = list(result.hybrid_override_pattern)
        if plan.num_stages == 1:
            selected = layer_list  # MambaStack only splits when pp size > 1
        else:
            offset, selected = MambaStack._select_layers_for_pipeline_parallel(
                fake_stack, layer_list
            )
            assert offset == stage[0].index
        assert "".join(selected) == "".join(SYMBOLS[layer.label] for layer in stage)


@pytest.mark.parametrize(
    "text,flags",
    [
        ("AEMD", []),
        ("AE|MD", ["--pipeline-model-parallel-size", "2"]),
        (
            "AEM|D",
            ["--pipeline-model-parallel-size", "2", "--decoder-first-pipeline-num-layers", "3"],
        ),
        (
            "A|E|MD",
            ["--pipeline-model-parallel-size", "3", "--decoder-last-pipeline-num-layers", "2"],
        ),
        (
            "AAA|E|M|DD",
            [
                "--pipeline-model-parallel-size",
                "4",
                "--decoder-first-pipeline-num-layers",
                "3",
                "--decoder-last-pipeline-num-layers",
                "2",
            ],
        ),
    ],
)
def test_pipeline_flags(text, flags):
    result = to_megatron(parse(text), num_experts=2)
    layers = str(parse(text).num_layers)
    symbols = result.hybrid_override_pattern
    assert result.argv == [
        "--hybrid-override-pattern",
        symbols,
        "--num-layers",
        layers,
        *flags,
        "--num-experts",
        "2",
    ]


def test_inexpressible_stage_split_fails_closed_and_real_megatron_agrees():
    with pytest.raises(TranslationError, match=r"stage sizes \[1, 2, 3, 4\] cannot be expressed"):
        to_megatron(parse("A|AA|AAA|AAAA"))
    # No first/last setting makes MambaStack produce [1, 2, 3, 4]: the middle stages are equal.
    with pytest.raises(ValueError):
        TransformerConfig(
            num_layers=10,
            hidden_size=64,
            num_attention_heads=4,
            pipeline_dtype=torch.float32,
            pipeline_model_parallel_size=4,
            num_layers_in_first_pipeline_stage=1,
            num_layers_in_last_pipeline_stage=4,
        )


@pytest.mark.parametrize(
    "text,index,label",
    [
        ("AEMEAEMEAEMR", 11, "R"),
        ("AE A:mla", 2, "A:mla"),
        ("A:dsa", 0, "A:dsa"),
        ("D|M:mimo", 1, "M:mimo"),
    ],
)
def test_unmapped_layers_fail_closed_naming_the_layer(text, index, label):
    with pytest.raises(TranslationError) as info:
        to_megatron(parse(text))
    assert (info.value.index, info.value.label) == (index, label)
    assert str(info.value).startswith(
        f"layer {index} '{label}' has no verified Megatron-Core mapping"
    )
    assert info.value.exit_code == 2


def test_nam56r_fails_closed_on_its_first_r_layer():
    with pytest.raises(TranslationError, match=r"layer 11 'R' .* \(4 more unmapped layer\(s\)\)"):
        to_megatron(load("NAM56R"))


def test_moe_flags_and_notes():
    result = to_megatron(parse("AEME"))
    assert result.missing == ["--num-experts"]
    assert "--num-experts" not in result.argv
    assert "--num-experts <NUM_EXPERTS>" in result.shell_command()
    assert "'*EME'" in result.shell_command()  # quoted: '*' would glob in a shell
    assert any("Mamba-2" in note and "Mamba-3" in note for note in result.notes)
    full = to_megatron(parse("AEME"), num_experts=8, moe_router_topk=2)
    assert full.missing == []
    assert full.config_kwargs() == {
        "MambaModel": {"hybrid_override_pattern": "*EME"},
        "TransformerConfig": {"num_layers": 4, "num_moe_experts": 8, "moe_router_topk": 2},
    }
    _real_config(full)


@pytest.mark.parametrize(
    "text,kwargs,match",
    [
        ("AMD", {"num_experts": 4}, "--num-experts was given but the pattern has no E"),
        ("AMD", {"moe_router_topk": 2}, "--moe-router-topk was given but the pattern has no E"),
        ("AE", {"num_experts": 0}, "--num-experts must be a positive integer, got 0"),
        ("AE", {"moe_router_topk": -1}, "--moe-router-topk must be a positive integer"),
        ("AE", {"num_experts": 2, "moe_router_topk": 3}, "--moe-router-topk 3 exceeds"),
    ],
)
def test_bad_moe_options_fail_closed(text, kwargs, match):
    with pytest.raises(TranslationError, match=match):
        to_megatron(parse(text), **kwargs)
