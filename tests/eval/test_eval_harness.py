"""The pass@k driver with a real (deterministic) generator, its outputs and its receipt."""

from __future__ import annotations

import json

import pytest

from megacpp.errors import MegaCppError
from megacpp.eval import (
    Sample,
    SamplingSettings,
    Status,
    evaluate_generator,
    evaluate_samples,
    humaneval_build_options,
    read_samples,
    verify_samples,
)
from megacpp.eval.harness import RECEIPT_FILE, SAMPLES_FILE, SUMMARY_FILE
from megacpp.receipts import read_receipt, verify_artifacts
from tests.eval.conftest import make_verifier

TASKS = ["CPP/0", "CPP/2", "CPP/13", "CPP/162"]
CORRECT_PER_TASK = {"CPP/0": 3, "CPP/2": 2, "CPP/13": 0, "CPP/162": 1}  # of n = 3
WRONG = "throw 1;\n}"  # compiles for any signature, fails every test


class ScriptedGenerator:
    """A deterministic generator: the first ``correct[task]`` samples of a problem are its
    canonical solution, the rest a wrong one. Records how it was called."""

    def __init__(self, problems, correct):
        self.by_prompt = {p.prompt: (p, correct[p.task_id]) for p in problems}
        self.calls = []

    def __call__(self, prompts, n, temperature, **options):
        self.calls.append({"prompts": len(prompts), "n": n, "temperature": temperature, **options})
        samples = []
        for prompt in prompts:
            problem, correct = self.by_prompt[prompt]
            samples.append([problem.canonical_solution if i < correct else WRONG for i in range(n)])
        return samples


@pytest.fixture(scope="module")
def humaneval_verifier():
    return make_verifier(**vars(humaneval_build_options(pch=False, linker=None)))


@pytest.fixture(scope="module")
def selected(problems_by_id):
    return [problems_by_id[task] for task in TASKS]


def test_pass_at_k_from_a_generator(selected, humaneval_verifier, tmp_path):
    generate = ScriptedGenerator(selected, CORRECT_PER_TASK)
    sampling = SamplingSettings(n=3, temperature=0.8, top_p=0.95, seed=7)
    report = evaluate_generator(generate, selected, sampling, verifier=humaneval_verifier,
                                out_dir=tmp_path, model={"name": "scripted", "step": 0},
                                ks=(1, 2, 10), workers=2)
    assert generate.calls == [{"prompts": 4, "n": 3, "temperature": 0.8, "top_p": 0.95, "seed": 7}]
    assert report.counts == {task: (3, c) for task, c in CORRECT_PER_TASK.items()}
    assert set(report.pass_at_k) == {1, 2}  # k=10 > n=3 has no unbiased estimate
    assert report.pass_at_k[1] == pytest.approx((1 + 2 / 3 + 0 + 1 / 3) / 4)
    assert report.pass_at_k[2] == pytest.approx((1 + 1 + 0 + 2 / 3) / 4)
    assert report.status_counts == {"passed": 6, "failed": 6}  # `throw 1` escapes main

    lines = [json.loads(line) for line in (tmp_path / SAMPLES_FILE).read_text().splitlines()]
    assert [(r["task_id"], r["sample"]) for r in lines] == [(t, i) for t in TASKS for i in range(3)]
    assert lines[3]["completion"] == lines[4]["completion"] != WRONG  # CPP/2, both canonical
    assert lines[5]["status"] == "failed" and "terminate" in lines[5]["stderr"]
    assert lines[5]["detail"] == "uncaught exception of type int"

    summary = json.loads((tmp_path / SUMMARY_FILE).read_text())
    assert summary["pass_at_k"] == {"pass@1": report.pass_at_k[1], "pass@2": report.pass_at_k[2]}
    assert summary["sampling"]["temperature"] == 0.8 and summary["build"]["libs"] == ["crypto"]

    receipt = read_receipt(tmp_path / RECEIPT_FILE)
    assert receipt.kind == "eval"
    assert receipt.metrics["pass@1"] == pytest.approx(report.pass_at_k[1])
    assert receipt.config["model"] == {"name": "scripted", "step": 0}
    assert receipt.config["sampling"]["seed"] == 7
    assert receipt.config["isolation"] == "namespaces"
    sandbox = receipt.config["sandbox"]  # which guarantees were in force
    assert sandbox["seccomp"] is humaneval_verifier.sandbox.seccomp
    assert sandbox["run_memory_bound"] == humaneval_verifier.sandbox.memory_bound(
        humaneval_verifier.run_limits)
    assert sandbox["run_memory_bound"] == lines[0]["memory_bound"]
    assert set(verify_artifacts(receipt, tmp_path / RECEIPT_FILE).values()) == {"ok"}


