"""Fine-tuning: start from another model's weights, freeze named parts, train LoRA adapters.

Run config keys (``megacpp.train.config``)::

    [train] init_from = "RUN_DIR" | "RUN_DIR/checkpoints/step_N" | "HF_EXPORT_DIR"
    [train] freeze    = ["embed", "blocks.0", "blocks.*.norm"]
    [lora]  r = 8, alpha = 16, dropout = 0.0, targets = ["q_proj", "out_proj"]

* ``init_from`` loads the weights (and the MoE routing biases) of a run's newest complete
  checkpoint, one checkpoint, or a ``megacpp export hf`` directory; the optimizer state and
  the data position start fresh. The run's model config must build the same tensors: the
  first tensor that differs stops the run, named.
* ``freeze`` patterns name parameters, ``[lora] targets`` linear layers (a prefix such as
  ``blocks.0``, a suffix such as ``mixer.q_proj``, one component such as ``norm``, globs
  allowed: :func:`name_matches`); each pattern must match something.
* LoRA goes through ``peft`` (``inject_adapter_in_model``: the HybridLM keeps its class and
  names, each targeted ``nn.Linear`` becomes a ``lora.Linear`` around it). Only the adapters
  train. peft's LoRA adapts ``nn.Linear`` modules called as modules; the MoE's 3-D expert
  weights are plain parameters, and a few linears are applied through their weight directly
  (:func:`direct_weight_linears`), so those are not LoRA targets. The adapters train with
  AdamW (their modules are marked ``_no_muon``).
* A MoE layer's routing bias is a buffer nudged after each step; it stays fixed where the
  layer's router is frozen (a LoRA run: the base model, adapters apart, stays as loaded, so a
  merged export equals base + adapter).

A LoRA run's checkpoints hold the adapters inside the model state (``...base_layer.weight``,
``...lora_A.default.weight``); :func:`lora_state` goes into ``trainer_state.json`` so
:func:`megacpp.train.checkpoint.load_trained_model` can rebuild and merge them. Each
checkpoint's adapter is also written in peft's format to ``RUN_DIR/adapters/step_N/``
(``adapter_config.json`` + ``adapter_model.safetensors``: ``PeftModel.from_pretrained`` on
the base HybridLM loads it).
"""

from __future__ import annotations

import fnmatch
import json
import shutil
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from megacpp.errors import ConfigError, MegaCppError
from megacpp.model.mamba3 import Mamba3Mixer
from megacpp.model.mla import MultiHeadLatentAttention
from megacpp.model.model import HybridLM
from megacpp.model.moe import MoE
from megacpp.train.config import RunConfig

ADAPTERS_DIR = "adapters"
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."  # peft's key prefix in adapter files (PeftModel's names)
LORA_NAME_PARTS = ("base_layer", "default")  # peft's parts in parameter names


# -- names ------------------------------------------------------------------------------------
def name_matches(name: str, pattern: str) -> bool:
    """Whether dotted ``name`` is named by ``pattern`` (globs allowed): the pattern matches
    the name, a dotted prefix of it (``blocks.0``: everything in block 0), a dotted suffix
    (``mixer.q_proj``, ``norm.weight``) or -- a pattern without a dot -- any one component
    (``q_proj``, ``norm``)."""
    parts = name.split(".")
    spans = [".".join(parts[:i]) for i in range(1, len(parts) + 1)]
    spans += [".".join(parts[i:]) for i in range(1, len(parts))]
    if "." not in pattern:
        spans += parts
    return any(fnmatch.fnmatchcase(span, pattern) for span in spans)


def _examples(names: Iterable[str], n: int = 4) -> str:
    names = list(names)
    return ", ".join(names[:n]) + (", ..." if len(names) > n else "")


# -- init_from --------------------------------------------------------------------------------
def source_state_dict(source: str | Path) -> dict[str, torch.Tensor]:
    """The weights (and persistent buffers) of a run dir, checkpoint dir or HF export dir,
    by HybridLM names; a LoRA run's adapters come merged."""
    from megacpp.export.hf_format import is_hf_export, read_weights
    from megacpp.train.checkpoint import load_trained_model

    path = Path(source)
    if not path.exists():
        raise MegaCppError(f"not found: {path}")
    if is_hf_export(path):
        return read_weights(path)
    return load_trained_model(path).state_dict()


def first_mismatch(loaded: dict[str, torch.Tensor], wanted: dict[str, torch.Tensor]
                   ) -> str | None:
    """The first tensor (in the model's order) that is missing, extra or of another shape."""
    for name, tensor in wanted.items():
        if name not in loaded:
            return f"tensor {name} {list(tensor.shape)} is missing from it"
        if loaded[name].shape != tensor.shape:
            return (f"tensor {name} has shape {list(loaded[name].shape)} there and "
                    f"{list(tensor.shape)} in this run's model")
    extra = [name for name in loaded if name not in wanted]
    return f"it has tensor {extra[0]}, which this run's model lacks" if extra else None


