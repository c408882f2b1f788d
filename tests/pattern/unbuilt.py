"""A variant that parses but is not built, for the tests of the builder's fail-closed gate
(every shipped variant is implemented)."""

from __future__ import annotations

from dataclasses import replace

from megacpp.pattern import FAMILIES
from megacpp.pattern.registry import VariantInfo

LANDS_WITH = "a mixer not written yet"


def add_unbuilt_variant(monkeypatch) -> str:
    """Register ``M:later`` (parses; not implemented) for this test; returns its label."""
    family = FAMILIES["M"]
    later = VariantInfo("later", "a planned Mamba variant", implemented=False,
                        lands_with=LANDS_WITH)
    monkeypatch.setitem(FAMILIES, "M", replace(family, variants=(*family.variants, later)))
    return "M:later"
