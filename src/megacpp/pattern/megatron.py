"""Translate a :class:`LayerPlan` into Megatron-Core's hybrid layer pattern and flags.

Megatron-Core's ``MambaModel``/``MambaStack`` builds one layer per character of
``hybrid_override_pattern``; the characters are ``megatron.core.ssm.
mamba_hybrid_layer_allocation.Symbols``: ``M`` Mamba, ``*`` attention, ``-`` MLP, ``E`` MoE.
The mapping below is *structural* (same layer kind in the same place), not numerical: e.g.
Megatron's Mamba layer runs a Mamba-2 (SSD) mixer where ours is Mamba-3.

Pipeline stages: megatron-core 0.16.1 has no stage separator in the hybrid pattern.
``MambaStack`` splits ``num_layers`` evenly over the pipeline ranks, except that the first
and/or last stage may have their own size (``num_layers_in_first/last_pipeline_stage``); the
middle stages must be equal. Our ``|`` stages are mapped onto that when they fit, otherwise
the translation fails closed.

Everything here was checked against megatron-core 0.16.1 (tests/pattern/test_megatron.py
runs the real ``Symbols``, ``allocate_layers``, ``TransformerConfig`` and ``MambaStack``
split against it). Flag spellings come from Megatron-LM's ``megatron/training/arguments.py``
(the training scripts are not part of the megatron-core wheel); each flag names the
megatron-core field it sets, and those fields are the ones the tests verify.
"""

from __future__ import annotations

import importlib.metadata
import shlex
from dataclasses import dataclass
from typing import Any

from megacpp.pattern.errors import TranslationError
from megacpp.pattern.plan import LayerPlan

MEGATRON_CORE_VERIFIED = "0.16.1"
MEGATRON_LM_ARGUMENTS_SOURCE = (
    "NVIDIA/Megatron-LM megatron/training/arguments.py @ 000c4ac24f61159c138b0975def722c65245983c"
)

# Our layer label -> Megatron-Core hybrid symbol (Symbols.ATTENTION/MAMBA/MOE/MLP).
SYMBOLS: dict[str, str] = {"A:gqa": "*", "M:siso": "M", "E": "E", "D": "-"}

# Megatron-Core hybrid symbol -> the layer kind MambaStack builds for it.
SYMBOL_KINDS: dict[str, str] = {
    "*": "attention (TransformerLayer)",
    "M": "Mamba (MambaLayer, Mamba-2 mixer)",
    "-": "dense MLP (TransformerLayer)",
    "E": "MoE (TransformerLayer)",
}

# Our layer label -> why it has no verified Megatron-Core hybrid mapping.
NO_MAPPING: dict[str, str] = {
    "A:mla": (
        "megatron-core has multi-latent attention for GPTModel, but its hybrid MambaStack "
        "builds every '*' from one attention layer spec; an MLA '*' is not verified"
    ),
    "A:dsa": (
        "megatron-core offers DSA only as GPTModel's experimental_attention_variant='dsa', "
        "not as a hybrid pattern symbol"
    ),
    "M:mimo": "Megatron's Mamba layer is a Mamba-2 (SSD) mixer with no MIMO form",
    "R": (
        "megatron-core has a GatedDeltaNet, but only as GPTModel's "
        "experimental_attention_variant='gated_delta_net'; the hybrid pattern has no symbol "
        "for it (Symbols: M, *, -, E)"
    ),
}


@dataclass(frozen=True, slots=True)
class MegatronFlag:
    """One Megatron-LM command-line flag and the megatron-core field it sets.

    ``value`` is None when the pattern does not determine it (the user must supply it).
    ``target`` is ``"<Class>.<field>"``, e.g. ``"TransformerConfig.num_layers"``.
    """

    flag: str
    value: int | str | None
    target: str