def load_init_weights(model: HybridLM, source: str) -> str:
    """Copy ``source``'s weights into ``model`` (fail closed on any mismatch); a log line."""
    try:
        loaded = source_state_dict(source)
    except MegaCppError as exc:
        raise ConfigError(f"train.init_from = {source!r}: {exc}") from None
    mismatch = first_mismatch(loaded, model.state_dict())
    if mismatch is not None:
        raise ConfigError(f"train.init_from = {source!r} does not fit this run's model: "
                          f"{mismatch} (give [model] the source's config)")
    model.load_state_dict(loaded)
    return f"init_from {source}: loaded {len(loaded)} tensors"


# -- LoRA -------------------------------------------------------------------------------------
def direct_weight_linears(model: nn.Module) -> dict[str, str]:
    """Linear layers some forward path applies through their ``.weight`` rather than by
    calling the module (so a LoRA wrapper would be bypassed), with the reason."""
    out: dict[str, str] = {}
    for name, module in model.named_modules():
        prefix = f"{name}." if name else ""
        if isinstance(module, MoE):
            why = "the MoE applies its router and shared experts' in_proj as one stacked GEMM"
            out[f"{prefix}router"] = why
            if module.shared is not None:
                out[f"{prefix}shared.in_proj"] = why
        elif isinstance(module, Mamba3Mixer):
            out[f"{prefix}in_proj"] = "Mamba-3 applies in_proj as three GEMMs over weight slices"
        elif isinstance(module, MultiHeadLatentAttention):
            out[f"{prefix}kv_up"] = "MLA's absorbed decoding folds kv_up's weight into the query"
    if isinstance(model, HybridLM) and model.lm_head is not None:
        out["lm_head"] = "the LM head is applied through its weight"
    return out


def lora_targets(model: HybridLM, patterns: tuple[str, ...]) -> list[str]:
    """The full names of the linear layers ``[lora] targets`` names (all supported linears
    when empty); unsupported or unmatched patterns are config errors."""
    linears = [name for name, m in model.named_modules() if isinstance(m, nn.Linear)]
    unsupported = direct_weight_linears(model)
    if not patterns:
        return [name for name in linears if name not in unsupported]
    chosen = []
    for pattern in patterns:
        hits = [name for name in linears if name_matches(name, pattern)]
        if not hits:
            raise ConfigError(f"lora.targets: {pattern!r} names no linear layer; linear layers: "
                              f"{_examples(n for n in linears if n not in unsupported)}")
        bad = [name for name in hits if name in unsupported]
        if bad:
            raise ConfigError(f"lora.targets: {pattern!r} names {bad[0]}, which LoRA cannot "
                              f"adapt ({unsupported[bad[0]]}); name other layers")
        chosen += [name for name in hits if name not in chosen]
    return [name for name in linears if name in chosen]


@dataclass(frozen=True)
class LoraState:
    """What rebuilds a run's adapters: the [lora] values and the resolved target modules."""

    r: int
    alpha: float
    dropout: float
    targets: tuple[str, ...]

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> LoraState:
        return cls(int(data["r"]), float(data["alpha"]), float(data["dropout"]),
                   tuple(data["targets"]))

    def peft_config(self, base: str = "") -> Any:
        try:
            from peft import LoraConfig
        except ImportError:
            raise ConfigError("LoRA ([lora] r > 0) needs peft: pip install 'megacpp[lora]'") \
                from None
        return LoraConfig(r=self.r, lora_alpha=self.alpha, lora_dropout=self.dropout,
                          target_modules=list(self.targets), bias="none",
                          base_model_name_or_path=base or None)


def add_lora(model: HybridLM, lora: LoraState) -> None:
    """Wrap ``lora.targets`` in peft LoRA layers, in place; only the adapters train."""
    config = lora.peft_config()  # first: a clear error when peft is missing
    from peft import inject_adapter_in_model
    from peft.tuners.lora import LoraLayer

    inject_adapter_in_model(config, model)
    for module in model.modules():
        if isinstance(module, LoraLayer):
            for adapter in (*module.lora_A.values(), *module.lora_B.values()):
                # adapters train with AdamW (megacpp.train.optim); marked on the module, which
                # FSDP2 keeps (it replaces the parameters)
                adapter._no_muon = True
    for name, p in model.named_parameters():
        p.requires_grad_(".lora_A." in name or ".lora_B." in name)


def merge_lora(model: nn.Module) -> nn.Module:
    """Fold every LoRA adapter into its base layer and put the plain layer back, in place."""
    from peft.tuners.lora import LoraLayer

    wrapped = [(name, m) for name, m in model.named_modules() if isinstance(m, LoraLayer)]
    for name, module in wrapped:
        module.merge(safe_merge=True)
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent), child, module.get_base_layer())
    return model


