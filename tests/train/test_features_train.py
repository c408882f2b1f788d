"""Training with the model's input features (model/features.py) on a real dataset: the
structure ids of the batches reach the model, both feature tables train and checkpoint, a
dataset without structure ids is refused, and the ids the shards store are the ids the
serving engine computes for the same document."""

from __future__ import annotations

import copy
import io

import pytest
from rich.console import Console

from megacpp.data.shards import ShardedDataset
from megacpp.errors import ConfigError
from megacpp.infer.structure import StructureIds
from megacpp.model.config import config_from_pattern
from megacpp.train.checkpoint import load_trained_model
from megacpp.train.config import load_run_config
from megacpp.train.trainer import _require_structure_ids, train
from tests.train.helpers import run_config, train_losses, write_config

FEATURES = {"structure": {"embedding": True}, "ngram": {"orders": [2, 3], "table_size": 512}}


def test_structure_and_ngram_tables_train_and_checkpoint(tmp_path, cpp_dataset):
    config = run_config(cpp_dataset, tmp_path / "run", train={"steps": 4, "eval_every": 2})
    config["model"].update(copy.deepcopy(FEATURES))
    cfg = load_run_config(write_config(tmp_path / "run.toml", config), [])
    result = train(cfg, console=Console(file=io.StringIO()))
    assert len(train_losses(result.run_dir)) == 4
    model = load_trained_model(result.run_dir / "checkpoints" / "step_000004")
    assert model.cfg.structure.embedding and model.cfg.ngram.orders == (2, 3)
    structure = model.structure_embed.weight
    # rows of ids the batches carried moved away from their zero init; the table has a row per id
    assert structure.shape[0] == 9 and (structure.abs().sum(-1) > 0).sum() >= 3
    for table in model.ngram_embed.tables:
        assert (table.weight.abs().sum(-1) > 0).sum() > 10


def test_a_dataset_without_structure_ids_is_refused(cpp_dataset):
    dataset = ShardedDataset.open(cpp_dataset, verify=False)
    cfg = config_from_pattern("AEMR", structure={"embedding": True})
    _require_structure_ids(cfg, dataset)  # built with structure ids: accepted
    dataset.manifest["config"]["structure"]["enabled"] = False
    with pytest.raises(ConfigError, match=r"has none \(built with \[structure\] enabled = false"):
        _require_structure_ids(cfg, dataset)
    _require_structure_ids(config_from_pattern("AEMR"), dataset)  # no embedding: no need


def test_stored_structure_ids_equal_the_serving_paths(cpp_dataset):
    """Every document piece of the first row groups: the structure ids the build stored == the
    ids StructureIds.label gives the whole document's tokens (BOS .. EOS: what the engine
    computes for the document as a prompt), at the piece's offset."""
    dataset = ShardedDataset.open(cpp_dataset, verify=False)
    tokenizer = dataset.tokenizer()
    labeler = StructureIds(tokenizer)
    docs = dataset.documents(["doc_index", "text"]).to_pydict()
    texts = dict(zip(docs["doc_index"], docs["text"], strict=True))
    served: dict[int, tuple[list[int], list[int]]] = {}
    checked = 0
    for block in dataset.iter_blocks("train"):
        for r in range(len(block.rows)):
            tokens, stored = block.tokens[r], block.structure_ids[r]
            starts = [*block.doc_starts[r].tolist(), int(block.num_tokens[r])]
            for (doc, token_start), start, end in zip(block.segments[r], starts, starts[1:]):
                if doc not in served:
                    ids = [tokenizer.bos_id, *tokenizer.encode(texts[doc]).tolist(),
                           tokenizer.eos_id]
                    served[doc] = (ids, labeler.label(ids))
                ids, labels = served[doc]
                piece = slice(token_start, token_start + end - start)
                assert tokens[start:end].tolist() == ids[piece]
                assert stored[start:end].tolist() == labels[piece]
                checked += end - start
        if len(served) >= 3:
            break
    assert checked >= 1000 and len(served) >= 3
    assert len({i for _, labels in served.values() for i in labels}) >= 5  # real labels
