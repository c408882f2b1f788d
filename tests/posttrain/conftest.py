"""Fixtures for post-training: the generated task set, a tokenizer trained on it, a tiny
model (every core block family) and that model written as a base directory."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from megacpp.data.tokenizer import CppTokenizer, train_tokenizer
from megacpp.model.model import HybridLM
from megacpp.posttrain.tasks import write_task_set
from tests.eval.conftest import make_verifier
from tests.model.conftest import small_config


@pytest.fixture(scope="session")
def task_dir(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("tasks")
    write_task_set(out, seed=0)
    return out


@pytest.fixture(scope="session")
def tokenizer(task_dir) -> CppTokenizer:
    texts = [r["prompt"] + r["canonical_solution"] + r["test"]
             for r in map(json.loads, (task_dir / "train.jsonl").read_text().splitlines())]
    return CppTokenizer.from_hf(train_tokenizer(texts, vocab_size=600))


def tiny_model(tokenizer: CppTokenizer, seed: int = 0) -> HybridLM:
    torch.manual_seed(seed)
    return HybridLM(small_config("AEMR", vocab_size=tokenizer.vocab_size))


@pytest.fixture(scope="session")
def base_dir(tmp_path_factory, tokenizer) -> Path:
    """The tiny model as a megacpp export hf directory (what --base reads)."""
    from megacpp.export.hf import write_model_dir

    out = tmp_path_factory.mktemp("base") / "base"
    return write_model_dir(tiny_model(tokenizer), tokenizer, out, card="tiny test model\n")


@pytest.fixture(scope="session")
def verifier():
    return make_verifier()
