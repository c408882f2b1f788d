"""The FP8 training lane (``parallel.float8 = "tensorwise" | "rowwise"``): the model's linear
layers run their three GEMMs (output, input gradient, weight gradient) in float8 through
torchao's float8 training, applied from outside the model by :func:`apply_float8`.

What converts: every ``nn.Linear`` of the model that passes :func:`linear_decisions`. What
stays in bf16, and why, is logged per layer group:

* the LM head (the fused linear cross-entropy reads its weight; tied heads are the
  embedding, which is no linear layer) and the embeddings;
* layers whose weight the mixer multiplies itself (``Mixer.direct_weight_linears``: the MoE
  router stacked with the shared experts' in_proj; router logits stay bf16). Mamba-3's
  in_proj, multiplied in three row slices (``Mixer.row_sliced_linears``), converts: each
  slice takes the float8 GEMM when its row count is a multiple of 16
  (:func:`~megacpp.kernels.ops.float8_linear.torchao_float8.linear_rows`), the small rest
  slice stays bf16;
* shapes the float8 GEMM cannot take (an in or out dim not a multiple of 16) or too small to
  gain (a dim under ``parallel.float8_min_dim``; the scaling work then costs more than the
  GEMM saves);
* the MoE's routed-expert GEMMs, unless ``parallel.float8_experts``: by default they run
  inside the ``moe_experts`` kernel (a fused autograd function over Triton /
  ``torch._grouped_mm`` grouped GEMMs, the SwiGLU in the gate|up GEMM's epilogue, float32
  weight gradients written straight from the accumulators), which has no float8 form. With
  the knob, every MoE layer whose dims are multiples of 16 takes the second expert path,
  :func:`~megacpp.kernels.ops.moe_experts.float8.moe_experts_float8` (torchao's float8
  grouped GEMM over expert groups padded to 16 rows; sm_90);
* the LM head, unless ``parallel.float8_head``: with it, the fused linear cross-entropy runs
  its three GEMMs in float8
  (:func:`~megacpp.kernels.ops.linear_cross_entropy.float8.linear_cross_entropy_float8`;
  the cross-entropy math stays float32), when vocab and d_model are multiples of 16.

The norms, scans, attention and the cross-entropy's softmax keep their own kernels. A run's
float8 setting is named by :func:`lane_name` (``tensorwise``, ``tensorwise+experts+head``,
...): the receipts' ``numerics.float8``.

Order (torchao's float8 docs, torchtitan): the swap comes first, before activation
checkpointing, ``torch.compile`` and ``fully_shard``; compile fuses the amax / scale / cast
work around each GEMM (torchao's float8 training relies on it for its speed). Under FSDP2
with the tensorwise recipe, ``parallel.float8_fsdp_all_gather = true`` all-gathers the
weights in float8 (torchao's ``enable_fsdp_float8_all_gather``): a quarter of the bytes of
the fp32 masters' gather; each weight's scale comes from an all-reduced amax of its shards
(torchao's ``precompute_float8_dynamic_scale_for_fsdp``, one all-reduce for all weights, is
not used).

The lane fails closed: :func:`require_float8` stops a run whose device cannot run
the recipe's GEMMs (CPU, CUDA before sm_89, rowwise before sm_90, no torchao; with
``float8_experts``: before sm_90, or no ``torch._scaled_grouped_mm`` / torchao MoE training)
with one line, before the model is built. Shapes that cannot qualify stay bf16 and are
listed in the report with why.
"""

from __future__ import annotations

import re
from collections import defaultdict
from dataclasses import dataclass, field

import torch
from torch import nn

from megacpp.errors import ConfigError, describe_error
from megacpp.kernels.catalog import device_facts, rejection
from megacpp.kernels.ops.float8_linear.spec import backend_of
from megacpp.kernels.ops.float8_linear.torchao_float8 import (
    ALIGN,
    convert_linears,
    float8_config,
    import_torchao,
    is_float8_linear,
)
from megacpp.kernels.ops.linear_cross_entropy.float8 import float8_head_rejection
from megacpp.kernels.ops.moe_experts.float8 import float8_experts_rejection

OFF = "off"


