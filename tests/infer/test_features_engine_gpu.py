"""The engine on a GPU with the model's input features on: the captured CUDA-graph decode
(with its structure-id and n-gram context buffers) gives the eager decode's and the full
forward's greedy tokens (float64)."""

from __future__ import annotations

from pathlib import Path

import pytest

from megacpp.data.tokenizer import CppTokenizer, train_tokenizer
from megacpp.infer.engine import Engine, EngineConfig
from megacpp.infer.structure import StructureIds
from tests.infer.test_features_engine import GREEDY, PROMPTS, _model, _reference, _run

SOURCES = sorted((Path(__file__).parents[2] / "src" / "megacpp" / "infer").glob("*.py"))


@pytest.mark.gpu
def test_graph_decode_with_features_equals_eager_and_the_full_forward():
    # the GPU machine has no libstdc++ headers: a tokenizer of the repo's own sources
    texts = [p.read_text(encoding="utf-8") for p in SOURCES]
    tokenizer = CppTokenizer.from_hf(train_tokenizer(texts, vocab_size=600))
    model = _model(tokenizer.vocab_size, structure=True, orders=(2, 3)).cuda()
    config = {"max_num_seqs": 4, "block_size": 4, "max_model_len": 64, "prefill_chunk": 8}
    graphed = Engine(model, tokenizer, EngineConfig(**config), device="cuda")
    assert graphed.graphs is not None
    with_graphs = _run(graphed, PROMPTS)
    assert graphed.graphs.graphs  # captured and replayed
    eager = Engine(model, tokenizer, EngineConfig(**config, cuda_graphs=False), device="cuda")
    assert with_graphs == _run(eager, PROMPTS)
    labeler = StructureIds(tokenizer)
    model_cpu = model.cpu()
    for i, prompt in enumerate(PROMPTS):
        want = _reference(model_cpu, tokenizer, prompt, GREEDY.max_new_tokens, labeler)
        assert with_graphs[str(i)] == want
