"""What SFT and GRPO share: the training data guard, the policy (LoRA or full), checkpoints,
per-step metrics and the receipt.

Output layout of a post-training run directory ``OUT``::

    OUT/metrics.jsonl               one JSON line per step (and per held-out evaluation)
    OUT/checkpoints/step_NNNNNN/    the merged model as a Hugging Face export (``megacpp
                                    eval/generate/serve --checkpoint`` and ``--base`` read it)
    OUT/adapters/step_NNNNNN/       a LoRA run's adapter in peft's format
    OUT/model -> newest checkpoint  (the final one; a copy, not a link)
    OUT/receipt.json                kind ``train``, config.posttrain = "sft" | "grpo"
"""

from __future__ import annotations

import contextlib
import math
import os
import random
import shutil
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from megacpp._io import LOG_LIMIT, parse_json, read_text_bounded
from megacpp.data.tokenizer import CppTokenizer
from megacpp.errors import MegaCppError
from megacpp.model.model import HybridLM
from megacpp.posttrain.tasks import prompt_digest
from megacpp.receipts import write_receipt
from megacpp.train.metrics import METRICS_FILE, MetricsLog

RECEIPT_FILE = "receipt.json"
CHECKPOINTS_DIR = "checkpoints"
ADAPTERS_DIR = "adapters"
MODEL_DIR = "model"


class PosttrainError(MegaCppError):
    """Bad post-training input: data, options, a base model that cannot be used."""


def require_at_least_one(cfg: Any, names: Sequence[str]) -> None:
    """Refuse a config whose count fields ``names`` are below 1 (named as their CLI options)."""
    for name in names:
        if getattr(cfg, name) < 1:
            raise PosttrainError(f"--{name.replace('_', '-')} {getattr(cfg, name)}: expected >= 1")


# -- eval-only sets never feed training ---------------------------------------------------------
def eval_only_digests() -> set[str]:
    """Digests of the prompts of the eval-only sets (the shipped HumanEval-X C++)."""
    from megacpp.eval.problems import default_problems_path, load_problems

    return {prompt_digest(p.prompt) for p in load_problems(default_problems_path())}


def refuse_eval_only(prompts: Iterable[str], source: str) -> None:
    """Stop when a training prompt is an eval-only (HumanEval-X) prompt."""
    digests = eval_only_digests()
    for index, prompt in enumerate(prompts):
        if prompt_digest(prompt) in digests:
            raise PosttrainError(f"{source}: record {index + 1} is a HumanEval-X prompt; "
                                 "HumanEval-X is eval-only and never feeds training (generate "
                                 "training tasks with megacpp posttrain tasks)")


# -- prompt / completion pairs ------------------------------------------------------------------
@dataclass(frozen=True)
class Pair:
    prompt: str
    completion: str


def read_pairs(path: str | os.PathLike[str]) -> list[Pair]:
    """``{"prompt": ..., "completion": ...}`` JSONL (other fields ignored), in file order."""
    path = Path(path)
    if not path.is_file():
        raise PosttrainError(f"training data not found: {path}")
    text = read_text_bounded(path, LOG_LIMIT, what="training data", error=PosttrainError)
    pairs = []
    for line_no, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        record = parse_json(line, f"{path}:{line_no}", error=PosttrainError)
        if not (isinstance(record, dict) and isinstance(record.get("prompt"), str)
                and isinstance(record.get("completion"), str)):
            raise PosttrainError(f"{path}:{line_no}: each line needs string fields prompt and "
                                 "completion")
        if not record["completion"]:
            raise PosttrainError(f"{path}:{line_no}: the completion is empty")
        pairs.append(Pair(record["prompt"], record["completion"]))
    if not pairs:
        raise PosttrainError(f"training data {path} holds no prompt/completion pairs")
    refuse_eval_only((p.prompt for p in pairs), str(path))
    return pairs


# -- the policy ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class LoraOptions:
    r: int = 0  # 0: full fine-tuning
    alpha: float = 16.0
    dropout: float = 0.0
    targets: tuple[str, ...] = ()  # empty: every linear layer LoRA can adapt

    def check(self) -> None:
        if self.r < 0:
            raise PosttrainError(f"--lora-r {self.r}: expected >= 0 (0: full fine-tuning)")
        if self.r and not (math.isfinite(self.alpha) and self.alpha > 0):
            raise PosttrainError(f"--lora-alpha {self.alpha}: expected a number > 0")