@dataclass
class Float8Report:
    """What the lane did to one model: the converted layers and the kept ones with why."""

    recipe: str
    converted: list[str] = field(default_factory=list)
    kept: list[tuple[str, str]] = field(default_factory=list)  # (name, reason)
    sliced: list[str] = field(default_factory=list)  # converted, multiplied in row slices
    fsdp_float8_all_gather: bool = False
    experts: list[str] = field(default_factory=list)  # MoE layers whose routed experts run fp8
    head: list[str] = field(default_factory=list)  # the LM head when its GEMMs run fp8

    @property
    def lane(self) -> str:
        """The float8 setting's name (the receipts' ``numerics.float8``)."""
        return lane_name(self.recipe, bool(self.experts), bool(self.head))

    def lines(self) -> list[str]:
        """The log's lines: a summary, then the layer groups (block index as ``*``)."""
        gather = ", FSDP2 all-gathers weights in float8" if self.fsdp_float8_all_gather else ""
        more = "".join([f", routed experts of {len(self.experts)} MoE layers"
                        if self.experts else "", ", the LM head" if self.head else ""])
        summary = (f"float8 ({self.lane}): {len(self.converted)} linear layers converted"
                   f"{more}, {len(self.kept)} kept in bf16{gather}")
        lines = [summary]
        sliced = set(_groups(self.sliced))
        for name, count in _groups(self.converted).items():
            note = (" (row slices: each slice of rows a multiple of 16 in float8, the rest "
                    "bf16)" if name in sliced else "")
            lines.append(f"  float8  {name}{_times(count)}{note}")
        for name, count in _groups([f"{moe}.w_in|out_proj" for moe in self.experts]).items():
            lines.append(f"  float8  {name}{_times(count)}: {EXPERTS_FLOAT8}")
        for name in self.head:
            lines.append(f"  float8  {name}: {HEAD_FLOAT8}")
        for reason, names in _by_reason(self.kept).items():
            for name, count in _groups(names).items():
                lines.append(f"  bf16    {name}{_times(count)}: {reason}")
        return lines

    def to_dict(self) -> dict[str, object]:
        return {"recipe": self.recipe, "lane": self.lane, "converted": len(self.converted),
                "kept": len(self.kept), "fsdp_float8_all_gather": self.fsdp_float8_all_gather,
                "experts": len(self.experts), "head": bool(self.head),
                "converted_groups": _groups(self.converted),
                "kept_groups": {f"{name}: {reason}": count for reason, names in
                                _by_reason(self.kept).items()
                                for name, count in _groups(names).items()}}


EXPERTS_FLOAT8 = ("routed-expert grouped GEMMs (torchao float8 grouped GEMM, row-wise scales, "
                  "expert groups padded to 16 rows)")
HEAD_FLOAT8 = ("the fused linear cross-entropy's three GEMMs (tensor-wise scales; the "
               "cross-entropy in float32)")
HEAD_KEPT = ("the LM head (the fused linear cross-entropy reads its weight; "
             "parallel.float8_head = true runs its GEMMs in float8)")
EXPERTS_MIN_CAPABILITY = (9, 0)  # torch._scaled_grouped_mm's row-wise kernel: sm_90


def lane_name(recipe: str, experts: bool = False, head: bool = False) -> str:
    """The float8 setting as one name: the recipe, ``+experts`` with
    ``parallel.float8_experts``, ``+head`` with ``parallel.float8_head`` (``off``: bf16)."""
    if recipe == OFF:
        return OFF
    return recipe + ("+experts" if experts else "") + ("+head" if head else "")


def parse_lane(name: str) -> tuple[str, bool, bool]:
    """A :func:`lane_name` back into (recipe, experts, head); ConfigError on anything else."""
    recipe, *parts = name.split("+")
    experts, head = "experts" in parts, "head" in parts
    if (recipe not in (OFF, "tensorwise", "rowwise") or lane_name(recipe, experts, head) != name):
        raise ConfigError(f"float8 setting {name!r} not one of off | RECIPE[+experts][+head] "
                          "with RECIPE tensorwise | rowwise (e.g. tensorwise+experts+head)")
    return recipe, experts, head


def require_float8(recipe: str, device: torch.device, *, experts: bool = False,
                   head: bool = False) -> None:
    """Stop (one-line ConfigError) unless ``device`` runs the recipe's float8 GEMMs, as the
    catalog's ``float8_linear`` row of the recipe requires, and with ``experts`` the float8
    grouped GEMM (sm_90, ``torch._scaled_grouped_mm``, torchao's MoE training)."""
    if recipe == OFF:
        if experts or head:
            raise ConfigError("parallel.float8_experts / float8_head need parallel.float8 = "
                              "\"tensorwise\" or \"rowwise\"")
        return
    name = lane_name(recipe, experts, head)
    reason = rejection(backend_of(recipe), device_facts(device), "bfloat16")
    if reason is None and experts:
        reason = experts_rejection(device)
    if reason is not None:
        cap = _min_cap(recipe) if not experts else "9.0"
        raise ConfigError(
            f"parallel.float8 = \"{name}\" cannot run on this device ({_device_name(device)})"
            f": {reason}; FP8 training needs a CUDA GPU of compute capability "
            f"{cap} or newer with torchao installed; set parallel.float8 = "
            "\"off\" to train in bf16")


