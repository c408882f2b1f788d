"""Receipts: write, read back, validate corrupt input, compare, refuse drift, golden."""

from __future__ import annotations

import copy
import json
import subprocess
from pathlib import Path

import pytest

from megacpp.contract import PreflightInputs, capture_fingerprint, run_rules
from megacpp.errors import MegaCppError
from megacpp.receipts import (
    DriftError,
    ReceiptError,
    compare_receipts,
    golden_problems,
    mark_golden,
    read_receipt,
    verify_artifacts,
    write_receipt,
)
from tests.contract.evidence_facts import gb10

CONFIG = {"model": {"pattern": "AEMEAEMEAEMR", "d_model": 256}, "train": {"lr": 3e-4}}


@pytest.fixture(scope="module")
def fingerprint():
    return capture_fingerprint()


def _write(path: Path, fingerprint, metrics=None, **kwargs):
    return write_receipt(
        path,
        "bench",
        CONFIG,
        metrics or {"tokens_per_s": 1000.0, "loss": 2.5},
        fingerprint=copy.deepcopy(fingerprint),
        **kwargs,
    )


def test_round_trip_keeps_every_field(tmp_path: Path, fingerprint):
    artifact = tmp_path / "ckpt.bin"
    artifact.write_bytes(b"weights")
    report = run_rules(PreflightInputs(gb10(fingerprint)), skip=["triton-ptxas-arch"])
    written = _write(
        tmp_path / "r.json",
        fingerprint,
        artifacts=[artifact],
        kernels={"attention": "sdpa", "mamba3": "reference"},
        preflight=report,
    )
    read = read_receipt(tmp_path / "r.json")
    assert read == written
    assert read.kind == "bench" and read.metrics["tokens_per_s"] == 1000.0
    assert read.preflight_skipped == ["triton-ptxas-arch"]
    assert read.artifacts[0].path == "ckpt.bin" and read.artifacts[0].bytes == 7
    assert read.full_fingerprint["git"] == fingerprint["git"]
    assert "git" not in read.fingerprint  # stored once, at the top level
    assert verify_artifacts(read, tmp_path / "r.json") == {"ckpt.bin": "ok"}
    artifact.write_bytes(b"WEIGHTS")
    assert verify_artifacts(read, tmp_path / "r.json") == {"ckpt.bin": "modified"}
    artifact.unlink()
    assert verify_artifacts(read, tmp_path / "r.json") == {"ckpt.bin": "missing"}


def test_patches_in_effect_are_recorded(tmp_path: Path, fingerprint):
    from megacpp.contract.patches import apply_patch

    applied = apply_patch("inductor-big-gpu", gb10(fingerprint))
    try:
        receipt = write_receipt(tmp_path / "p.json", "train", CONFIG, {"loss": 1.0})
    finally:
        applied.revert()
    assert [p["name"] for p in read_receipt(tmp_path / "p.json").patches] == ["inductor-big-gpu"]
    assert receipt.patches[0]["target"] == "torch._inductor.utils.is_big_gpu"


def test_invalid_values_are_refused_before_writing(tmp_path: Path, fingerprint):
    with pytest.raises(ReceiptError, match="kind 'training'"):
        write_receipt(tmp_path / "x.json", "training", CONFIG, {}, fingerprint=fingerprint)
    with pytest.raises(ReceiptError, match="finite"):
        _write(tmp_path / "x.json", fingerprint, metrics={"loss": float("nan")})
    with pytest.raises(ReceiptError, match="artifact .* does not exist"):
        _write(tmp_path / "x.json", fingerprint, artifacts=[tmp_path / "nope"])
    assert not (tmp_path / "x.json").exists()


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda text, data: text[: len(text) // 2], "not valid JSON.*truncated"),
        (lambda text, data: "[1, 2]", "receipt is a JSON object"),
        (lambda text, data: json.dumps({**data, "schema_version": 2}), "schema_version 2"),
        (lambda text, data: json.dumps({**data, "schema": "other"}), "not a megacpp receipt"),
        (
            lambda text, data: json.dumps({k: v for k, v in data.items() if k != "metrics"}),
            "missing field.*metrics",
        ),
        (lambda text, data: json.dumps({**data, "metrics": {"loss": "low"}}), "must be a number"),
        (lambda text, data: json.dumps({**data, "kind": "vibes"}), "kind 'vibes'"),
        (lambda text, data: json.dumps({**data, "config": {"edited": True}}), "edited after"),
        (lambda text, data: json.dumps({**data, "golden": "yes"}), "'golden' has type str"),
        (lambda text, data: json.dumps({**data, "artifacts": [{"path": 1}]}), "needs path"),
    ],
)
def test_corrupt_receipts_fail_with_one_clear_error(tmp_path: Path, fingerprint, mutate, message):
    path = tmp_path / "r.json"
    _write(path, fingerprint)
    text = path.read_text()
    path.write_text(mutate(text, json.loads(text)))
    with pytest.raises(ReceiptError, match=message):
        read_receipt(path)


def test_missing_receipt_file(tmp_path: Path):
    with pytest.raises(ReceiptError, match="does not exist"):
        read_receipt(tmp_path / "absent.json")


