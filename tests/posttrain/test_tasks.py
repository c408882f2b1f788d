"""The generated task set: seeded, split without leakage, read by the evaluator, and checked
by the real verifier (g++ in the sandbox): references pass, wrong solutions fail."""

from __future__ import annotations

import json
from collections import defaultdict

import pytest

from megacpp.errors import MegaCppError
from megacpp.eval import Sample, Status, load_problem_set, verify_samples
from megacpp.eval.problems import default_problems_path
from megacpp.posttrain.common import PosttrainError, read_pairs
from megacpp.posttrain.tasks import FAMILY_NAMES, generate_tasks, write_task_set


def test_same_seed_same_files_other_seed_other_tests(tmp_path):
    a, b, c = (write_task_set(tmp_path / name, seed=seed) for name, seed in
               (("a", 0), ("b", 0), ("c", 1)))
    for name in ("train.jsonl", "heldout.jsonl", "train.sft.jsonl"):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes()
    assert a["files"] == b["files"] and a["files"] != c["files"]


def test_split_by_variant_without_leakage():
    tasks = generate_tasks(seed=0)
    by_family = defaultdict(lambda: defaultdict(set))
    for task in tasks:
        by_family[task.family][task.split].add(task.variant)
    assert set(by_family) == set(FAMILY_NAMES)
    for family, splits in by_family.items():
        assert splits["train"] and splits["heldout"], family
        assert not splits["train"] & splits["heldout"], family
    for field in ("task_id", "prompt", "declaration", "test", "canonical_solution"):
        train = {t.record[field] for t in tasks if t.split == "train"}
        heldout = {t.record[field] for t in tasks if t.split == "heldout"}
        assert not train & heldout, field
    # the held-out share is per family
    assert 0.15 < sum(t.split == "heldout" for t in tasks) / len(tasks) < 0.35


def test_bad_generation_options_are_errors():
    for kwargs, needle in [({"heldout_fraction": 1.0}, "held-out fraction"),
                           ({"per_family": 1}, "variants per family"),
                           ({"families": ("nope",)}, "unknown task family 'nope'")]:
        with pytest.raises(MegaCppError, match=needle):
            generate_tasks(**kwargs)


@pytest.fixture(scope="module")
def one_per_family(task_dir):
    """(held-out problem set, one held-out problem of each family)."""
    problem_set = load_problem_set(task_dir / "heldout.jsonl")
    first = {}
    for problem in problem_set.problems:
        first.setdefault(problem.task_id.split("/")[1], problem)
    return problem_set, list(first.values())


def test_the_evaluator_reads_the_set_with_its_suite(task_dir, one_per_family):
    problem_set, chosen = one_per_family
    assert problem_set.layout == "humanevalx" and len(chosen) == len(FAMILY_NAMES)
    assert problem_set.suite.source.endswith("heldout.suite.toml")
    assert problem_set.suite.libs == () and problem_set.suite.std == "c++17"
    train = load_problem_set(task_dir / "train.jsonl").problems
    sft = read_pairs(task_dir / "train.sft.jsonl")
    assert [p.prompt for p in sft] == [p.prompt for p in train]
    assert [p.completion for p in sft] == [p.canonical_solution for p in train]


def test_reference_solutions_pass_and_wrong_ones_fail(verifier, one_per_family, task_dir):
    """Each family's held-out reference passes under the real verifier; the body of another
    variant of the same family (a plausible wrong answer: the wrong parameter) fails its
    tests; a body that does not compile is a compile error."""
    _, chosen = one_per_family
    train = load_problem_set(task_dir / "train.jsonl").problems
    other = {}
    for problem in train:
        other.setdefault(problem.task_id.split("/")[1], problem)
    samples = []
    for i, problem in enumerate(chosen):
        family = problem.task_id.split("/")[1]
        samples.append(Sample(problem.task_id, 3 * i, problem.canonical_solution))
        samples.append(Sample(problem.task_id, 3 * i + 1, other[family].canonical_solution))
    samples.append(Sample(chosen[0].task_id, 999, "    return undefined_name;\n}\n"))
    results = verify_samples(verifier, chosen, samples, workers=2)
    statuses = [r.verdict.status for r in results]
    assert statuses[0:-1:2] == [Status.PASSED] * len(chosen)
    wrong = dict(zip((s.task_id for s in samples[1:-1:2]), statuses[1:-1:2]))
    assert all(status is Status.FAILED for status in wrong.values()), wrong
    assert statuses[-1] is Status.COMPILE_ERROR


def test_humaneval_x_never_feeds_training(tmp_path):
    record = json.loads(next(iter(_humaneval_lines())))
    data = tmp_path / "leak.jsonl"
    data.write_text(json.dumps({"prompt": "int f(){\n", "completion": "return 1;}\n"}) + "\n"
                    + json.dumps({"prompt": record["prompt"],
                                  "completion": record["canonical_solution"]}) + "\n")
    with pytest.raises(PosttrainError, match="record 2 is a HumanEval-X prompt"):
        read_pairs(data)


def _humaneval_lines():
    import gzip

    with gzip.open(default_problems_path(), "rt", encoding="utf-8") as f:
        yield from f