@dataclass(frozen=True)
class MegatronTranslation:
    """The result of :func:`to_megatron`."""

    pattern: str  # our canonical pattern
    hybrid_override_pattern: str
    num_layers: int
    stage_sizes: tuple[int, ...]
    flags: tuple[MegatronFlag, ...]
    notes: tuple[str, ...]
    installed_megatron_core: str | None

    @property
    def argv(self) -> list[str]:
        """The determined flags as an argument list (flags still missing a value left out)."""
        return [part for f in self.flags if f.value is not None for part in (f.flag, str(f.value))]

    @property
    def missing(self) -> list[str]:
        """Flags the pattern implies but cannot fill in (e.g. ``--num-experts``)."""
        return [f.flag for f in self.flags if f.value is None]

    def shell_command(self) -> str:
        """The flags as shell text, quoted (``*`` would otherwise glob), placeholders shown."""
        parts = [
            f"{shlex.quote(f.flag)} {shlex.quote(str(f.value))}"
            if f.value is not None
            else f"{f.flag} <{f.flag.lstrip('-').replace('-', '_').upper()}>"
            for f in self.flags
        ]
        return " ".join(parts)

    def config_kwargs(self) -> dict[str, dict[str, Any]]:
        """Determined values per megatron-core class: ``{"TransformerConfig": {...}, ...}``."""
        kwargs: dict[str, dict[str, Any]] = {}
        for f in self.flags:
            if f.value is not None:
                cls, field = f.target.split(".")
                kwargs.setdefault(cls, {})[field] = f.value
        return kwargs

    def to_json(self) -> dict[str, Any]:
        return {
            "target": "megatron",
            "megatron_core_verified": MEGATRON_CORE_VERIFIED,
            "installed_megatron_core": self.installed_megatron_core,
            "flag_source": MEGATRON_LM_ARGUMENTS_SOURCE,
            "pattern": self.pattern,
            "hybrid_override_pattern": self.hybrid_override_pattern,
            "num_layers": self.num_layers,
            "stage_sizes": list(self.stage_sizes),
            "flags": [{"flag": f.flag, "value": f.value, "target": f.target} for f in self.flags],
            "argv": self.argv,
            "missing": self.missing,
            "config": self.config_kwargs(),
            "notes": list(self.notes),
        }


def to_megatron(
    plan: LayerPlan, *, num_experts: int | None = None, moe_router_topk: int | None = None
) -> MegatronTranslation:
    """Translate ``plan`` to Megatron-Core; fail closed on anything without a verified mapping.

    ``num_experts``/``moe_router_topk`` fill in the MoE flags (the pattern says *where* the
    MoE layers are, not how many experts they have). Raises :class:`TranslationError` naming
    the layer index for unmapped layers, or the stage sizes for an inexpressible split.
    """
    symbols = _symbols(plan)
    has_moe = "E" in plan.family_counts
    _check_moe_options(has_moe, num_experts, moe_router_topk)
    flags = [
        MegatronFlag("--hybrid-override-pattern", symbols, "MambaModel.hybrid_override_pattern"),
        MegatronFlag("--num-layers", plan.num_layers, "TransformerConfig.num_layers"),
        *_pipeline_flags(plan.stage_sizes),
    ]
    if has_moe:
        flags.append(
            MegatronFlag("--num-experts", num_experts, "TransformerConfig.num_moe_experts")
        )
    if moe_router_topk is not None:
        flags.append(
            MegatronFlag("--moe-router-topk", moe_router_topk, "TransformerConfig.moe_router_topk")
        )
    installed = _installed_megatron_core()
    return MegatronTranslation(
        pattern=plan.format(),
        hybrid_override_pattern=symbols,
        num_layers=plan.num_layers,
        stage_sizes=plan.stage_sizes,
        flags=tuple(flags),
        notes=tuple(_notes(plan, num_experts, installed)),
        installed_megatron_core=installed,
    )


def _symbols(plan: LayerPlan) -> str:
    unmapped = [layer for layer in plan.layers if layer.label not in SYMBOLS]
    if unmapped:
        first = unmapped[0]
        more = f" ({len(unmapped) - 1} more unmapped layer(s))" if len(unmapped) > 1 else ""
        mappable = ", ".join(f"{label} -> {sym!r}" for label, sym in SYMBOLS.items())
        raise TranslationError(
            f"layer {first.index} {first.label!r} has no verified Megatron-Core mapping: "
            f"{NO_MAPPING[first.label]}{more}; mappable: {mappable}",
            index=first.index,
            label=first.label,
        )
    return "".join(SYMBOLS[layer.label] for layer in plan.layers)


