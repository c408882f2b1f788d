"""The parsed, validated, immutable form of a pattern: a tuple of :class:`LayerSpec`."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from functools import cached_property

from megacpp.pattern.errors import PatternError
from megacpp.pattern.format import format_plan
from megacpp.pattern.registry import FAMILIES, LETTERS

MAX_LAYERS = 4096  # upper bound on sublayers in one plan (after expanding repetitions)


@dataclass(frozen=True, slots=True)
class LayerSpec:
    """One sublayer: position in the stack, family letter, variant, pipeline stage.

    ``variant`` is the resolved variant name (``'gqa'`` for a bare ``A``) or None for
    families without variants (E, R, D).
    """

    index: int
    family: str
    variant: str | None
    stage: int

    @property
    def label(self) -> str:
        """Full label with the variant spelled out: ``'A:gqa'``, ``'M:mimo'``, ``'E'``."""
        return FAMILIES[self.family].label(self.variant)

    @property
    def token(self) -> str:
        """Canonical pattern token: the default variant is omitted (``'A'``, ``'A:mla'``)."""
        if self.variant == FAMILIES[self.family].default_variant:
            return self.family
        return self.label

    @property
    def implemented(self) -> bool:
        return FAMILIES[self.family].is_implemented(self.variant)


@dataclass(frozen=True)
class LayerPlan:
    """A validated stack of sublayers, split into one or more pipeline stages.

    Build one with :func:`megacpp.pattern.parse`; constructing it directly validates too.
    Two plans are equal exactly when they describe the same layers in the same stages.
    """

    layers: tuple[LayerSpec, ...]

    def __post_init__(self) -> None:
        _validate_layers(self.layers)

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def num_stages(self) -> int:
        return self.layers[-1].stage + 1

    @cached_property
    def stages(self) -> tuple[tuple[LayerSpec, ...], ...]:
        """The layers grouped by pipeline stage, in order."""
        grouped: list[list[LayerSpec]] = [[] for _ in range(self.num_stages)]
        for layer in self.layers:
            grouped[layer.stage].append(layer)
        return tuple(tuple(stage) for stage in grouped)

    @property
    def stage_sizes(self) -> tuple[int, ...]:
        return tuple(len(stage) for stage in self.stages)

    @property
    def letters(self) -> str:
        """Family letters in order, no variants or stage separators: ``'AEMEAEMR'``."""
        return "".join(layer.family for layer in self.layers)

    @property
    def family_counts(self) -> dict[str, int]:
        """Layers per family letter, in registry order (A, E, M, R, D), zeros omitted."""
        counts = Counter(layer.family for layer in self.layers)
        return {letter: counts[letter] for letter in LETTERS if counts[letter]}

    @property
    def label_counts(self) -> dict[str, int]:
        """Layers per full label (``'A:gqa'``, ``'A:mla'``, ``'E'``...), first-seen order."""
        return dict(Counter(layer.label for layer in self.layers))

    def format(self, *, compress: bool = False) -> str:
        """The canonical text of this plan (see :func:`megacpp.pattern.format_plan`)."""
        return format_plan(self, compress=compress)

    def __str__(self) -> str:
        return self.format()


def _validate_layers(layers: tuple[LayerSpec, ...]) -> None:
    """Indices 0..n-1, stages 0..k-1 without gaps, known families/variants, 1..MAX layers."""
    if not layers:
        raise PatternError("a layer plan needs at least one layer")
    if len(layers) > MAX_LAYERS:
        raise PatternError(f"a layer plan has {len(layers)} layers; the limit is {MAX_LAYERS}")
    previous_stage = 0
    for position, layer in enumerate(layers):
        if layer.index != position:
            raise PatternError(f"layer at position {position} has index {layer.index}")
        if layer.stage not in (previous_stage, previous_stage + 1) or (
            position == 0 and layer.stage != 0
        ):
            raise PatternError(f"layer {position} jumps to stage {layer.stage}")
        previous_stage = layer.stage
        _validate_family_variant(layer)


def _validate_family_variant(layer: LayerSpec) -> None:
    family = FAMILIES.get(layer.family)
    if family is None:
        raise PatternError(
            f"layer {layer.index} has unknown family {layer.family!r}; allowed: "
            f"{', '.join(LETTERS)}"
        )
    if family.variants and family.variant(layer.variant or "") is None:
        names = ", ".join(v.name for v in family.variants)
        raise PatternError(
            f"layer {layer.index} has unknown variant {layer.variant!r} for "
            f"{layer.family}; allowed: {names}"
        )
    if not family.variants and layer.variant is not None:
        raise PatternError(f"layer {layer.index}: {layer.family} takes no variant")
