"""SFT: completion-only labels, no gradient from prompt tokens, the loss falls (LoRA and
full), and the written checkpoint is the trained model."""

from __future__ import annotations

import json

import pytest
import torch

from megacpp.model.model import IGNORE_INDEX
from megacpp.posttrain.common import LoraOptions, Pair, PosttrainError
from megacpp.posttrain.sft import (
    SftConfig,
    completion_batch,
    completion_loss,
    encode_pair,
    run_sft,
)
from megacpp.pretrained import load_pretrained
from megacpp.train.metrics import read_metrics
from tests.posttrain.conftest import tiny_model


@pytest.fixture(scope="module")
def pairs(task_dir) -> list[Pair]:
    lines = (task_dir / "train.sft.jsonl").read_text().splitlines()[:2]
    return [Pair(r["prompt"], r["completion"]) for r in map(json.loads, lines)]


def test_labels_are_the_completion_tokens_only(tokenizer, pairs):
    rows = [encode_pair(tokenizer, pair) for pair in pairs]
    input_ids, labels = completion_batch(rows, tokenizer.pad_id)
    for i, (ids, prompt_len) in enumerate(rows):
        completion = tokenizer.encode(pairs[i].completion).tolist() + [tokenizer.eos_id]
        assert ids[:prompt_len][0] == tokenizer.bos_id and ids[prompt_len:] == completion
        targets = labels[i][labels[i] != IGNORE_INDEX].tolist()
        assert targets == completion
        # each target is the next input token
        for t in (labels[i] != IGNORE_INDEX).nonzero().flatten().tolist()[:-1]:
            assert input_ids[i, t + 1] == labels[i, t]
        assert (labels[i, :prompt_len - 1] == IGNORE_INDEX).all()


def test_prompt_tokens_get_no_gradient(tokenizer, pairs):
    """The loss's gradient reaches the logits only at positions whose target is a
    completion token: the positions predicting prompt tokens (and padding) get exactly 0."""
    model = tiny_model(tokenizer)
    rows = [encode_pair(tokenizer, pair) for pair in pairs]
    input_ids, labels = completion_batch(rows, tokenizer.pad_id)
    captured = {}
    head = model.logits

    def logits_hook(h):
        out = head(h)
        out.retain_grad()
        captured["logits"] = out
        return out

    model.logits = logits_hook
    completion_loss(model, input_ids, labels).backward()
    grad = captured["logits"].grad.abs().sum(-1)  # [B, L]
    learned = labels != IGNORE_INDEX
    assert (grad[~learned] == 0).all()
    assert (grad[learned] > 0).all()


@pytest.mark.parametrize("lora_r,lr,drop", [(8, 1e-2, 0.3), (0, 3e-3, 2.0)])
def test_loss_falls_and_the_checkpoint_is_the_trained_model(tokenizer, pairs, base_dir,
                                                            tmp_path, lora_r, lr, drop):
    model = load_pretrained(base_dir).model
    cfg = SftConfig(steps=25, batch_size=2, lr=lr, lora=LoraOptions(r=lora_r))
    metrics = run_sft(model, tokenizer, pairs, tmp_path / "run", cfg, base=str(base_dir))
    losses = [r["loss"] for r in read_metrics(tmp_path / "run" / "metrics.jsonl")]
    assert len(losses) == 25 and losses[-1] < losses[0] - drop
    assert metrics["final_loss"] == losses[-1]
    saved = load_pretrained(tmp_path / "run" / "model").model
    x = torch.tensor([encode_pair(tokenizer, pairs[0])[0]])
    with torch.no_grad():
        torch.testing.assert_close(saved(x).logits, model.eval()(x).logits, atol=1e-5, rtol=1e-5)
    assert (tmp_path / "run" / "receipt.json").is_file()
    adapter = tmp_path / "run" / "adapters" / "step_000025" / "adapter_config.json"
    assert adapter.is_file() == bool(lora_r)


def test_bad_sft_input_is_an_error(tokenizer, pairs, tmp_path):
    with pytest.raises(PosttrainError, match="--max-len 8"):
        run_sft(tiny_model(tokenizer), tokenizer, pairs, tmp_path / "a", SftConfig(max_len=8),
                base="x")
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "keep.txt").write_text("mine")
    with pytest.raises(PosttrainError, match="not a posttrain run"):
        run_sft(tiny_model(tokenizer), tokenizer, pairs, tmp_path / "b", SftConfig(), base="x")
    assert (tmp_path / "b" / "keep.txt").read_text() == "mine"