def _check_moe_options(has_moe: bool, num_experts: int | None, topk: int | None) -> None:
    for name, value in (("--num-experts", num_experts), ("--moe-router-topk", topk)):
        if value is None:
            continue
        if not has_moe:
            raise TranslationError(f"{name} was given but the pattern has no E (MoE) layer")
        if value < 1:
            raise TranslationError(f"{name} must be a positive integer, got {value}")
    if num_experts is not None and topk is not None and topk > num_experts:
        raise TranslationError(
            f"--moe-router-topk {topk} exceeds --num-experts {num_experts}; "
            "a token cannot route to more experts than exist"
        )


def _pipeline_flags(sizes: tuple[int, ...]) -> list[MegatronFlag]:
    """Map stage sizes onto MambaStack's split: even, or first/last stage sized apart."""
    if len(sizes) == 1:
        return []
    flags = [
        MegatronFlag(
            "--pipeline-model-parallel-size",
            len(sizes),
            "TransformerConfig.pipeline_model_parallel_size",
        )
    ]
    first, last = _uneven_ends(sizes)
    if first is not None:
        flags.append(
            MegatronFlag(
                "--decoder-first-pipeline-num-layers",
                first,
                "TransformerConfig.num_layers_in_first_pipeline_stage",
            )
        )
    if last is not None:
        flags.append(
            MegatronFlag(
                "--decoder-last-pipeline-num-layers",
                last,
                "TransformerConfig.num_layers_in_last_pipeline_stage",
            )
        )
    return flags


def _uneven_ends(sizes: tuple[int, ...]) -> tuple[int | None, int | None]:
    """(first, last) stage sizes to set explicitly so the remaining stages are equal."""
    if len(set(sizes)) == 1:
        return None, None
    if len(set(sizes[1:])) == 1:
        return sizes[0], None
    if len(set(sizes[:-1])) == 1:
        return None, sizes[-1]
    if len(set(sizes[1:-1])) == 1:
        return sizes[0], sizes[-1]
    raise TranslationError(
        f"pipeline stage sizes {list(sizes)} cannot be expressed in megatron-core "
        f"{MEGATRON_CORE_VERIFIED}: MambaStack splits layers evenly over pipeline ranks except "
        "that the first and/or last stage may differ, so the middle stages must be equal"
    )


def _notes(plan: LayerPlan, num_experts: int | None, installed: str | None) -> list[str]:
    counts = plan.family_counts
    notes = [
        (
            "Structural mapping: each sublayer becomes one Megatron hybrid layer of the same "
            "kind in the same place; numerics and parameter shapes follow Megatron's "
            "implementations."
        )
    ]
    if "M" in counts:
        notes.append(
            "'M' maps to Megatron's Mamba layer kind, whose mixer is Mamba-2 (SSD); ours is "
            "Mamba-3 (siso). Same position in the stack, not the same computation."
        )
    if "A" in counts:
        notes.append(
            "'*' is Megatron's attention layer; for grouped-query attention also pass "
            "--group-query-attention --num-query-groups <G> from your model config."
        )
    if "D" in counts:
        notes.append("'-' is Megatron's dense MLP layer; it is SwiGLU only with --swiglu.")
    if "E" in counts and num_experts is None:
        notes.append(
            "'E' layers are built only when --num-experts is set; the pattern does not fix the "
            "expert count, so pass --num-experts N to fill it in."
        )
    if len(plan.stage_sizes) > 1:
        notes.append(
            f"Pipeline stages {list(plan.stage_sizes)} map to MambaStack's split; Megatron "
            "does not support virtual/interleaved pipeline stages for hybrid models."
        )
    if installed is not None and installed != MEGATRON_CORE_VERIFIED:
        notes.append(
            f"Installed megatron-core {installed} differs from the verified "
            f"{MEGATRON_CORE_VERIFIED}; re-run tests/pattern/test_megatron.py before relying on "
            "this mapping."
        )
    return notes


def _installed_megatron_core() -> str | None:
    """The installed megatron-core version (package metadata only; nothing is imported)."""
    try:
        return importlib.metadata.version("megatron-core")
    except importlib.metadata.PackageNotFoundError:
        return None
