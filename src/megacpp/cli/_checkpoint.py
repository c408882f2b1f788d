"""Load a trained model and its tokenizer for inference (shared by generate, eval, serve).

``path`` is a run directory (the newest complete checkpoint is used) or one checkpoint
directory ``RUN_DIR/checkpoints/step_NNNNNN``. The tokenizer is the one of the dataset the
run trained on (``[data] dir`` in ``RUN_DIR/config.toml``) unless one is given.
"""

from __future__ import annotations

import tomllib
from pathlib import Path

import torch

from megacpp.data.tokenizer import CppTokenizer
from megacpp.errors import MegaCppError
from megacpp.model.model import HybridLM


def resolve_checkpoint(path: Path) -> tuple[Path, Path]:
    """(checkpoint dir, run dir) for a run dir or a checkpoint dir; newest complete first."""
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
            return candidate, run_dir
        except CheckpointError as exc:
            problems.append(str(exc))
    raise MegaCppError("no complete checkpoint: " + ("; ".join(problems) or f"none in {path}"))


def run_tokenizer(run_dir: Path) -> CppTokenizer:
    """The tokenizer of the dataset named in ``RUN_DIR/config.toml``."""
    from megacpp.data.shards import ShardedDataset

    config = run_dir / "config.toml"
    try:
        data_dir = tomllib.loads(config.read_text(encoding="utf-8"))["data"]["dir"]
    except (OSError, KeyError, tomllib.TOMLDecodeError) as exc:
        raise MegaCppError(f"cannot find the run's dataset in {config} ({exc}); pass --tokenizer") from None
    return ShardedDataset.open(data_dir, verify=False).tokenizer()


def load_for_inference(
    path: Path, tokenizer: Path | None = None, device: str = "cpu"
) -> tuple[HybridLM, CppTokenizer, Path]:
    """(model in eval mode on ``device``, tokenizer, checkpoint dir)."""
    from megacpp.train.checkpoint import load_trained_model

    if device == "cuda" and not torch.cuda.is_available():
        raise MegaCppError("--device cuda: no CUDA device here")
    checkpoint, run_dir = resolve_checkpoint(path)
    tok = CppTokenizer.load(tokenizer) if tokenizer else run_tokenizer(run_dir)
    model = load_trained_model(checkpoint, device)
    if tok.vocab_size != model.cfg.vocab_size:
        raise MegaCppError(
            f"tokenizer has {tok.vocab_size} tokens but the model was trained with "
            f"{model.cfg.vocab_size}; pass the run's tokenizer"
        )
    return model, tok, checkpoint