def experts_rejection(device: torch.device) -> str | None:
    """Why ``device`` (already able to run the float8 linear GEMMs) cannot run the float8
    grouped GEMM of the routed experts, or None."""
    if device.type != "cuda":
        return f"needs device cuda, have {device.type}"
    cap = torch.cuda.get_device_capability(device)
    if cap < EXPERTS_MIN_CAPABILITY:
        return (f"the float8 grouped GEMM needs compute capability 9.0, have "
                f"{cap[0]}.{cap[1]}")
    if not hasattr(torch, "_scaled_grouped_mm"):
        return f"torch {torch.__version__} has no torch._scaled_grouped_mm"
    try:
        import_torchao()
        import torchao.prototype.moe_training  # noqa: F401
    except Exception as exc:  # noqa: BLE001 -- any import failure is the reason given
        return f"torchao's float8 grouped GEMM does not import ({describe_error(exc)})"
    return None


def linear_decisions(model: nn.Module, min_dim: int,
                     fsdp_float8_all_gather: bool = False) -> dict[str, str | None]:
    """Every ``nn.Linear`` of ``model`` by name: None where it converts, else why it stays.

    A layer a mixer multiplies in row slices (``Mixer.row_sliced_linears``) needs only its
    input dim aligned: each slice picks float8 or bf16 by its own row count."""
    direct = _mixer_linears(model, "direct_weight_linears")
    sliced = _mixer_linears(model, "row_sliced_linears")
    head = _head_names(model)
    decisions: dict[str, str | None] = {}
    for name, module in model.named_modules():
        if not isinstance(module, nn.Linear):
            continue
        out_dim, in_dim = module.weight.shape
        if name in head:
            decisions[name] = HEAD_KEPT
        elif name in direct:
            decisions[name] = f"{direct[name]} multiplies its weight itself, not through the layer"
        elif name in sliced and fsdp_float8_all_gather:
            decisions[name] = (f"{sliced[name]} multiplies row slices of it, which a weight "
                               "gathered in float8 does not serve")
        elif name in sliced:
            decisions[name] = (f"in dim {in_dim} not a multiple of {ALIGN}" if in_dim % ALIGN
                               else f"in dim {in_dim} under parallel.float8_min_dim = {min_dim}"
                               if in_dim < min_dim else None)
        elif in_dim % ALIGN or out_dim % ALIGN:
            decisions[name] = (f"in/out dims {in_dim}x{out_dim} not multiples of {ALIGN} "
                               "(the float8 GEMM needs them)")
        elif min(in_dim, out_dim) < min_dim:
            decisions[name] = (f"in/out dims {in_dim}x{out_dim} under parallel.float8_min_dim "
                               f"= {min_dim}")
        else:
            decisions[name] = None
    return decisions


def apply_float8(model: nn.Module, recipe: str, *, min_dim: int,
                 fsdp_float8_all_gather: bool = False, emulate: bool = False,
                 experts: bool = False, head: bool = False) -> Float8Report:
    """Swap the qualifying linear layers of ``model`` for torchao Float8Linear (in place);
    with ``experts`` / ``head`` also switch the qualifying MoE layers' routed experts and
    the LM head to their float8 paths.

    ``fsdp_float8_all_gather``: FSDP2 (applied next) all-gathers their weights in float8
    (tensorwise only). ``emulate``: torchao's emulation (float8 casts and scales, high-precision
    matmuls) -- for tests on devices without FP8 (the expert and head paths have no
    emulation: they need the GPU's float8 GEMMs)."""
    decisions = linear_decisions(model, min_dim, fsdp_float8_all_gather)
    gather = fsdp_float8_all_gather
    config = float8_config(recipe, emulate=emulate, fsdp_float8_all_gather=gather)
    convert_linears(model, config, lambda module, name: decisions.get(name, "?") is None)
    report = Float8Report(recipe, fsdp_float8_all_gather=gather)
    report.head, head_kept = _float8_head(model, head)
    heads = _head_names(model)
    sliced = _mixer_linears(model, "row_sliced_linears")
    for name, module in model.named_modules():
        if name in heads and name in decisions:  # an untied head: the fused CE's weight
            if head_kept is not None:
                report.kept.append((name, head_kept))
        elif name in decisions:
            if is_float8_linear(module):
                report.converted.append(name)
                if name in sliced:
                    report.sliced.append(name)
            else:
                report.kept.append((name, decisions[name] or "not converted by torchao"))
    report.experts, kept_experts = _float8_experts(model, experts)
    report.kept += kept_experts + _lookups(model, head_kept)
    return report


