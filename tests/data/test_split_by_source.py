"""``packing.val_sources``: the validation split is whole source trees, and copies of their
documents (exact or near) are dropped from the train trees. Real builds of small trees."""

from __future__ import annotations

from pathlib import Path

import pyarrow.parquet as pq
import pytest

from megacpp.data.build import BuildConfig, build_dataset
from megacpp.errors import ConfigError
from tests.data.packed_fixtures import SYNTHETIC, tiny_config_dict


def _function(name: str, body_lines: int) -> str:
    """A distinct, realistic C++ function (tokens differ by ``name`` and the constants)."""
    lines = [f"int {name}(const std::vector<int>& values, int limit) {{", "    int total = 0;"]
    for i in range(body_lines):
        lines.append(f"    if (values.size() > {i}u && values[{i}] < limit * {i + 3}) "
                     f"{{ total += values[{i}] ^ {i * 7 + 1}; }}")
    lines += ["    return total;", "}", ""]
    return "\n".join(lines)


VAL_FILE = "#include <vector>\n// shared helper\n" + _function("checksum", 40)


def write_trees(root: Path) -> dict[str, Path]:
    """Three source trees: ``lib_a`` (train), ``valpkg`` (validation), ``lib_b`` (train, holding
    an exact and a near copy of valpkg's file besides its own files)."""
    trees = {name: root / name for name in ("lib_a", "valpkg", "lib_b")}
    for rel, text in SYNTHETIC.items():
        path = trees["lib_a"] / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
    files = {
        "valpkg/checksum.cc": VAL_FILE,
        "valpkg/other.cc": "#include <string>\n" + _function("parse_header", 30),
        "lib_b/vendored/checksum.cc": VAL_FILE.replace("    ", "  "),  # whitespace only
        "lib_b/fork/checksum.cc": VAL_FILE.replace("limit * 39", "limit * 99") + "// fork\n",
        "lib_b/own.cc": "#include <map>\n" + _function("route_table", 25),
    }
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
    return trees


def _documents(out: Path) -> list[dict]:
    return pq.read_table(out / "documents.parquet",
                         columns=["split", "source_root", "rel_path"]).to_pylist()


def test_validation_is_whole_trees_and_their_copies_leave_train(tmp_path: Path) -> None:
    trees = write_trees(tmp_path / "src")
    config = tiny_config_dict()
    config["packing"]["val_sources"] = ["valpkg"]
    out = tmp_path / "dataset"
    # the validation tree is not given first: the build walks it first anyway
    result = build_dataset([trees["lib_a"], trees["lib_b"], trees["valpkg"]], out,
                           BuildConfig.from_dict(config), workers=1)
    docs = _documents(out)
    val_root, lib_b = str(trees["valpkg"]), str(trees["lib_b"])
    assert {d["rel_path"] for d in docs if d["split"] == "validation"} == {
        "checksum.cc", "other.cc"}
    assert all(d["source_root"] == val_root for d in docs if d["split"] == "validation")
    assert all(d["source_root"] != val_root for d in docs if d["split"] == "train")
    train_b = {d["rel_path"] for d in docs if d["source_root"] == lib_b}
    assert train_b == {"own.cc"}  # both copies of valpkg/checksum.cc were dropped
    split = next(s for s in result.manifest["stages"] if s["name"] == "split")
    assert split["notes"]["train_dropped_as_exact_duplicate_of_validation"] == 1
    assert split["notes"]["train_dropped_as_near_duplicate_of_validation"] == 1
    assert split["notes"]["validation"] == 2
    assert result.manifest["sources"][0] == val_root
    assert result.manifest["config"]["packing"]["val_sources"] == ["valpkg"]
    assert result.manifest["splits"]["validation"]["documents"] == 2


def test_without_val_sources_the_split_is_by_content_hash(tmp_path: Path) -> None:
    """Without val_sources the split is by content hash (the default, unchanged)."""
    trees = write_trees(tmp_path / "src")
    out = tmp_path / "dataset"
    result = build_dataset(list(trees.values()), out,
                           BuildConfig.from_dict(tiny_config_dict(val_permille=500)), workers=1)
    split = next(s for s in result.manifest["stages"] if s["name"] == "split")
    assert not any(k.startswith("train_dropped") for k in split["notes"])
    roots = {d["source_root"] for d in _documents(out) if d["split"] == "validation"}
    assert roots  # validation documents come from wherever their hash falls


@pytest.mark.parametrize(("names", "message"), [
    (["nope"], r"'nope' names no source root; it must be the directory name of exactly one"),
    (["lib_a", "lib_b", "valpkg"], r"no training documents: .*val_sources="),
])
def test_bad_val_sources_are_refused(tmp_path: Path, names, message) -> None:
    from megacpp.errors import MegaCppError

    trees = write_trees(tmp_path / "src")
    config = tiny_config_dict()
    config["packing"]["val_sources"] = names
    with pytest.raises(MegaCppError, match=message):
        build_dataset(list(trees.values()), tmp_path / "dataset", BuildConfig.from_dict(config),
                      workers=1)
    assert not (tmp_path / "dataset").exists()


def test_val_sources_must_be_names() -> None:
    with pytest.raises(ConfigError, match="packing.val_sources: expected a list of source root"):
        BuildConfig.from_dict({"packing": {"val_sources": ["ok", ""]}})
    with pytest.raises(ConfigError, match="packing.val_sources = .valpkg.: expected a list of strings"):
        BuildConfig.from_dict({"packing": {"val_sources": "valpkg"}})
