"""`megacpp quickstart` end to end on a small source tree (few steps: the full default run
takes minutes and is what the README's first command does)."""

from __future__ import annotations

import json
import shutil

import pytest

from tests.train.helpers import HEADERS, LIBSTDCXX, megacpp


def test_quickstart_builds_trains_samples_and_reports(tmp_path):
    if not (LIBSTDCXX / "utility").is_file():
        pytest.skip(f"needs the libstdc++ headers in {LIBSTDCXX}")
    src = tmp_path / "src"
    for rel in HEADERS:
        dst = src / (rel.replace("/", "_") + ("" if "." in rel else ".h"))
        dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(LIBSTDCXX / rel, dst)
    out = megacpp("quickstart", "--out", str(tmp_path / "qs"), "--source", str(src),
                  "--steps", "4", "--threads", "1", timeout=600)
    text = out.stdout
    for needle in ("1. corpus", "loss falling", "3. sampling", "unigram entropy", "receipt"):
        assert needle in text, needle
    runs = list((tmp_path / "qs").glob("run-*"))
    assert len(runs) == 1
    receipt = json.loads((runs[0] / "receipt.json").read_text())
    assert receipt["kind"] == "train" and receipt["metrics"]["completed"] == 1
    assert (runs[0] / "plots" / "loss.png").stat().st_size > 0
    # a second run reuses the corpus and starts a fresh run directory (nothing overwritten)
    again = megacpp("quickstart", "--out", str(tmp_path / "qs"), "--source", str(src),
                    "--steps", "2", "--threads", "1", timeout=600)
    assert "reusing the corpus" in again.stdout
    assert len(list((tmp_path / "qs").glob("run-*"))) == 2