def _mixer_linears(model: nn.Module, member: str) -> dict[str, str]:
    """``{linear name: its mixer's class}`` of what every mixer's ``member()`` names."""
    from megacpp.model.mixer import Mixer

    found: dict[str, str] = {}
    for name, module in model.named_modules():
        if isinstance(module, Mixer):
            for child in getattr(module, member)():
                found[f"{name}.{child}" if name else child] = type(module).__name__
    return found


def _head_names(model: nn.Module) -> set[str]:
    return {name for name, _ in model.named_modules() if name.split(".")[-1] == "lm_head"}


def _float8_experts(model: nn.Module, on: bool) -> tuple[list[str], list[tuple[str, str]]]:
    """(MoE layers switched to the float8 expert path, the kept ones with why); switches
    ``MoE.float8_experts`` of every qualifying layer when ``on``."""
    from megacpp.model.moe import MoE

    converted: list[str] = []
    kept: list[tuple[str, str]] = []
    for name, module in model.named_modules():
        if not isinstance(module, MoE):
            continue
        d_model, expert_ffn = module.w_in.shape[2], module.expert_ffn
        why = (float8_experts_rejection(d_model, expert_ffn) if on else
               "routed-expert grouped GEMMs (the moe_experts kernel has no float8 form; "
               "parallel.float8_experts = true runs them in float8)")
        if why is None:
            module.float8_experts = True
            converted.append(name)
        else:
            kept.append((f"{name}.w_in|out_proj", why if not on else
                         f"routed-expert grouped GEMMs: {why}"))
    return converted, kept


def _float8_head(model: nn.Module, on: bool) -> tuple[list[str], str | None]:
    """(the head's name when switched to the float8 fused cross-entropy, else [], and why it
    stays bf16); sets ``model.float8_head`` when ``on`` and its dims qualify."""
    if not hasattr(model, "float8_head"):
        return [], None
    weight = model._head_weight()
    why = float8_head_rejection(*weight.shape) if on else HEAD_KEPT
    if why is not None:
        return [], why if not on else f"the LM head: {why}"
    model.float8_head = True
    return [_head_label(model)], None


def _head_label(model: nn.Module) -> str:
    return "lm_head (tied: embed.weight)" if getattr(model, "lm_head", True) is None else "lm_head"


def _lookups(model: nn.Module, head_kept: str | None) -> list[tuple[str, str]]:
    """The embeddings (and a head tied to the token embedding), as kept entries."""
    kept = [(name, "an embedding lookup (no GEMM)") for name, module in model.named_modules()
            if isinstance(module, nn.Embedding)]
    if getattr(model, "lm_head", True) is None and head_kept is not None:
        kept.append((_head_label(model), head_kept))
    return kept


def _groups(names: list[str]) -> dict[str, int]:
    """Names with their block / depth indices as ``*``, counted, in first-seen order."""
    counts: dict[str, int] = {}
    for name in names:
        key = re.sub(r"\.\d+(?=\.|$)", ".*", name)
        counts[key] = counts.get(key, 0) + 1
    return counts


def _by_reason(kept: list[tuple[str, str]]) -> dict[str, list[str]]:
    out: dict[str, list[str]] = defaultdict(list)
    for name, reason in kept:
        out[reason].append(name)
    return out


def _times(count: int) -> str:
    return f" x{count}" if count > 1 else ""


def _min_cap(recipe: str) -> str:
    cap = backend_of(recipe).requirements.min_capability or (0, 0)
    return f"{cap[0]}.{cap[1]}"


def _device_name(device: torch.device) -> str:
    if device.type == "cuda" and torch.cuda.is_available():
        major, minor = torch.cuda.get_device_capability(device)
        return f"{torch.cuda.get_device_name(device)}, sm_{major}{minor}"
    return device.type
