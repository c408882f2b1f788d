"""`megacpp generate` and `megacpp eval humaneval-x` on a real (tiny) trained checkpoint."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.train.helpers import LIBSTDCXX, build_dataset, megacpp, run_config, write_config


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    if not (LIBSTDCXX / "utility").is_file():
        pytest.skip(f"needs the libstdc++ headers in {LIBSTDCXX}")
    tmp = tmp_path_factory.mktemp("gen")
    config = run_config(build_dataset(tmp), tmp / "run", train={"steps": 2, "eval_every": 2},
                        checkpoint={"every": 2, "keep_last": 1})
    megacpp("train", "--config", str(write_config(tmp / "run.toml", config)), "--no-progress")
    return tmp / "run"


def test_generate_json_is_seeded_and_reproducible(run_dir):
    args = ("generate", "--checkpoint", str(run_dir), "--prompt", "int f(int x) {\n", "--n", "2",
            "--max-new-tokens", "8", "--seed", "3", "--json")
    first = [json.loads(line) for line in megacpp(*args).stdout.splitlines()]
    again = [json.loads(line) for line in megacpp(*args).stdout.splitlines()]
    assert len(first) == 2 and first == again
    assert all(r["finish_reason"] in {"length", "eos", "stop"} and r["tokens"] <= 8 for r in first)
    assert first[0]["checkpoint"].endswith("checkpoints/step_000002")


def test_generate_bad_input_is_one_line(run_dir, tmp_path):
    for args, needle in [
        (("--checkpoint", str(tmp_path / "missing"), "--prompt", "x"), "not found"),
        (("--checkpoint", str(tmp_path), "--prompt", "x"), "neither a run directory"),
        (("--checkpoint", str(run_dir)), "exactly one of --prompt"),
        (("--checkpoint", str(run_dir), "--prompt", "x", "--temperature", "-1"), "temperature"),
        (("--checkpoint", str(run_dir), "--prompt", "x", "--temperature", "0",
          "--speculative-tokens", "2"),
         "--speculative-tokens 2 needs a model with multi-token-prediction heads"),
        (("--checkpoint", str(run_dir), "--prompt", "x", "--speculative-tokens", "2"),
         "drafts for greedy decoding only"),
    ]:
        out = megacpp("generate", *args, check=False)
        assert out.returncode == 2 and needle in out.stderr and "Traceback" not in out.stderr


def test_humaneval_x_scores_a_checkpoint_and_writes_a_receipt(run_dir, tmp_path):
    out = tmp_path / "he"
    megacpp("eval", "humaneval-x", "--checkpoint", str(run_dir), "--out", str(out), "--n", "2",
            "--limit", "2", "--max-new-tokens", "16", "--seed", "0", "--workers", "1")
    samples = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    assert len(samples) == 4 and {s["task_id"] for s in samples} == {"CPP/0", "CPP/1"}
    summary = json.loads((out / "summary.json").read_text())
    assert 0.0 <= summary["pass_at_k"]["pass@1"] <= 1.0
    assert summary["model"]["checkpoint"].endswith("step_000002")
    assert summary["problems"]["sha256"] and summary["problems"]["evaluated"] == 2
    receipt = json.loads((out / "receipt.json").read_text())
    assert receipt["kind"] == "eval" and "checkpoint" in json.dumps(receipt["config"])
    # the kernel backends the sampler ran (CPU: the references; MEGACPP_KERNELS unset)
    assert receipt["kernels"]["rmsnorm"] == "reference"


def test_humaneval_x_samples_a_multipl_e_set(run_dir, tmp_path):
    """Any problem set: MultiPL-E's names are the task ids, its suite's build is recorded."""
    from tests.eval.problem_sets import MULTIPL_E, write_jsonl

    problems = write_jsonl(tmp_path / "humaneval-cpp.jsonl", MULTIPL_E)
    out = tmp_path / "mpe"
    megacpp("eval", "humaneval-x", "--checkpoint", str(run_dir), "--out", str(out), "--n", "1",
            "--problems", str(problems), "--max-new-tokens", "8", "--seed", "0", "--workers", "1",
            "--no-pch")
    samples = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    assert [s["task_id"] for s in samples] == ["HumanEval_0_add", "HumanEval_1_sum_vector"]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["build"]["libs"] == [] and summary["problems"]["available"] == 2
