"""The family/variant registry and the builder's fail-closed gate."""

from __future__ import annotations

import pytest

from megacpp.pattern import (
    FAMILIES,
    LETTERS,
    PatternError,
    UnbuildableLayerError,
    buildable_labels,
    parse,
    require_buildable,
)
from tests.pattern.unbuilt import LANDS_WITH, add_unbuilt_variant


def test_families_and_variants():
    assert LETTERS == "AEMRD"
    assert [v.name for v in FAMILIES["A"].variants] == ["gqa", "mla", "dsa"]
    assert [v.name for v in FAMILIES["M"].variants] == ["siso", "mimo"]
    assert FAMILIES["A"].default_variant == "gqa"
    assert FAMILIES["M"].default_variant == "siso"
    for letter in "ERD":
        assert FAMILIES[letter].variants == ()
        assert FAMILIES[letter].default_variant is None


def test_implemented_flags():
    implemented = {
        FAMILIES[letter].label(v): FAMILIES[letter].is_implemented(v)
        for letter in LETTERS
        for v in ([x.name for x in FAMILIES[letter].variants] or [None])
    }
    assert implemented == {
        "A:gqa": True,
        "A:mla": True,
        "A:dsa": True,
        "E": True,
        "M:siso": True,
        "M:mimo": True,
        "R": True,
        "D": True,
    }
    assert buildable_labels() == ["A:gqa", "A:mla", "A:dsa", "E", "M:siso", "M:mimo", "R", "D"]


def test_buildable_plan_passes():
    require_buildable(parse("(AEMEAEMEAEMR)x4 AEMEAEMR | D A:mla A:dsa M:mimo"))


@pytest.mark.parametrize(
    "pattern,index",
    [("AEM M:later", 3), ("M:later", 0), ("AE|M:later", 2)],
)
def test_unbuildable_variant_fails_closed_naming_the_layer(monkeypatch, pattern, index):
    label = add_unbuilt_variant(monkeypatch)
    with pytest.raises(UnbuildableLayerError) as info:
        require_buildable(parse(pattern))
    exc = info.value
    assert isinstance(exc, PatternError)
    assert (exc.index, exc.label) == (index, label)
    assert str(exc) == (
        f"layer {index} '{label}' is not implemented yet (lands with {LANDS_WITH}); "
        "buildable: A:gqa, A:mla, A:dsa, E, M:siso, M:mimo, R, D"
    )


def test_unbuildable_message_counts_the_other_offenders(monkeypatch):
    add_unbuilt_variant(monkeypatch)
    with pytest.raises(UnbuildableLayerError, match=r"layer 1 'M:later' .*; 2 more unbuildable"):
        require_buildable(parse("E M:later A:mla M:later A:dsa M:later"))
