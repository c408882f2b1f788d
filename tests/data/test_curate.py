"""CorpusConfig validation and the whole curation half, end to end, on a hostile tree and on
real libstdc++ headers."""

from __future__ import annotations

import itertools

import pytest

from megacpp.data.config import CorpusConfig, field_names
from megacpp.data.curate import curate, curate_stream, curation_steps
from megacpp.errors import ConfigError, MegaCppError

# ------------------------------------------------------------------ config


def test_defaults_round_trip_through_dict():
    cfg = CorpusConfig()
    assert CorpusConfig.from_dict(cfg.to_dict()) == cfg
    assert cfg.to_dict()["extensions"][:3] == [".c", ".cc", ".cpp"]
    assert set(cfg.to_dict()) == set(field_names())


def test_from_dict_normalizes_lists_and_case():
    cfg = CorpusConfig.from_dict({"extensions": [".CPP", ".h", ".cpp"], "min_alnum_ratio": 0})
    assert cfg.extensions == (".cpp", ".h") and cfg.min_alnum_ratio == 0.0


@pytest.mark.parametrize(
    ("table", "message"),
    [
        ({"max_bites": 10}, r"unknown key\(s\) \['max_bites'\] in \[corpus\]; allowed: \["),
        ({"non_utf8": "ignore"}, r'corpus.non_utf8: expected "drop" or "replace", got \'ignore\''),
        ({"max_bytes": 0}, r"corpus.max_bytes: expected an integer in 1\.\.1073741824, got 0"),
        ({"max_bytes": "1MiB"}, r"corpus.max_bytes: expected an integer in 1\.\."),
        ({"max_bytes": 2**40}, r"corpus.max_bytes: expected an integer in 1\.\."),
        ({"minhash_num_perm": 2**40}, r"corpus.minhash_num_perm: expected an integer in 1\.\.4096"),
        ({"minhash_seed": 2**32}, r"corpus.minhash_seed: expected an integer in 0\.\."),
        ({"min_bytes": 10, "max_bytes": 5}, r"min_bytes \(10\) must not exceed"),
        ({"follow_symlinks": 1}, r"corpus.follow_symlinks: expected true or false, got 1"),
        ({"extensions": ["cpp"]}, r'corpus.extensions: expected extensions that start with "\."'),
        ({"extensions": ".cpp"}, r"corpus.extensions: expected a list of non-empty strings"),
        ({"license_deny": [""]}, r"corpus.license_deny: expected a list of non-empty strings"),
        ({"min_alnum_ratio": 1.5}, r"corpus.min_alnum_ratio: expected a number in \[0, 1\]"),
        ({"min_alnum_ratio": "high"}, r"corpus.min_alnum_ratio: expected a number in \[0, 1\]"),
        ({"near_dedup": "yes"}, r"corpus.near_dedup: expected true or false, got 'yes'"),
        ({"near_dup_threshold": 0}, r"corpus.near_dup_threshold: expected a number in \(0, 1\]"),
        ({"lsh_bands": 32, "lsh_rows": 8}, r"32 x 8 = 256 exceeds corpus.minhash_num_perm = 128"),
        ({"shingle_size": True}, r"corpus.shingle_size: expected an integer in 1\.\.256, got True"),
    ],
)
def test_from_dict_rejects_bad_values_naming_the_field(table, message):
    with pytest.raises(ConfigError, match=message):
        CorpusConfig.from_dict(table)


def test_from_dict_rejects_a_non_table():
    with pytest.raises(ConfigError, match=r"\[corpus\] must be a table, got list"):
        CorpusConfig.from_dict(["max_bytes", 3])  # type: ignore[arg-type]


# ------------------------------------------------------------------ curation


def test_canonical_step_order():
    names = [s.name for s in curation_steps(CorpusConfig())]
    assert names == [
        "binary",
        "decode",
        "size",
        "generated",
        "license",
        "exact_dedup",
        "near_dedup",
    ]
    off = CorpusConfig(exact_dedup=False, near_dedup=False)
    assert [s.name for s in curation_steps(off)][-1] == "license"


@pytest.mark.timeout(60)
def test_hostile_tree_end_to_end(hostile_corpus):
    docs, stats = curate([hostile_corpus.root], CorpusConfig(max_bytes=64 * 1024))
    assert {d.rel_path for d in docs} == hostile_corpus.kept
    by_stage = {s.name: s for s in stats}
    expected_drops: dict[str, int] = {}
    for reason in hostile_corpus.drops.values():
        expected_drops[reason] = expected_drops.get(reason, 0) + 1
    observed = {r: n for s in stats[1:] for r, n in s.dropped.items()}
    assert observed == expected_drops
    for reason, count in hostile_corpus.source_skips.items():
        assert by_stage["sources"].dropped[reason] == count
    assert by_stage["decode"].notes["bom_stripped"] == 1
    # every stage's counters add up, and each stage sees what the previous one kept
    for previous, stage in itertools.pairwise(stats):
        assert stage.seen == previous.kept
        assert stage.seen == stage.kept + sum(stage.dropped.values())
    for document in docs:
        assert document.text is not None and document.raw is None and document.license
    assert next(d for d in docs if d.rel_path == "lib/good0.cpp").license == (
        "GPL-3.0-or-later WITH GCC-exception-3.1"
    )


def test_non_utf8_replace_policy_keeps_the_latin1_file(hostile_corpus):
    docs, stats = curate(
        [hostile_corpus.root], CorpusConfig(max_bytes=64 * 1024, non_utf8="replace")
    )
    assert "bad/latin1.cpp" in {d.rel_path for d in docs}
    assert stats[2].name == "decode" and stats[2].notes["replaced_invalid_utf8"] == 1


def test_stream_is_lazy_and_stats_fill_in(hostile_corpus):
    stream, stats = curate_stream([hostile_corpus.root], CorpusConfig(max_bytes=64 * 1024))
    assert all(s.seen == 0 for s in stats)
    first = next(stream)
    assert first.rel_path and stats[0].kept >= 1
    rest = list(stream)
    assert len(rest) + 1 == stats[-1].kept


def test_bad_root_is_a_clean_error(tmp_path):
    with pytest.raises(MegaCppError, match="does not exist"):
        curate_stream([tmp_path / "missing"], CorpusConfig())


def test_real_headers_survive_with_their_licenses(real_headers):
    docs, _ = curate(real_headers, CorpusConfig())
    assert [d.rel_path for d in docs] == [p.name for p in real_headers]
    for document, path in zip(docs, real_headers):
        assert document.text == path.read_text(encoding="utf-8")
        assert "GPL-3.0" in document.license