def make_policy(model: HybridLM, lora: LoraOptions) -> Any:
    """Make ``model`` trainable in place: LoRA adapters (only they train) or every parameter.
    Returns the :class:`~megacpp.train.finetune.LoraState`, or None for full fine-tuning."""
    from megacpp.train.finetune import LoraState, add_lora, hold_frozen_routing, lora_targets

    lora.check()
    if lora.r == 0:
        for p in model.parameters():
            p.requires_grad_(True)
        return None
    state = LoraState(lora.r, lora.alpha, lora.dropout, tuple(lora_targets(model, lora.targets)))
    add_lora(model, state)
    hold_frozen_routing(model)
    return state


def frozen_copy(model: HybridLM) -> HybridLM:
    """A frozen copy of ``model`` (a plain HybridLM) in eval mode: the KL reference."""
    reference = plain_copy(model, None)
    for p in reference.parameters():
        p.requires_grad_(False)
    return reference


def plain_copy(model: HybridLM, lora: Any) -> HybridLM:
    """A new HybridLM holding ``model``'s weights (with ``lora``'s adapters folded in), on
    ``model``'s device, in eval mode. (Built from the state dict: a deep copy would also copy
    the tensors a forward left on the modules.)"""
    from megacpp.train.finetune import add_lora, merge_lora

    device = next(model.parameters()).device
    copy_ = HybridLM(model.cfg).to(device)
    if lora is not None:
        add_lora(copy_, lora)
    copy_.load_state_dict(model.state_dict())
    if lora is not None:
        merge_lora(copy_)
    return copy_.eval()


def trainable_parameters(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    return [p for p in model.parameters() if p.requires_grad]


def autocast(device: torch.device):
    """bf16 autocast for training forwards on CUDA (the weights stay float32); nothing on CPU."""
    if device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()


def index_batches(n: int, batch_size: int, seed: int):
    """Index batches of ``range(n)`` forever: a seeded shuffle per epoch, ``batch_size`` per
    batch (wrapping into the next epoch)."""
    rng = random.Random(seed)
    pending: list[int] = []
    while True:
        while len(pending) < batch_size:
            epoch = list(range(n))
            rng.shuffle(epoch)
            pending += epoch
        yield pending[:batch_size]
        pending = pending[batch_size:]


# -- checkpoints, metrics, receipt --------------------------------------------------------------
def save_checkpoint(out: Path, step: int, model: HybridLM, tokenizer: CppTokenizer,
                    lora: Any, base: str, card: str) -> Path:
    """The merged model as an HF export at ``OUT/checkpoints/step_N`` (and a LoRA run's
    adapter at ``OUT/adapters/step_N``); returns the checkpoint directory."""
    from megacpp.export.hf import write_model_dir
    from megacpp.train.finetune import adapter_state, save_adapter

    name = f"step_{step:06d}"
    checkpoint = Path(out) / CHECKPOINTS_DIR / name
    if checkpoint.exists():
        shutil.rmtree(checkpoint)
    write_model_dir(plain_copy(model, lora).float().cpu(), tokenizer, checkpoint, card=card)
    if lora is not None:
        save_adapter(adapter_state(model), lora, Path(out) / ADAPTERS_DIR / name, base)
    return checkpoint


def publish_final(out: Path, checkpoint: Path) -> Path:
    """Copy the final checkpoint to ``OUT/model`` (replacing an older one)."""
    final = Path(out) / MODEL_DIR
    tmp = final.with_name(f".tmp-{final.name}")
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(checkpoint, tmp)
    if final.exists():
        shutil.rmtree(final)
    tmp.rename(final)
    return final


def open_metrics_log(out: Path) -> MetricsLog:
    """An empty ``OUT/metrics.jsonl`` (the trainer's JSONL log: one line per record)."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    log = MetricsLog(out / METRICS_FILE)
    log.reset()
    return log


def write_run_receipt(out: Path, config: dict[str, Any], metrics: dict[str, float],
                      artifacts: Sequence[Path]) -> Path:
    path = Path(out) / RECEIPT_FILE
    write_receipt(path, "train", config=config, metrics=metrics,
                  artifacts=[a for a in artifacts if Path(a).is_file()])
    return path


def model_card(kind: str, base: str, config: dict[str, Any]) -> str:
    settings = "\n".join(f"- {key}: {value}" for key, value in config.items()
                         if not isinstance(value, dict | list))
    return (f"# megacpp post-trained model ({kind})\n\nBase: {base}\n\n{settings}\n\n"
            "Written by `megacpp posttrain`; load it with `megacpp generate --checkpoint DIR` "
            "or transformers (`trust_remote_code=True`).\n")


def check_out_dir(out: Path) -> None:
    """Refuse to write into a non-empty directory that is not an earlier post-training run."""
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise PosttrainError(f"--out {out} is a file; give a directory")
    if out.is_dir() and any(out.iterdir()) and not (out / METRICS_FILE).exists():
        raise PosttrainError(f"--out {out} is a non-empty directory that is not a posttrain run; "
                             "give a new or empty directory")
