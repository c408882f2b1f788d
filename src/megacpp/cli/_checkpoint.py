"""Load a trained model and its tokenizer for inference (shared by generate, eval, serve).

``path`` is a run directory (its newest checkpoint), a checkpoint directory, or a Hugging
Face export directory: :func:`megacpp.pretrained.load_pretrained`. A newest checkpoint that is
incomplete or corrupt is an error, as it is for ``megacpp train --resume``; with
``fallback_to_previous`` the newest intact one before it is used instead, and the skipped ones
are named on stderr. The tokenizer is the one stored with the model unless one is given.
"""

from __future__ import annotations

from pathlib import Path

from megacpp.data.tokenizer import CppTokenizer
from megacpp.model.model import HybridLM


def load_for_inference(
    path: Path, tokenizer: Path | None = None, device: str = "cpu",
    fallback_to_previous: bool = False,
) -> tuple[HybridLM, CppTokenizer, Path]:
    """(model in eval mode on ``device``, tokenizer, the directory it was read from)."""
    from megacpp.pretrained import load_pretrained

    loaded = load_pretrained(path, device, tokenizer=tokenizer,
                             fallback_to_previous=fallback_to_previous)
    return loaded.model, loaded.tokenizer, loaded.source
