"""``megacpp export hf``: a trained run as a directory transformers loads, and back.

:func:`export_run` takes a run directory (its newest complete checkpoint) or one checkpoint
directory and writes the format of :mod:`megacpp.export.hf_format` plus the two modeling
files (``remote/``) and a model card from the run's receipt. A LoRA run is exported merged
(the adapters folded into the weights), or with ``adapter_only`` as the peft adapter alone.

The modeling file imports megacpp and wraps its HybridLM instead of carrying a copy of the
model code: one implementation of every block family, so the export's logits are the trained
model's by construction (a copy would drift); the recipient installs megacpp.

:func:`load_hf_export` reads an export back as (HybridLM, CppTokenizer, ModelConfig).
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

import torch

from megacpp._io import read_toml_bounded
from megacpp.data.tokenizer import CppTokenizer
from megacpp.errors import MegaCppError
from megacpp.export import hf_format
from megacpp.export.card import CardFacts, model_card
from megacpp.model.config import ModelConfig
from megacpp.model.model import HybridLM

REMOTE_FILES = ("configuration_megacpp.py", "modeling_megacpp.py")


@dataclass
class Source:
    """A trained model and what describes it."""

    model: HybridLM  # eval mode; a LoRA run's adapters merged unless asked otherwise
    tokenizer: CppTokenizer
    checkpoint: Path
    run_dir: Path
    trainer_state: dict[str, Any] = field(default_factory=dict)
    seq_len: int | None = None
    data_dir: Path | None = None


def _load_source(path: Path, tokenizer: Path | None = None,
                 merge_adapters: bool = True) -> Source:
    """The model, tokenizer and provenance of a run directory (its newest complete
    checkpoint) or a checkpoint directory. The one place that finds a trained model."""
    from megacpp.data.shards import ShardedDataset
    from megacpp.train.checkpoint import (
        read_checkpoint_tokenizer,
        read_trained_model,
        read_trainer_state,
        resolve_checkpoint,
    )

    checkpoint = resolve_checkpoint(path)  # verifies it, once
    run_dir = checkpoint.parent.parent
    model = read_trained_model(checkpoint, merge_adapters=merge_adapters)
    state = read_trainer_state(checkpoint)
    data_dir, seq_len = None, None
    try:  # provenance for the model card, where the run's dataset is still there
        data_dir = Path(_run_config(run_dir)["data"]["dir"])
        seq_len = ShardedDataset.open(data_dir, verify=False).seq_len
    except (OSError, KeyError, TypeError, MegaCppError):
        data_dir = None
    tok = CppTokenizer.load(tokenizer) if tokenizer else read_checkpoint_tokenizer(checkpoint)
    if tok.vocab_size != model.cfg.vocab_size:
        raise MegaCppError(f"tokenizer has {tok.vocab_size} tokens but the model was trained "
                           f"with {model.cfg.vocab_size}; pass the run's tokenizer")
    return Source(model, tok, checkpoint, run_dir, state, seq_len, data_dir)


# -- writing ----------------------------------------------------------------------------------
def write_model_dir(model: HybridLM, tokenizer: CppTokenizer, out: Path, *, card: str,
                    max_shard_size: int | str = hf_format.DEFAULT_MAX_SHARD_SIZE,
                    seq_len: int | None = None) -> Path:
    """Write ``model`` + ``tokenizer`` as an HF directory at ``out`` (which must not exist or
    be empty): written into a sibling temporary directory, then renamed into place."""
    if tokenizer.vocab_size != model.cfg.vocab_size:
        raise MegaCppError(f"tokenizer has {tokenizer.vocab_size} tokens, the model "
                           f"{model.cfg.vocab_size}")
    if model.cfg.structure.embedding:
        raise MegaCppError("export hf does not support a structure-id embedding "
                           "([structure] embedding = true): transformers' forward and generate() "
                           "pass token ids only, not tree-sitter structure ids; serve the "
                           "checkpoint with megacpp serve instead")
    dtypes = {t.dtype for t in model.state_dict().values() if t.is_floating_point()}
    if dtypes != {torch.float32}:
        raise MegaCppError(f"export writes float32 weights; the model holds {sorted(map(str, dtypes))}")
    with _staging(out) as tmp:
        hf_format.write_weights(model.state_dict(), tmp, max_shard_size)
        hf_format.atomic_write_json(
            tmp / hf_format.CONFIG_FILE, hf_format.config_json(model.cfg, tokenizer,
                                                               seq_len=seq_len))
        hf_format.atomic_write_json(tmp / hf_format.GENERATION_CONFIG,
                                    hf_format.generation_config_json(tokenizer))
        hf_format.write_tokenizer(tokenizer, tmp)
        _copy_remote_files(tmp)
        (tmp / "README.md").write_text(card, encoding="utf-8")
    return out


def _copy_remote_files(out: Path) -> None:
    remote = resources.files("megacpp.export.remote")
    for name in REMOTE_FILES:
        (out / name).write_text(remote.joinpath(name).read_text("utf-8"), encoding="utf-8")


class _staging:
    """``with _staging(out) as tmp``: files go to ``.tmp-<name>`` beside ``out``, renamed to
    ``out`` when the block succeeds, removed when it fails."""

    def __init__(self, out: Path) -> None:
        self.out = Path(out)
        if self.out.exists() and (not self.out.is_dir() or any(self.out.iterdir())):
            raise MegaCppError(f"{self.out} already exists and is not an empty directory; "
                               "choose another --out")
        self.tmp = self.out.with_name(f".tmp-{self.out.name}")

    def __enter__(self) -> Path:
        shutil.rmtree(self.tmp, ignore_errors=True)
        self.tmp.mkdir(parents=True)
        return self.tmp

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:
            shutil.rmtree(self.tmp, ignore_errors=True)
            return
        if self.out.is_dir():
            self.out.rmdir()  # empty (checked above)
        self.tmp.rename(self.out)


def export_run(path: Path, out: Path, *, max_shard_size: int | str = "2GB",
               tokenizer: Path | None = None, eval_dirs: tuple[Path, ...] = (),
               adapter_only: bool = False) -> Path:
    """``megacpp export hf``: write the model of run/checkpoint ``path`` to ``out``."""
    if not Path(path).exists():
        raise MegaCppError(f"checkpoint or run directory not found: {path}")
    if adapter_only:
        return export_adapter(path, out)
    source = _load_source(path, tokenizer)
    facts = CardFacts.collect(source.run_dir, source.checkpoint, source.trainer_state,
                              source.data_dir, eval_dirs)
    card = model_card(source.model.cfg, facts, out.name)
    return write_model_dir(source.model, source.tokenizer, out, card=card,
                           max_shard_size=max_shard_size, seq_len=source.seq_len)


def export_adapter(path: Path, out: Path) -> Path:
    """The LoRA adapter of a LoRA run's checkpoint, in peft's format, at ``out``."""
    from megacpp.train.checkpoint import read_trained_model, read_trainer_state, resolve_checkpoint
    from megacpp.train.finetune import adapter_state, read_lora_state, save_adapter

    checkpoint = resolve_checkpoint(Path(path))  # verifies it, once
    lora = read_lora_state(read_trainer_state(checkpoint))
    if lora is None:
        raise MegaCppError(f"--adapter-only: {checkpoint} is not of a LoRA run ([lora] r = 0)")
    model = read_trained_model(checkpoint, merge_adapters=False)
    base = _init_from(checkpoint.parent.parent)
    with _staging(out) as tmp:
        save_adapter(adapter_state(model), lora, tmp / "adapter", base)
        for file in (tmp / "adapter").iterdir():
            file.rename(tmp / file.name)
        (tmp / "adapter").rmdir()
    return out


def _init_from(run_dir: Path) -> str:
    """The run's ``[train] init_from`` (the adapter's base model), or ""."""
    try:
        return str(_run_config(run_dir)["train"].get("init_from", ""))
    except (KeyError, AttributeError, MegaCppError):
        return ""


def _run_config(run_dir: Path) -> dict[str, Any]:
    """The run's config.toml, read through the bounded reader (its provenance for the card and
    the adapter; an export needs only the checkpoint, so callers treat an error as absent)."""
    from megacpp.train.checkpoint import RUN_CONFIG_FILE

    return read_toml_bounded(run_dir / RUN_CONFIG_FILE, what="run config")


# -- reading ----------------------------------------------------------------------------------
def load_hf_export(path: Path, device: str | torch.device = "cpu"
                   ) -> tuple[HybridLM, CppTokenizer, ModelConfig]:
    """(HybridLM in eval mode, tokenizer, model config) of a ``megacpp export hf`` directory."""
    from megacpp.train.finetune import first_mismatch

    path = Path(path)
    if not hf_format.is_hf_export(path):
        raise MegaCppError(f"{path} is not a megacpp Hugging Face export (no config.json with "
                           f"model_type {hf_format.MODEL_TYPE!r})")
    cfg = hf_format.read_model_config(path)
    model = HybridLM(cfg)
    weights = hf_format.read_weights(path)
    mismatch = first_mismatch(weights, model.state_dict())
    if mismatch is not None:
        raise MegaCppError(f"{path}: the weights do not fit its config.json: {mismatch}")
    model.load_state_dict(weights)
    tokenizer = hf_format.read_tokenizer(path)
    return model.to(device).eval(), tokenizer, cfg
