"""Load a trained model and its tokenizer for inference (shared by generate, eval, serve).

``path`` is a run directory (its newest checkpoint is used) or one checkpoint directory
``RUN_DIR/checkpoints/step_NNNNNN``. A newest checkpoint that is incomplete or corrupt is an
error, as it is for ``megacpp train --resume``; with ``fallback_to_previous`` the newest intact
one before it is used instead, and the skipped ones are named on stderr. The tokenizer is the
one of the dataset the run trained on (``[data] dir`` in ``RUN_DIR/config.toml``) unless one is
given.
"""

from __future__ import annotations

from pathlib import Path

import torch
from rich.console import Console

from megacpp._io import CONFIG_LIMIT, read_toml_bounded
from megacpp.data.tokenizer import CppTokenizer
from megacpp.errors import MegaCppError
from megacpp.model.model import HybridLM


def resolve_checkpoint(path: Path, fallback_to_previous: bool = False) -> tuple[Path, Path]:
    """(checkpoint dir, run dir) for a run dir (its newest checkpoint) or a checkpoint dir."""
    from megacpp.train.checkpoint import CheckpointError, verify_checkpoint

    path = Path(path)
    if not path.exists():
        raise MegaCppError(f"checkpoint or run directory not found: {path}")
    if (path / "checkpoints").is_dir():
        run_dir = path
        candidates = sorted((path / "checkpoints").glob("step_*"), reverse=True)
    elif path.parent.name == "checkpoints":
        run_dir, candidates = path.parent.parent, [path]
    else:
        raise MegaCppError(
            f"{path} is neither a run directory (with checkpoints/) nor a checkpoint "
            "(RUN_DIR/checkpoints/step_NNNNNN)"
        )
    problems = []
    for candidate in candidates:
        try:
            verify_checkpoint(candidate)
        except CheckpointError as exc:
            if not fallback_to_previous:
                hint = ("; pass --fallback-to-previous to use the newest intact one before it"
                        if len(candidates) > 1 else "")
                raise CheckpointError(f"{exc}{hint}") from None
            problems.append(str(exc))
            continue
        for problem in problems:
            console = Console(stderr=True, highlight=False, soft_wrap=True)
            console.print(f"skipped: {problem}", markup=False)
        return candidate, run_dir
    raise MegaCppError("no complete checkpoint: " + ("; ".join(problems) or f"none in {path}"))


def run_tokenizer(run_dir: Path) -> CppTokenizer:
    """The tokenizer of the dataset named in ``RUN_DIR/config.toml``."""
    from megacpp.data.shards import ShardedDataset

    config = run_dir / "config.toml"
    data = read_toml_bounded(config, CONFIG_LIMIT, what="run config")
    table = data.get("data")
    data_dir = table.get("dir") if isinstance(table, dict) else None
    if not isinstance(data_dir, str) or not data_dir:
        raise MegaCppError(f"cannot find the run's dataset in {config} (no [data] dir); "
                           "pass --tokenizer")
    return ShardedDataset.open(data_dir, verify=False).tokenizer()


def load_for_inference(
    path: Path, tokenizer: Path | None = None, device: str = "cpu",
    fallback_to_previous: bool = False,
) -> tuple[HybridLM, CppTokenizer, Path]:
    """(model in eval mode on ``device``, tokenizer, checkpoint dir)."""
    from megacpp.train.checkpoint import load_trained_model

    if device == "cuda" and not torch.cuda.is_available():
        raise MegaCppError("--device cuda: no CUDA device here")
    checkpoint, run_dir = resolve_checkpoint(path, fallback_to_previous)
    tok = CppTokenizer.load(tokenizer) if tokenizer else run_tokenizer(run_dir)
    model = load_trained_model(checkpoint, device)
    if tok.vocab_size != model.cfg.vocab_size:
        raise MegaCppError(
            f"tokenizer has {tok.vocab_size} tokens but the model was trained with "
            f"{model.cfg.vocab_size}; pass the run's tokenizer"
        )
    return model, tok, checkpoint
