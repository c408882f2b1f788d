"""``megacpp posttrain``: tasks, sft and grpo through the real CLI; misuse is one error line
and exit status 2."""

from __future__ import annotations

import json

import pytest

from tests.cli.test_cli_consistency import assert_one_error_line, run_cli
from tests.train.helpers import megacpp


def refused(*args: str) -> str:
    """``megacpp posttrain ARGS`` in this process: one error line, exit 2; the line."""
    code, _, err = run_cli("posttrain", *args)
    assert_one_error_line(code, err, args)
    return err.strip()


def test_tasks_writes_the_set(tmp_path):
    out = tmp_path / "tasks"
    result = megacpp("posttrain", "tasks", "--out", str(out), "--per-family", "3",
                     "--family", "caesar", "--family", "fib_mod")
    assert "wrote 4 train and 2 held-out problems from 2 families" in result.stdout
    manifest = json.loads((out / "manifest.json").read_text())
    assert set(manifest["families"]) == {"caesar", "fib_mod"}
    assert sorted(p.name for p in out.iterdir()) == [
        "heldout.jsonl", "heldout.suite.toml", "manifest.json", "train.jsonl",
        "train.sft.jsonl", "train.suite.toml"]


@pytest.mark.parametrize("args,needle", [
    (("tasks", "--out", "{tmp}/t", "--family", "nope"), "unknown task family 'nope'"),
    (("tasks", "--out", "{tmp}/t", "--heldout-fraction", "0"), "held-out fraction 0.0"),
    (("sft", "--base", "{tmp}", "--data", "{tmp}/missing.jsonl", "--out", "{tmp}/o"),
     "training data not found"),
    (("sft", "--base", "{tmp}", "--data", "{tmp}/bad.jsonl", "--out", "{tmp}/o"),
     "each line needs string fields prompt and completion"),
    (("sft", "--base", "{tmp}", "--data", "{tmp}/bad.jsonl", "--out", "{tmp}/o",
      "--steps", "0"), "--steps 0"),
    (("sft", "--base", "{tmp}", "--data", "{tmp}/bad.jsonl", "--out", "{tmp}/o",
      "--lora-r", "-1"), "--lora-r -1"),
    (("grpo", "--base", "{tmp}", "--train", "{tmp}/missing.jsonl", "--out", "{tmp}/o"),
     "problem file not found"),
    (("grpo", "--base", "{tmp}", "--train", "{tmp}/bad.jsonl", "--out", "{tmp}/o",
      "--group-size", "1"), "--group-size 1"),
    (("grpo", "--base", "{tmp}", "--train", "{tmp}/bad.jsonl", "--out", "{tmp}/o",
      "--kl-coef", "-1"), "--kl-coef -1"),
    (("grpo", "--base", "{tmp}", "--train", "{tmp}/bad.jsonl", "--out", "{tmp}/o",
      "--eval-samples", "0"), "--eval-samples 0: expected >= 1"),
    (("grpo", "--base", "{tmp}", "--train", "{tmp}/bad.jsonl", "--out", "{tmp}/o",
      "--eval-samples", "8", "--eval-temperature", "0"), "--eval-temperature 0.0"),
    (("grpo", "--out", "{tmp}/o"), "Missing option"),
])
def test_misuse_is_one_error_line(tmp_path, args, needle):
    (tmp_path / "bad.jsonl").write_text('{"prompt": 1}\n')
    line = refused(*(a.format(tmp=tmp_path) for a in args))
    assert needle in line, line


@pytest.mark.slow
def test_sft_and_grpo_run_from_the_cli(base_dir, task_dir, tmp_path):
    """A 3-step LoRA SFT, then a 1-step GRPO from its model, on two tasks (real g++), with
    a sampled held-out evaluation of one problem."""
    data = tmp_path / "two.sft.jsonl"
    data.write_text("".join((task_dir / "train.sft.jsonl").read_text().splitlines(True)[:2]))
    train = tmp_path / "two.jsonl"
    train.write_text("".join((task_dir / "train.jsonl").read_text().splitlines(True)[:2]))
    (tmp_path / "two.suite.toml").write_text((task_dir / "train.suite.toml").read_text())
    heldout = tmp_path / "one.jsonl"
    heldout.write_text((task_dir / "heldout.jsonl").read_text().splitlines(True)[0])
    (tmp_path / "one.suite.toml").write_text((task_dir / "heldout.suite.toml").read_text())
    sft = megacpp("posttrain", "sft", "--base", str(base_dir), "--data", str(data), "--out",
                  str(tmp_path / "sft"), "--steps", "3", "--batch-size", "2", "--lora-r", "4",
                  "--device", "cpu", "--no-progress")
    assert "in 3 steps" in sft.stdout
    grpo = megacpp("posttrain", "grpo", "--base", str(tmp_path / "sft" / "model"), "--train",
                   str(train), "--out", str(tmp_path / "grpo"), "--steps", "1",
                   "--tasks-per-step", "2", "--group-size", "2", "--max-new-tokens", "8",
                   "--workers", "2", "--device", "cpu", "--no-progress", "--heldout",
                   str(heldout), "--eval-samples", "2", "--eval-temperature", "0.7")
    assert '"steps": 1.0' in grpo.stdout
    assert "step 0: held-out pass@1" in grpo.stdout and "(greedy " in grpo.stdout
    records = [json.loads(line) for line in
               (tmp_path / "grpo" / "metrics.jsonl").read_text().splitlines()]
    assert [r["kind"] for r in records] == ["eval", "train", "eval"]
    assert records[1]["kl"] == 0.0
    assert set(records[0]) >= {"heldout_pass@1", "heldout_pass@1_stderr",
                               "heldout_greedy_pass@1"}
