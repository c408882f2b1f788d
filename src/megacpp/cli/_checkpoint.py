"""Load a trained model and its tokenizer for inference (shared by generate, eval, serve).

``path`` is a run directory (its newest complete checkpoint), a checkpoint directory, or a
Hugging Face export directory: :func:`megacpp.pretrained.load_pretrained`. The tokenizer is
the one stored with the model unless one is given.
"""

from __future__ import annotations

from pathlib import Path

import torch

from megacpp.data.tokenizer import CppTokenizer
from megacpp.errors import MegaCppError
from megacpp.model.model import HybridLM


def load_for_inference(
    path: Path, tokenizer: Path | None = None, device: str = "cpu"
) -> tuple[HybridLM, CppTokenizer, Path]:
    """(model in eval mode on ``device``, tokenizer, checkpoint dir)."""
    from megacpp.pretrained import load_pretrained

    if device == "cuda" and not torch.cuda.is_available():
        raise MegaCppError("--device cuda: no CUDA device here")
    loaded = load_pretrained(path, device, tokenizer=tokenizer)
    return loaded.model, loaded.tokenizer, loaded.source
