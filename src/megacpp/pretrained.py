"""Load a trained model with its tokenizer, from wherever it was put.

:func:`load_pretrained` takes

* a run directory (``runs/tiny-cpu``: its newest complete checkpoint),
* a checkpoint directory (``runs/tiny-cpu/checkpoints/step_000300``, or a copy of one made
  anywhere: a checkpoint holds its model config and tokenizer), or
* a Hugging Face export directory (``megacpp export hf``: ``config.json`` with
  ``"model_type": "megacpp"``), read by :func:`megacpp.export.hf.load_hf_export`.

The CLI's ``generate``, ``serve`` and ``eval`` load through it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from megacpp.data.tokenizer import CppTokenizer
from megacpp.errors import MegaCppError
from megacpp.export.hf_format import is_hf_export
from megacpp.infer.generate import generate
from megacpp.model.model import HybridLM
from megacpp.train.checkpoint import (
    read_checkpoint_tokenizer,
    read_trained_model,
    resolve_checkpoint,
)


@dataclass
class Pretrained:
    """A trained model in eval mode, its tokenizer, and the directory they were read from."""

    model: HybridLM
    tokenizer: CppTokenizer
    source: Path  # the checkpoint directory (or the export directory) that was read

    def generate(self, prompt: str, max_new_tokens: int = 128, temperature: float = 0.8,
                 top_p: float = 0.95, top_k: int = 0, seed: int | None = None,
                 stop: tuple[str, ...] = ()) -> str:
        """One sampled completion of ``prompt``: :func:`megacpp.infer.generate.generate`."""
        return generate(self.model, self.tokenizer, prompt, max_new_tokens=max_new_tokens,
                        temperature=temperature, top_p=top_p, top_k=top_k, seed=seed, stop=stop)


def load_pretrained(path: str | Path, device: str | torch.device = "cpu",
                    tokenizer: str | Path | None = None,
                    fallback_to_previous: bool = False) -> Pretrained:
    """The model and tokenizer at ``path`` (a run, checkpoint or Hugging Face export
    directory) on ``device`` (``"auto"``: CUDA when there is one). ``tokenizer`` (a
    tokenizer.json) replaces the one stored with the model. A run whose newest checkpoint is
    corrupt is refused unless ``fallback_to_previous`` (then the newest intact one is read and
    the skipped ones are named on stderr)."""
    path = Path(path)
    device = resolve_device(device)
    if is_hf_export(path):
        from megacpp.export.hf import load_hf_export

        model, tok, _ = load_hf_export(path, device=device)
        source = path
    else:
        source = resolve_checkpoint(path, fallback_to_previous)  # verifies it, once
        model = read_trained_model(source, device)
        tok = None if tokenizer is not None else read_checkpoint_tokenizer(source)
    if tokenizer is not None:
        tok = CppTokenizer.load(tokenizer)
    if tok.vocab_size != model.cfg.vocab_size:
        raise MegaCppError(
            f"the tokenizer has {tok.vocab_size} tokens but the model at {source} was trained "
            f"with {model.cfg.vocab_size}; use the model's own tokenizer")
    return Pretrained(model, tok, source)


def resolve_device(device: str | torch.device) -> torch.device:
    """``"auto"`` -> CUDA when available, else CPU; ``"cuda"`` without a GPU is an error."""
    if str(device) == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        resolved = torch.device(device)
    except (RuntimeError, TypeError):
        raise MegaCppError(f"unknown device {device!r}; use auto, cpu or cuda") from None
    if resolved.type == "cuda" and not torch.cuda.is_available():
        raise MegaCppError(f"device {device!r}: no CUDA device here")
    return resolved
