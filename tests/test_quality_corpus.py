"""benchmarks/quality_corpus.py on small real trees: pack (export from a git snapshot, curate,
drop a HumanEval-X look-alike, train the tokenizer, compress), then build (unpack, verify,
`megacpp data build` with the validation split by tree)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from megacpp.data.shards import ShardedDataset
from tests.data.packed_fixtures import SYNTHETIC
from tests.train.helpers import single_thread_env

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = str(ROOT / "benchmarks" / "quality_corpus.py")


def _git_snapshot(mirror: Path, owner_name: str, files: dict[str, str]) -> None:
    """A bare git directory at MIRROR/OWNER+NAME/repo, as the search tool's fetch leaves it."""
    work = mirror.parent / f"work-{owner_name.replace('/', '-')}"
    for rel, text in files.items():
        (work / rel).parent.mkdir(parents=True, exist_ok=True)
        (work / rel).write_text(text, encoding="utf-8")
    git = ["git", "-c", "user.email=t@example.com", "-c", "user.name=t", "-C", str(work)]
    subprocess.run(["git", "init", "-q", str(work)], check=True)
    subprocess.run([*git, "add", "-A"], check=True)
    subprocess.run([*git, "commit", "-q", "-m", "snapshot"], check=True)
    subprocess.run(["git", "clone", "-q", "--bare", str(work),
                    str(mirror / owner_name.replace("/", "+") / "repo")], check=True)


def _function(name: str, lines: int) -> str:
    body = "\n".join(f"    total += values[{i}] * {i + 2} - limit;" for i in range(lines))
    return (f"#include <vector>\nint {name}(const std::vector<int>& values, int limit) {{\n"
            f"    int total = 0;\n{body}\n    return total;\n}}\n")


@pytest.mark.slow
def test_pack_then_build(tmp_path: Path) -> None:
    mirror = tmp_path / "mirror"
    _git_snapshot(mirror, "acme/lib", {**SYNTHETIC, "src/checksum.cc": _function("checksum", 30),
                                       "README.md": "not C++\n",
                                       # a HumanEval-X solution (CPP/0's signature): dropped
                                       "src/he.cpp": "#include <vector>\nusing namespace std;\n"
                                       "bool has_close_elements(vector<float> numbers, float "
                                       "threshold){\n    return false;\n}\n"})
    _git_snapshot(mirror, "acme/heldout", {"a.cc": _function("parse", 25),
                                           "b.h": _function("route", 20)})
    sources = tmp_path / "sources.toml"
    sources.write_text('[[tree]]\nname = "heldout"\nrole = "validation"\ngithub = "acme/heldout"\n'
                       '\n[[tree]]\nname = "lib"\ngithub = "acme/lib"\n')
    config = tmp_path / "build.toml"
    config.write_text('[tokenizer]\nvocab_size = 512\n\n[packing]\nseq_len = 64\n'
                      'rows_per_shard = 64\nrows_per_group = 8\nval_sources = ["heldout"]\n')
    carry = tmp_path / "carry"
    env = single_thread_env()
    pack = subprocess.run([sys.executable, SCRIPT, "pack", "--sources", str(sources), "--config",
                           str(config), "--mirror", str(mirror), "--out", str(carry), "--jobs",
                           "1", "--scratch", str(tmp_path)], capture_output=True, text=True,
                          env=env, cwd=ROOT, timeout=300, check=False)
    assert pack.returncode == 0, pack.stderr[-3000:]
    manifest = json.loads((carry / "corpus_manifest.json").read_text())
    trees = {t["name"]: t for t in manifest["trees"]}
    assert trees["heldout"]["role"] == "validation" and trees["heldout"]["files"] == 2
    assert len(trees["lib"]["commit"]) == 40
    assert manifest["humaneval_decontamination"]["documents"] == {
        "lib/src/he.cpp": "has_close_elements"}
    assert sorted(p.name for p in carry.iterdir()) == sorted(
        ["corpus_manifest.json", "heldout.tar.xz", "lib.tar.xz", "tokenizer.json.xz",
         "humaneval-x-cpp.jsonl.gz"])

    out = tmp_path / "data" / "quality"
    build = subprocess.run([sys.executable, SCRIPT, "build", "--carry", str(carry), "--out",
                            str(out), "--config", str(config), "--workers", "1"],
                           capture_output=True, text=True, env=env, cwd=ROOT, timeout=300,
                           check=False)
    assert build.returncode == 0, build.stderr[-3000:]
    dataset = ShardedDataset.open(out)
    splits = dataset.manifest["splits"]
    assert splits["validation"]["documents"] == 2
    assert splits["train"]["documents"] == trees["lib"]["files"]
    assert dataset.manifest["tokenizer"]["sha256"] == manifest["tokenizer"]["sha256"]
    report = json.loads((tmp_path / "data" / "quality_build_report.json").read_text())
    assert report["documents_by_root"]["heldout"]["split"] == "validation"
    assert report["splits"]["train"]["tokens"] == splits["train"]["tokens"] > 0

    # a damaged tarball is refused by name, before any build
    (carry / "lib.tar.xz").write_bytes(b"not xz")
    broken = subprocess.run([sys.executable, SCRIPT, "build", "--carry", str(carry), "--out",
                             str(tmp_path / "data2" / "q"), "--config", str(config)],
                            capture_output=True, text=True, env=env, cwd=ROOT, timeout=120,
                            check=False)
    assert broken.returncode == 2 and "lib.tar.xz: sha256 differs" in broken.stderr
    assert "Traceback" not in broken.stderr
