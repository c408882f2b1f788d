"""Parsing valid patterns: layers, variants, repetition, stages, names, plan properties."""

from __future__ import annotations

import dataclasses

import pytest

from megacpp.pattern import (
    MAX_LAYERS,
    NAMED_PATTERNS,
    LayerPlan,
    LayerSpec,
    PatternError,
    load,
    parse,
    resolve,
)


def test_layers_get_index_family_variant_and_stage():
    plan = parse("A E|M:mimo D")
    assert plan.layers == (
        LayerSpec(0, "A", "gqa", 0),
        LayerSpec(1, "E", None, 0),
        LayerSpec(2, "M", "mimo", 1),
        LayerSpec(3, "D", None, 1),
    )
    assert [layer.label for layer in plan.layers] == ["A:gqa", "E", "M:mimo", "D"]
    assert [layer.token for layer in plan.layers] == ["A", "E", "M:mimo", "D"]


def test_bare_letter_means_the_default_variant():
    assert parse("A") == parse("A:gqa")
    assert parse("M") == parse("M:siso")
    assert parse("A:mla") != parse("A")


def test_whitespace_between_tokens_is_ignored():
    spaced = " ( A :  mla E )\tx 3 \n|  M : mimo R "
    assert parse(spaced) == parse("(A:mlaE)x3|M:mimoR")


def test_repetition_expands_and_x_is_case_insensitive():
    assert parse("(AEME)x3").letters == "AEME" * 3
    assert parse("(AEME)X3") == parse("(AEME)x3")
    assert parse("(AE)x03") == parse("(AE)x3")


def test_nested_repetition():
    assert parse("((AE)x2 M)x3 R").letters == ("AEAEM" * 3) + "R"


def test_stage_separator_inside_a_group_repeats_stages():
    plan = parse("(AEME|)x3 AEMR")
    assert plan.stage_sizes == (4, 4, 4, 4)
    assert plan.num_stages == 4
    assert [layer.stage for layer in plan.layers] == [i // 4 for i in range(16)]


def test_plan_properties():
    plan = parse("(AEMEAEMEAEMR)x2 | D A:dsa")
    assert plan.num_layers == 26
    assert plan.stage_sizes == (24, 2)
    assert [len(stage) for stage in plan.stages] == [24, 2]
    assert plan.letters == "AEMEAEMEAEMR" * 2 + "DA"
    assert plan.family_counts == {"A": 7, "E": 10, "M": 6, "R": 2, "D": 1}
    assert list(plan.family_counts) == ["A", "E", "M", "R", "D"]  # registry order
    assert plan.label_counts == {"A:gqa": 6, "E": 10, "M:siso": 6, "R": 2, "D": 1, "A:dsa": 1}


def test_plan_is_immutable_and_hashable():
    plan = parse("AEM")
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.layers = ()  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.layers[0].family = "E"  # type: ignore[misc]
    assert len({plan, parse("A E M")}) == 1


def test_layer_limit_is_inclusive():
    assert parse(f"(A)x{MAX_LAYERS}").num_layers == MAX_LAYERS
    assert parse(f"((AE)x{MAX_LAYERS // 2})x1").num_layers == MAX_LAYERS


def test_nam56r_is_the_flagship_56_layer_hybrid():
    plan = load("NAM56R")
    assert plan.num_layers == 56
    assert plan.num_stages == 1
    assert plan.family_counts == {"A": 14, "E": 23, "M": 14, "R": 5}
    assert plan.letters == "AEMEAEMEAEMR" * 4 + "AEMEAEMR"


def test_names_resolve_case_insensitively_and_other_text_passes_through():
    assert resolve("nam56r") == resolve(" NAM56R ") == NAMED_PATTERNS["NAM56R"]
    assert resolve("AEME") == "AEME"
    assert load("Nam56R") == parse(NAMED_PATTERNS["NAM56R"])


@pytest.mark.parametrize("name", sorted(NAMED_PATTERNS))
def test_a_name_is_never_itself_a_pattern(name):
    with pytest.raises(PatternError):
        parse(name)
    with pytest.raises(PatternError):
        parse(name.lower())


@pytest.mark.parametrize(
    "layers,match",
    [
        ((), "at least one layer"),
        ((LayerSpec(1, "A", "gqa", 0),), "index 1"),
        ((LayerSpec(0, "A", "gqa", 1),), "stage 1"),
        ((LayerSpec(0, "A", "gqa", 0), LayerSpec(1, "E", None, 2)), "stage 2"),
        ((LayerSpec(0, "Q", None, 0),), "unknown family 'Q'"),
        ((LayerSpec(0, "A", "foo", 0),), "unknown variant 'foo'"),
        ((LayerSpec(0, "A", None, 0),), "unknown variant None"),
        ((LayerSpec(0, "E", "default", 0),), "E takes no variant"),
    ],
)
def test_constructing_an_invalid_plan_directly_fails(layers, match):
    with pytest.raises(PatternError, match=match):
        LayerPlan(layers)


def test_too_many_layers_constructed_directly_fails():
    layers = tuple(LayerSpec(i, "D", None, 0) for i in range(MAX_LAYERS + 1))
    with pytest.raises(PatternError, match=f"limit is {MAX_LAYERS}"):
        LayerPlan(layers)