def adapter_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The adapters' weights by peft's file names (collective under FSDP: every rank calls)."""
    from peft import get_peft_model_state_dict
    from torch.distributed.tensor import DTensor

    state = get_peft_model_state_dict(model)
    return {PEFT_PREFIX + name: (t.full_tensor() if isinstance(t, DTensor) else t)
            .detach().cpu().contiguous() for name, t in state.items()}


def save_adapter(state: dict[str, torch.Tensor], lora: LoraState, out: Path,
                 base: str = "") -> Path:
    """Write ``adapter_config.json`` + ``adapter_model.safetensors`` (peft's format) into
    ``out``, atomically (a sibling temporary directory, then a rename)."""
    from safetensors.torch import save_file

    out = Path(out)
    tmp = out.with_name(f".tmp-{out.name}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    lora.peft_config(base).save_pretrained(str(tmp))
    save_file(state, str(tmp / ADAPTER_WEIGHTS), metadata={"format": "pt"})
    if out.exists():
        shutil.rmtree(out)
    tmp.rename(out)
    return out


# -- freezing ---------------------------------------------------------------------------------
def freeze(model: nn.Module, patterns: tuple[str, ...]) -> int:
    """Stop the gradients of every parameter a pattern names; returns how many were frozen."""
    params = dict(model.named_parameters())
    frozen = set()
    for pattern in patterns:
        hits = [name for name in params if name_matches(_plain_name(name), pattern)
                or name_matches(name, pattern)]
        if not hits:
            raise ConfigError(f"train.freeze: {pattern!r} names no parameter; parameters: "
                              f"{_examples(_plain_name(n) for n in params)}")
        frozen.update(hits)
    for name in frozen:
        params[name].requires_grad_(False)
    return sum(params[name].numel() for name in frozen)


def _plain_name(name: str) -> str:
    """A parameter name without peft's wrapper parts (``q_proj.base_layer.weight`` ->
    ``q_proj.weight``)."""
    return ".".join(part for part in name.split(".") if part not in LORA_NAME_PARTS)


def hold_frozen_routing(model: HybridLM) -> int:
    """Fix the routing bias of every MoE layer whose router is frozen; how many."""
    held = 0
    for block in model.moe_blocks():
        moe = block.mixer
        if not any(p.requires_grad for p in moe.router.parameters()):
            moe.bias_update_rate = 0.0
            held += 1
    return held


# -- the trainer's entry point ----------------------------------------------------------------
class FineTuning:
    """The fine-tuning side of one training run (no-ops for a plain run)."""

    def __init__(self, cfg: RunConfig) -> None:
        self.cfg = cfg
        self.lora: LoraState | None = None

    @property
    def active(self) -> bool:
        return bool(self.cfg.train.init_from or self.cfg.train.freeze or self.cfg.lora.r)

    def prepare(self, model: HybridLM, restoring: bool, log: Callable[[str], None]) -> None:
        """Before parallelization: load ``init_from`` (unless a checkpoint of this run will be
        restored over it), add the LoRA adapters, freeze; log what is trainable."""
        if not self.active:
            return
        train_cfg, lora_cfg = self.cfg.train, self.cfg.lora
        if train_cfg.init_from and not restoring:
            log(load_init_weights(model, train_cfg.init_from))
        if lora_cfg.r:
            targets = lora_targets(model, lora_cfg.targets)
            self.lora = LoraState(lora_cfg.r, lora_cfg.alpha, lora_cfg.dropout, tuple(targets))
            add_lora(model, self.lora)
            log(f"LoRA r={lora_cfg.r} alpha={lora_cfg.alpha:g} on {len(targets)} linear "
                f"layers ({_examples(targets, 3)})")
        if train_cfg.freeze:
            freeze(model, train_cfg.freeze)
        held = hold_frozen_routing(model)
        total = sum(p.numel() for p in model.parameters())
        trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
        if not trainable:
            raise ConfigError("train.freeze / [lora] leave no trainable parameter")
        log(f"trainable parameters: {trainable:,} of {total:,} ({100 * trainable / total:.2f}%)"
            + (f"; routing biases of {held} MoE layer(s) with frozen routers held" if held
               else ""))

    def checkpoint_state(self) -> dict[str, Any]:
        """Entries for ``trainer_state.json``."""
        return {"lora": asdict(self.lora)} if self.lora is not None else {}

    def after_checkpoint(self, model: nn.Module, run_dir: Path, checkpoint: Path,
                         is_main: bool) -> None:
        """Write the checkpoint's adapter in peft's format next to it (``RUN_DIR/adapters/
        step_N``), and drop adapters whose checkpoint was pruned. Every rank calls."""
        if self.lora is None:
            return
        state = adapter_state(model)
        if not is_main:
            return
        root = Path(run_dir) / ADAPTERS_DIR
        save_adapter(state, self.lora, root / checkpoint.name, self.cfg.train.init_from)
        for old in root.iterdir():
            if old.name.startswith("step_") and not (checkpoint.parent / old.name).is_dir():
                shutil.rmtree(old)


def read_lora_state(trainer_state: dict[str, Any]) -> LoraState | None:
    """The LoRA state a checkpoint's ``trainer_state.json`` records, or None."""
    data = trainer_state.get("lora")
    return LoraState.from_dict(data) if data else None


def adapter_config(path: Path) -> dict[str, Any]:
    """A peft ``adapter_config.json`` as data."""
    return json.loads((Path(path) / ADAPTER_CONFIG).read_text("utf-8"))
