"""Supervised fine-tuning on prompt/completion pairs with a completion-only loss.

A pair becomes one row: ``BOS + prompt tokens + completion tokens + EOS``. The labels are
the next tokens (the model's convention: ``labels[t]`` is the target at position ``t``) with
every target that is a prompt token set to the ignore index, so only the completion (and its
EOS) is learned; rows of a batch are right-padded with ignored targets. LoRA adapters
(``peft``, through :mod:`megacpp.train.finetune`) or every parameter train, with AdamW.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from megacpp.data.tokenizer import CppTokenizer
from megacpp.model.model import IGNORE_INDEX, HybridLM
from megacpp.posttrain.common import (
    LoraOptions,
    Pair,
    PosttrainError,
    autocast,
    check_out_dir,
    index_batches,
    make_policy,
    model_card,
    open_metrics_log,
    publish_final,
    require_at_least_one,
    save_checkpoint,
    trainable_parameters,
    write_run_receipt,
)


@dataclass(frozen=True)
class SftConfig:
    steps: int = 100
    batch_size: int = 8
    lr: float = 2e-4
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    max_len: int = 1024  # tokens per row at most (prompt + completion + EOS)
    seed: int = 0
    save_every: int = 0  # 0: only at the end
    lora: LoraOptions = field(default_factory=LoraOptions)

    def check(self) -> None:
        require_at_least_one(self, ("steps", "batch_size", "max_len"))
        if not (math.isfinite(self.lr) and self.lr > 0):
            raise PosttrainError(f"--lr {self.lr}: expected a number > 0")
        if self.save_every < 0:
            raise PosttrainError(f"--save-every {self.save_every}: expected >= 0")
        self.lora.check()


def prompt_ids(tokenizer: CppTokenizer, prompt: str) -> list[int]:
    """``BOS + prompt`` token ids: how SFT rows and GRPO samples start."""
    return [tokenizer.bos_id, *tokenizer.encode(prompt).tolist()]


def encode_pair(tokenizer: CppTokenizer, pair: Pair) -> tuple[list[int], int]:
    """(``BOS + prompt + completion + EOS`` token ids, number of prompt ids incl. BOS)."""
    prompt = prompt_ids(tokenizer, pair.prompt)
    completion = [*tokenizer.encode(pair.completion).tolist(), tokenizer.eos_id]
    return prompt + completion, len(prompt)


def completion_batch(rows: Sequence[tuple[list[int], int]], pad_id: int
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """(input ids [B, L], labels [B, L]) for rows of (token ids, prompt length): labels are the
    next tokens where the next token belongs to the completion, else IGNORE_INDEX."""
    length = max(len(ids) for ids, _ in rows) - 1
    input_ids = torch.full((len(rows), length), pad_id, dtype=torch.long)
    labels = torch.full((len(rows), length), IGNORE_INDEX, dtype=torch.long)
    for i, (ids, prompt_len) in enumerate(rows):
        n = len(ids) - 1
        input_ids[i, :n] = torch.tensor(ids[:-1])
        # position t predicts ids[t + 1]: completion targets start at t = prompt_len - 1
        labels[i, prompt_len - 1:n] = torch.tensor(ids[prompt_len:])
    return input_ids, labels


def completion_loss(model: HybridLM, input_ids: torch.Tensor, labels: torch.Tensor
                    ) -> torch.Tensor:
    """The model's loss (mean cross-entropy over the completion targets, plus its auxiliary
    losses)."""
    with autocast(input_ids.device):
        return model(input_ids, labels=labels).loss


def encode_pairs(tokenizer: CppTokenizer, pairs: Sequence[Pair], max_len: int
                 ) -> list[tuple[list[int], int]]:
    rows = []
    for index, pair in enumerate(pairs):
        ids, prompt_len = encode_pair(tokenizer, pair)
        if len(ids) > max_len:
            raise PosttrainError(f"pair {index + 1} is {len(ids)} tokens, more than --max-len "
                                 f"{max_len}; raise --max-len or shorten it")
        rows.append((ids, prompt_len))
    return rows


def run_sft(model: HybridLM, tokenizer: CppTokenizer, pairs: Sequence[Pair], out: Path,
            cfg: SftConfig, *, base: str, device: str | torch.device = "cpu",
            on_step: Callable[[dict[str, Any]], None] | None = None) -> dict[str, Any]:
    """Fine-tune ``model`` on ``pairs``; writes ``out`` (see :mod:`megacpp.posttrain.common`)
    and returns the summary metrics."""
    cfg.check()
    out = Path(out)
    check_out_dir(out)
    rows = encode_pairs(tokenizer, pairs, cfg.max_len)
    torch.manual_seed(cfg.seed)
    model = model.to(device)
    lora = make_policy(model, cfg.lora)
    params = trainable_parameters(model)
    optimizer = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
    config = {"posttrain": "sft", "base": base, "pairs": len(pairs), **asdict(cfg),
              "trainable_parameters": sum(p.numel() for p in params),
              "pattern": model.cfg.pattern}
    card = model_card("sft", base, config)
    order = index_batches(len(rows), cfg.batch_size, cfg.seed)
    log = open_metrics_log(out)
    started = time.monotonic()
    losses: list[float] = []
    checkpoint = None
    model.train()
    for step in range(1, cfg.steps + 1):
        input_ids, labels = completion_batch([rows[i] for i in next(order)],
                                             tokenizer.pad_id)
        loss = completion_loss(model, input_ids.to(device), labels.to(device))
        if not torch.isfinite(loss):
            raise PosttrainError(f"step {step}: the loss is {loss.item()}; lower --lr")
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
        optimizer.step()
        losses.append(loss.item())
        record = {"step": step, "loss": losses[-1], "grad_norm": float(grad_norm),
                  "completion_tokens": int((labels != IGNORE_INDEX).sum()),
                  "elapsed_s": round(time.monotonic() - started, 3)}
        log.write(record)
        if on_step is not None:
            on_step(record)
        if (cfg.save_every and step % cfg.save_every == 0) or step == cfg.steps:
            checkpoint = save_checkpoint(out, step, model, tokenizer, lora, base, card)
    final = publish_final(out, checkpoint)
    metrics = {"steps": float(cfg.steps), "first_loss": losses[0], "final_loss": losses[-1],
               "wall_s": time.monotonic() - started}
    write_run_receipt(out, config, metrics, [log.path, final / "config.json"])
    return metrics
