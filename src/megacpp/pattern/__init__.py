"""The hybrid pattern language: ``"(AEMEAEMEAEMR)x4 AEMEAEMR"`` -> a validated layer plan.

Letters: ``A`` attention (``A:gqa`` default, ``A:mla``, ``A:dsa``), ``E`` mixture-of-experts
FFN, ``M`` Mamba-3 mixer (``M:siso`` default, ``M:mimo``), ``R`` matrix-state recurrent
mixer (gated delta rule), ``D`` dense SwiGLU MLP. ``(...)xN`` repeats, ``|`` starts a new
pipeline stage. Grammar, canonical form and the error catalog: docs/pattern.md.

    >>> plan = parse("(AE)x2 | M:mimo D")
    >>> plan.letters, plan.stage_sizes, format_plan(plan)
    ('AEAEMD', (4, 2), 'AEAE|M:mimoD')
"""

from megacpp.pattern.errors import (
    PatternError,
    PatternSyntaxError,
    TranslationError,
    UnbuildableLayerError,
)
from megacpp.pattern.format import format_plan
from megacpp.pattern.named import NAMED_PATTERNS, load, resolve
from megacpp.pattern.parser import MAX_DEPTH, parse
from megacpp.pattern.plan import MAX_LAYERS, LayerPlan, LayerSpec
from megacpp.pattern.registry import (
    FAMILIES,
    LETTERS,
    FamilyInfo,
    VariantInfo,
    buildable_labels,
    require_buildable,
)

__all__ = [
    "FAMILIES",
    "LETTERS",
    "MAX_DEPTH",
    "MAX_LAYERS",
    "NAMED_PATTERNS",
    "FamilyInfo",
    "LayerPlan",
    "LayerSpec",
    "PatternError",
    "PatternSyntaxError",
    "TranslationError",
    "UnbuildableLayerError",
    "VariantInfo",
    "buildable_labels",
    "format_plan",
    "load",
    "parse",
    "require_buildable",
    "resolve",
]
