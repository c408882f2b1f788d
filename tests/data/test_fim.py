"""Fill-in-the-middle in the data build: the seeded plan, the PSM/SPM layouts, and a real
build in which train documents are rearranged, validation documents are not, and a rebuild
gives the same bytes."""

from __future__ import annotations

import itertools
import json

import numpy as np
import pytest

from megacpp.data.build import BuildConfig, build_dataset
from megacpp.data.fim import PSM, SPM, FimConfig, FimIds, FimPlan, arrange, plan_fim, psm_prompt
from megacpp.data.packing import TRAIN, VALIDATION
from megacpp.data.shards import ShardedDataset
from megacpp.errors import ConfigError, MegaCppError
from tests.data.packed_fixtures import tiny_config_dict, write_corpus

TEXT = "int add(int a, int b) {\n    return a + b;\n}\n"


def test_plan_is_seeded_by_config_and_content():
    cfg = FimConfig(rate=1.0, spm_rate=0.5, seed=3)
    plan = plan_fim(TEXT, "ab" * 32, cfg)
    assert plan == plan_fim(TEXT, "ab" * 32, cfg)  # same inputs, same plan
    assert 0 <= plan.start <= plan.end <= len(TEXT)
    assert "".join(plan.pieces(TEXT)) == TEXT
    plans = {plan_fim(TEXT, f"{i:064x}", cfg) for i in range(200)}
    assert len(plans) > 50  # the cuts vary with the document
    assert {p.order for p in plans} == {PSM, SPM}
    other_seed = {plan_fim(TEXT, f"{i:064x}", FimConfig(1.0, 0.5, 4)) for i in range(200)}
    assert other_seed != plans


def test_rate_and_spm_rate_are_shares():
    hashes = [f"{i:064x}" for i in range(2000)]
    assert all(plan_fim(TEXT, h, FimConfig(rate=0.0)) is None for h in hashes)
    assert plan_fim("", hashes[0], FimConfig(rate=1.0)) is None
    half = [plan_fim(TEXT, h, FimConfig(rate=0.5, spm_rate=0.0)) for h in hashes]
    chosen = [p for p in half if p is not None]
    assert 0.45 < len(chosen) / len(hashes) < 0.55
    assert all(p.order == PSM for p in chosen)
    spm = [plan_fim(TEXT, h, FimConfig(rate=1.0, spm_rate=1.0)) for h in hashes[:50]]
    assert all(p.order == SPM for p in spm)


@pytest.mark.parametrize("table, message", [
    ({"rate": 1.5}, r"fim.rate = 1.5: expected a number in \[0, 1\]"),
    ({"spm_rate": -0.1}, r"fim.spm_rate = -0.1: expected a number in \[0, 1\]"),
    ({"seed": -1}, r"fim.seed = -1: expected an integer"),
    ({"rate": "half"}, r"fim.rate = 'half': expected a finite number"),
    ({"order": "psm"}, r"unknown key.*order"),
])
def test_bad_fim_table_names_the_key(table, message):
    with pytest.raises(ConfigError, match=message):
        BuildConfig.from_dict({"fim": table})


def test_layouts():
    fim = FimIds(prefix=4, middle=5, suffix=6)
    prefix, middle, suffix = (np.array(v, np.int32) for v in ([10, 11], [20], [30, 31, 32]))
    labels = tuple(np.full(len(p), k, np.uint8) for k, p in zip((1, 2, 3),
                                                                 (prefix, middle, suffix)))
    ids, structure = arrange(FimPlan(PSM, 0, 0), (prefix, middle, suffix), labels, fim)
    assert ids.tolist() == [4, 10, 11, 6, 30, 31, 32, 5, 20]
    assert structure.tolist() == [0, 1, 1, 0, 3, 3, 3, 0, 2]
    ids, structure = arrange(FimPlan(SPM, 0, 0), (prefix, middle, suffix), labels, fim)
    assert ids.tolist() == [4, 6, 30, 31, 32, 5, 10, 11, 20]
    assert structure.tolist() == [0, 0, 3, 3, 3, 0, 1, 1, 2]
    assert psm_prompt([10, 11], [30], fim) == [4, 10, 11, 6, 30, 5]


