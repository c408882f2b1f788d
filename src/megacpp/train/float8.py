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
* the MoE's routed-expert GEMMs: they run inside the ``moe_experts`` kernel (a fused autograd
  function over Triton / ``torch._grouped_mm`` grouped GEMMs, the SwiGLU in the gate|up
  GEMM's epilogue, float32 weight gradients written straight from the accumulators), which
  has no float8 form; torchao's float8 grouped GEMM (``torchao.prototype.moe_training``)
  is its own autograd op over 16-row-aligned groups, a second expert path not written here.

The norms, scans, attention and the cross-entropy keep their own kernels.

Order (torchao's float8 docs, torchtitan): the swap comes first, before activation
checkpointing, ``torch.compile`` and ``fully_shard``; compile fuses the amax / scale / cast
work around each GEMM (torchao's float8 training relies on it for its speed). Under FSDP2
with the tensorwise recipe, ``parallel.float8_fsdp_all_gather = true`` all-gathers the
weights in float8 (torchao's ``enable_fsdp_float8_all_gather``): a quarter of the bytes of
the fp32 masters' gather; each weight's scale comes from an all-reduced amax of its shards
(torchao's ``precompute_float8_dynamic_scale_for_fsdp``, one all-reduce for all weights, is
not used).

The lane fails closed: :func:`require_float8` stops a run whose device cannot run
the recipe's GEMMs (CPU, CUDA before sm_89, rowwise before sm_90, no torchao) with one line,
before the model is built.
"""

from __future__ import annotations

import re
from collections import defaultdict
from dataclasses import dataclass, field

import torch
from torch import nn

from megacpp.errors import ConfigError
from megacpp.kernels.catalog import device_facts, rejection
from megacpp.kernels.ops.float8_linear.spec import backend_of
from megacpp.kernels.ops.float8_linear.torchao_float8 import (
    ALIGN,
    convert_linears,
    float8_config,
    is_float8_linear,
)

OFF = "off"


@dataclass
class Float8Report:
    """What the lane did to one model: the converted layers and the kept ones with why."""

    recipe: str
    converted: list[str] = field(default_factory=list)
    kept: list[tuple[str, str]] = field(default_factory=list)  # (name, reason)
    sliced: list[str] = field(default_factory=list)  # converted, multiplied in row slices
    fsdp_float8_all_gather: bool = False

    def lines(self) -> list[str]:
        """The log's lines: a summary, then the layer groups (block index as ``*``)."""
        gather = ", FSDP2 all-gathers weights in float8" if self.fsdp_float8_all_gather else ""
        summary = (f"float8 ({self.recipe}): {len(self.converted)} linear layers converted, "
                   f"{len(self.kept)} kept in bf16{gather}")
        lines = [summary]
        sliced = set(_groups(self.sliced))
        for name, count in _groups(self.converted).items():
            note = (" (row slices: each slice of rows a multiple of 16 in float8, the rest "
                    "bf16)" if name in sliced else "")
            lines.append(f"  float8  {name}{_times(count)}{note}")
        for reason, names in _by_reason(self.kept).items():
            for name, count in _groups(names).items():
                lines.append(f"  bf16    {name}{_times(count)}: {reason}")
        return lines

    def to_dict(self) -> dict[str, object]:
        return {"recipe": self.recipe, "converted": len(self.converted),
                "kept": len(self.kept), "fsdp_float8_all_gather": self.fsdp_float8_all_gather,
                "converted_groups": _groups(self.converted),
                "kept_groups": {f"{name}: {reason}": count for reason, names in
                                _by_reason(self.kept).items()
                                for name, count in _groups(names).items()}}


def require_float8(recipe: str, device: torch.device) -> None:
    """Stop (one-line ConfigError) unless ``device`` runs the recipe's float8 GEMMs, as the
    catalog's ``float8_linear`` row of the recipe requires."""
    if recipe == OFF:
        return
    reason = rejection(backend_of(recipe), device_facts(device), "bfloat16")
    if reason is not None:
        raise ConfigError(
            f"parallel.float8 = \"{recipe}\" cannot run on this device ({_device_name(device)})"
            f": {reason}; FP8 training needs a CUDA GPU of compute capability "
            f"{_min_cap(recipe)} or newer with torchao installed; set parallel.float8 = "
            "\"off\" to train in bf16")


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
            decisions[name] = "the LM head (the fused linear cross-entropy reads its weight)"
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
                 fsdp_float8_all_gather: bool = False, emulate: bool = False) -> Float8Report:
    """Swap the qualifying linear layers of ``model`` for torchao Float8Linear (in place).

    ``fsdp_float8_all_gather``: FSDP2 (applied next) all-gathers their weights in float8
    (tensorwise only). ``emulate``: torchao's emulation (float8 casts and scales, high-precision
    matmuls) -- for tests on devices without FP8."""
    decisions = linear_decisions(model, min_dim, fsdp_float8_all_gather)
    gather = fsdp_float8_all_gather
    config = float8_config(recipe, emulate=emulate, fsdp_float8_all_gather=gather)
    convert_linears(model, config, lambda module, name: decisions.get(name, "?") is None)
    report = Float8Report(recipe, fsdp_float8_all_gather=gather)
    sliced = _mixer_linears(model, "row_sliced_linears")
    for name, module in model.named_modules():
        if name in decisions:
            if is_float8_linear(module):
                report.converted.append(name)
                if name in sliced:
                    report.sliced.append(name)
            else:
                report.kept.append((name, decisions[name] or "not converted by torchao"))
    report.kept += _expert_gemms(model) + _lookups(model)
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


def _expert_gemms(model: nn.Module) -> list[tuple[str, str]]:
    """The MoE layers' routed-expert weights (bf16 grouped GEMMs), as kept entries."""
    from megacpp.model.moe import MoE

    return [(f"{name}.w_in|out_proj",
             "routed-expert grouped GEMMs (the moe_experts kernel has no float8 form)")
            for name, module in model.named_modules() if isinstance(module, MoE)]


def _lookups(model: nn.Module) -> list[tuple[str, str]]:
    """The embeddings (and a head tied to the token embedding), as kept entries."""
    kept = [(name, "an embedding lookup (no GEMM)") for name, module in model.named_modules()
            if isinstance(module, nn.Embedding)]
    if getattr(model, "lm_head", True) is None:
        kept.append(("lm_head (tied: embed.weight)",
                     "the LM head (the fused linear cross-entropy reads its weight)"))
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