def test_compare_same_environment_gives_ratios(tmp_path: Path, fingerprint):
    a = _write(tmp_path / "a.json", fingerprint, metrics={"tokens_per_s": 1000.0, "loss": 2.0})
    b = _write(
        tmp_path / "b.json",
        fingerprint,
        metrics={"tokens_per_s": 1250.0, "loss": 1.0},
        kernels={"attention": "triton"},
    )
    comparison = compare_receipts(a, b)
    ratios = {row.name: row.ratio for row in comparison.rows}
    assert ratios == {"loss": 0.5, "tokens_per_s": 1.25} and comparison.drift == []
    assert any("kernel backends differ" in note for note in comparison.notes)
    (only,) = compare_receipts(a, b, metric="tokens_per_s").rows
    assert only.name == "tokens_per_s"
    with pytest.raises(MegaCppError, match="metric 'mfu' is not in receipt A and B"):
        compare_receipts(a, b, metric="mfu")


def test_compare_notes_declared_source_commits(tmp_path: Path, fingerprint):
    """Copies run elsewhere (stale .git) differ by the commit they declare, not by git's sha."""
    declared = []
    for name, commit in (("a", "99f80a6"), ("b", "ada1e31")):
        fp = copy.deepcopy(fingerprint)
        fp["git"] = {**(fp["git"] or {}), "declared_commit": commit}
        declared.append(_write(tmp_path / f"{name}.json", fp))
    notes = compare_receipts(*declared).notes
    assert "declared source commits differ: 99f80a6 -> ada1e31" in notes
    assert read_receipt(tmp_path / "a.json").git["declared_commit"] == "99f80a6"
    same = compare_receipts(declared[0], declared[0]).notes
    assert not any("declared" in note for note in same)


def test_compare_refuses_drift_unless_allowed(tmp_path: Path, fingerprint):
    drifted = copy.deepcopy(fingerprint)
    drifted["packages"]["torch"] = "2.99.0"
    a = _write(tmp_path / "a.json", fingerprint)
    b = _write(tmp_path / "b.json", drifted)
    with pytest.raises(DriftError, match="packages.torch") as refused:
        compare_receipts(a, b)
    assert refused.value.exit_code == 1
    allowed = compare_receipts(a, b, allow_drift=True)
    assert allowed.drift_allowed and [d.field for d in allowed.drift] == ["packages.torch"]
    assert allowed.to_dict()["drift_allowed"] is True
    train = write_receipt(
        tmp_path / "t.json", "train", CONFIG, {"loss": 1.0}, fingerprint=fingerprint
    )
    with pytest.raises(MegaCppError, match="cannot compare a bench receipt with a train"):
        compare_receipts(a, train)


def _clean_repo(tmp_path: Path) -> Path:
    repo = tmp_path / "project"
    repo.mkdir()
    (repo / "train.py").write_text("print('hi')\n")
    for args in (("init", "-q"), ("add", ".")):
        subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True)
    subprocess.run(
        [
            "git",
            "-C",
            str(repo),
            "-c",
            "user.name=t",
            "-c",
            "user.email=t@t",
            "commit",
            "-qm",
            "init",
        ],
        check=True,
        capture_output=True,
    )
    return repo


def test_golden_needs_a_clean_tree_and_verified_packages(tmp_path: Path):
    repo = _clean_repo(tmp_path)
    (repo / "train.py").write_text("print('edited')\n")
    dirty = capture_fingerprint(packages=["tokenizers"], project_root=repo)
    with pytest.raises(ReceiptError, match="uncommitted changes"):
        write_receipt(
            tmp_path / "g.json", "eval", CONFIG, {"pass_at_1": 0.3}, fingerprint=dirty, golden=True
        )
    subprocess.run(["git", "-C", str(repo), "checkout", "-q", "--", "train.py"], check=True)
    clean = capture_fingerprint(packages=["tokenizers"], project_root=repo)
    no_repo = {**clean, "git": None}
    assert "no git commit" in golden_problems(no_repo)[0]
    receipt = write_receipt(
        tmp_path / "g.json", "eval", CONFIG, {"pass_at_1": 0.3}, fingerprint=clean, golden=True
    )
    assert receipt.golden and read_receipt(tmp_path / "g.json").golden


def test_mark_golden_from_the_producing_environment_only(tmp_path: Path):
    repo = _clean_repo(tmp_path)
    path = tmp_path / "r.json"
    write_receipt(
        path, "bench", CONFIG, {"tokens_per_s": 1.0}, packages=["tokenizers"], project_root=repo
    )
    assert mark_golden(path, project_root=repo).golden and read_receipt(path).golden

    other = tmp_path / "other.json"
    drifted = capture_fingerprint(packages=["tokenizers"], project_root=repo)
    drifted["packages"]["tokenizers"] = "0.0.1"
    write_receipt(other, "bench", CONFIG, {"tokens_per_s": 1.0}, fingerprint=drifted)
    with pytest.raises(ReceiptError, match="packages.tokenizers"):
        mark_golden(other, project_root=repo)
    assert not read_receipt(other).golden