def test_tokenizer_without_fim_tokens_is_refused():
    class Plain:
        bos_id, eos_id = 1, 2

    with pytest.raises(MegaCppError, match="no fill-in-the-middle tokens"):
        FimIds.of(Plain())


def _documents_tokens(ds: ShardedDataset, split: str, bos: int) -> list[list[int]]:
    """Each document's packed tokens (BOS..EOS) of ``split``, in document order."""
    stream = [t for block in ds.iter_blocks(split, with_provenance=False)
              for row, n in zip(block.tokens, block.num_tokens) for t in row[:n].tolist()]
    starts = [i for i, t in enumerate(stream) if t == bos] + [len(stream)]
    return [stream[a:b] for a, b in itertools.pairwise(starts)]


def _build(tmp_path, name: str, fim: dict) -> ShardedDataset:
    sources = tmp_path / "src"
    if not sources.exists():
        write_corpus(sources, real=False)
    config = {**tiny_config_dict(val_permille=300), "fim": fim}
    out = tmp_path / name
    build_dataset([sources], out, BuildConfig.from_dict(config), workers=1)
    return ShardedDataset.open(out)


def test_build_rearranges_train_documents_only(tmp_path):
    ds = _build(tmp_path, "fim", {"rate": 1.0, "spm_rate": 0.5, "seed": 1})
    tok = ds.tokenizer()
    fim = FimIds.of(tok)
    docs = ds.documents(["split", "text", "meta", "num_tokens"]).to_pylist()
    stage = next(s for s in ds.manifest["stages"] if s["name"] == "fim")
    n_train = sum(d["split"] == TRAIN for d in docs)
    assert stage["notes"].get("psm", 0) + stage["notes"].get("spm", 0) == n_train
    assert stage["notes"]["left_to_right"] == len(docs) - n_train > 0
    assert ds.manifest["config"]["fim"] == {"rate": 1.0, "spm_rate": 0.5, "seed": 1}
    for split in (TRAIN, VALIDATION):
        packed = _documents_tokens(ds, split, tok.bos_id)
        records = [d for d in docs if d["split"] == split]
        assert len(packed) == len(records)
        for tokens, record in zip(packed, records):
            assert tokens[0] == tok.bos_id and tokens[-1] == tok.eos_id
            body = tokens[1:-1]
            assert record["num_tokens"] == len(body)
            if split == VALIDATION:  # left to right, exactly the text's tokens
                assert body == tok.encode(record["text"]).tolist()
                assert "fim" not in json.loads(record["meta"])
                continue
            plan = json.loads(record["meta"])["fim"]
            prefix, middle, suffix = (tok.encode(piece).tolist() for piece in FimPlan(
                plan["order"], plan["start"], plan["end"]).pieces(record["text"]))
            if plan["order"] == PSM:
                expected = [fim.prefix, *prefix, fim.suffix, *suffix, fim.middle, *middle]
            else:
                expected = [fim.prefix, fim.suffix, *suffix, fim.middle, *prefix, *middle]
            assert body == expected
    assert {json.loads(d["meta"])["fim"]["order"] for d in docs if d["split"] == TRAIN} == {
        PSM, SPM}


def test_fim_build_is_reproducible_and_rate_zero_is_left_to_right(tmp_path):
    first = _build(tmp_path, "a", {"rate": 0.5, "seed": 2})
    second = _build(tmp_path, "b", {"rate": 0.5, "seed": 2})
    shards = [[s["sha256"] for s in ds.shards(TRAIN)] for ds in (first, second)]
    assert shards[0] == shards[1]
    plain = _build(tmp_path, "plain", {"rate": 0.0})
    tok = plain.tokenizer()
    for tokens in _documents_tokens(plain, TRAIN, tok.bos_id):
        assert not {tok.fim_prefix_id, tok.fim_middle_id, tok.fim_suffix_id} & set(tokens)
    # validation is the same with and without FIM
    assert [s["sha256"] for s in plain.shards(VALIDATION)] == [
        s["sha256"] for s in first.shards(VALIDATION)]