@pytest.mark.parametrize("returned", [
    [["x"]] * 3,  # one list short
    [["x", "y"]] * 4,  # n=2 instead of 3
    [["x", "y", 3]] * 4,  # not strings
    "not a list",
])
def test_malformed_generator_output_is_refused(selected, humaneval_verifier, tmp_path, returned):
    with pytest.raises(MegaCppError, match="generator"):
        evaluate_generator(lambda prompts, n, temperature: returned, selected,
                           SamplingSettings(n=3, temperature=0.0), verifier=humaneval_verifier,
                           out_dir=tmp_path, model={})
    assert not (tmp_path / SAMPLES_FILE).exists()


def test_results_keep_input_order_and_unknown_tasks_are_refused(selected, humaneval_verifier):
    samples = [Sample(p.task_id, 0, completion) for p in selected[:2]
               for completion in ("garbage(", p.canonical_solution)]
    results = verify_samples(humaneval_verifier, selected, samples, workers=2)
    assert [r.sample for r in results] == samples
    assert [r.verdict.status for r in results] == [Status.COMPILE_ERROR, Status.PASSED] * 2
    with pytest.raises(MegaCppError, match="CPP/999"):
        verify_samples(humaneval_verifier, selected, [Sample("CPP/999", 0, "}")], workers=1)
    with pytest.raises(MegaCppError, match="workers"):
        verify_samples(humaneval_verifier, selected, samples, workers=0)


def test_samples_from_a_file(selected, humaneval_verifier, tmp_path):
    path = tmp_path / "completions.jsonl"
    path.write_text("\n".join(json.dumps({"task_id": t, "completion": c}) for t, c in [
        ("CPP/0", selected[0].canonical_solution), ("CPP/0", WRONG), ("CPP/2", WRONG),
        ("CPP/2", selected[1].canonical_solution)]) + "\n")
    samples = read_samples(path)
    assert [(s.task_id, s.index) for s in samples] == [("CPP/0", 0), ("CPP/0", 1), ("CPP/2", 0),
                                                       ("CPP/2", 1)]
    report = evaluate_samples(selected, samples, verifier=humaneval_verifier,
                              out_dir=tmp_path / "out", model={"name": "file"},
                              sampling={"n": 2}, ks=(1,), workers=2)
    assert report.pass_at_k == {1: 0.5}


@pytest.mark.parametrize(("content", "message"), [
    ("{broken\n", ":1: not valid JSON"),
    ('{"task_id": "CPP/0"}\n', "task_id and completion"),
    ("\n\n", "no samples"),
])
def test_bad_sample_files_are_refused(tmp_path, content, message):
    path = tmp_path / "samples.jsonl"
    path.write_text(content)
    with pytest.raises(MegaCppError, match=message):
        read_samples(path)
    with pytest.raises(MegaCppError, match="does not exist"):
        read_samples(tmp_path / "absent.jsonl")


def test_sampling_settings_are_validated():
    with pytest.raises(MegaCppError, match="samples per problem"):
        SamplingSettings(n=0, temperature=1.0)
    with pytest.raises(MegaCppError, match="temperature"):
        SamplingSettings(n=1, temperature=-0.1)
    assert SamplingSettings(n=2, temperature=0.2, max_new_tokens=64).options() == {
        "max_new_tokens": 64}
