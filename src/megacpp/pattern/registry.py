"""The sublayer families a pattern letter names, their variants, and what is buildable today.

Each letter is one pre-norm residual sublayer ``x + f(norm(x))``. A family either has named
variants (``A:gqa``, ``M:mimo``; one is the default and may be omitted) or none at all
(``E``, ``R``, ``D`` -- writing ``E:anything`` is a syntax error). A variant may parse fine
yet not be implemented: :func:`require_buildable` is the model builder's fail-closed gate.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from megacpp.pattern.errors import UnbuildableLayerError

if TYPE_CHECKING:
    from megacpp.pattern.plan import LayerPlan


@dataclass(frozen=True, slots=True)
class VariantInfo:
    """One named variant of a family; ``lands_with`` says what brings an unimplemented one."""

    name: str
    description: str
    implemented: bool
    lands_with: str | None = None


@dataclass(frozen=True, slots=True)
class FamilyInfo:
    """A pattern letter: its name, description and (possibly empty) variant list."""

    letter: str
    name: str
    description: str
    variants: tuple[VariantInfo, ...] = ()
    implemented: bool = True  # only consulted for families without variants

    @property
    def default_variant(self) -> str | None:
        """The variant a bare letter means (the first listed), or None if no variants."""
        return self.variants[0].name if self.variants else None

    def variant(self, name: str) -> VariantInfo | None:
        return next((v for v in self.variants if v.name == name), None)

    def label(self, variant: str | None) -> str:
        """Full display label: ``A:gqa`` for families with variants, ``E`` otherwise."""
        return f"{self.letter}:{variant}" if variant is not None else self.letter

    def is_implemented(self, variant: str | None) -> bool:
        if variant is None:
            return self.implemented
        info = self.variant(variant)
        return info is not None and info.implemented


FAMILIES: dict[str, FamilyInfo] = {
    f.letter: f
    for f in (
        FamilyInfo(
            "A",
            "attention",
            "causal self-attention mixer",
            (
                VariantInfo("gqa", "grouped-query attention", implemented=True),
                VariantInfo("mla", "multi-head latent attention", implemented=True),
                VariantInfo("dsa", "DeepSeek sparse attention", implemented=True),
            ),
        ),
        FamilyInfo("E", "moe", "mixture-of-experts SwiGLU FFN"),
        FamilyInfo(
            "M",
            "mamba3",
            "Mamba-3 state-space mixer",
            (
                VariantInfo("siso", "single-input single-output Mamba-3", implemented=True),
                VariantInfo("mimo", "multi-input multi-output Mamba-3", implemented=True),
            ),
        ),
        FamilyInfo("R", "recurrent", "matrix-state recurrent mixer (gated delta rule)"),
        FamilyInfo("D", "mlp", "dense SwiGLU MLP"),
    )
}

LETTERS: str = "".join(FAMILIES)  # "AEMRD": the registry order used in every listing


def buildable_labels() -> list[str]:
    """Every family/variant the model builder can build, e.g. ``['A:gqa', 'E', ...]``."""
    labels = []
    for family in FAMILIES.values():
        if not family.variants:
            if family.implemented:
                labels.append(family.letter)
            continue
        labels += [family.label(v.name) for v in family.variants if v.implemented]
    return labels


def require_buildable(plan: LayerPlan) -> None:
    """Fail closed if any layer of ``plan`` names a variant that is not implemented yet.

    Raises :class:`UnbuildableLayerError` naming the first such layer (index, label and
    what it lands with) and listing what is buildable.
    """
    unbuildable = [layer for layer in plan.layers if not layer.implemented]
    if not unbuildable:
        return
    first = unbuildable[0]
    info = FAMILIES[first.family].variant(first.variant) if first.variant else None
    why = f" (lands with {info.lands_with})" if info and info.lands_with else ""
    more = f"; {len(unbuildable) - 1} more unbuildable layer(s)" if len(unbuildable) > 1 else ""
    raise UnbuildableLayerError(
        f"layer {first.index} {first.label!r} is not implemented yet{why}{more}; "
        f"buildable: {', '.join(buildable_labels())}",
        index=first.index,
        label=first.label,
    )
