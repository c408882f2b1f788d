"""HumanEval-X reference solutions pass; wrong solutions (mutants) fail."""

from __future__ import annotations

import pytest

from megacpp.eval import (
    Sample,
    Status,
    all_mutants,
    humaneval_build_options,
    mutants,
    reference_samples,
    verify_samples,
)
from megacpp.eval.problems import check_humaneval_toolchain
from tests.eval.conftest import make_verifier

# Boost (22, 137), OpenSSL MD5 (162), prompts that end inside the body (10, 32, 38, 50), and
# a spread of the rest.
SUBSET = ["CPP/0", "CPP/1", "CPP/10", "CPP/22", "CPP/32", "CPP/38", "CPP/50", "CPP/64",
          "CPP/81", "CPP/95", "CPP/107", "CPP/119", "CPP/129", "CPP/137", "CPP/141",
          "CPP/150", "CPP/155", "CPP/160", "CPP/162", "CPP/163"]


@pytest.fixture(scope="module")
def plain_verifier():
    """No precompiled headers: in a fresh CI cache, building them costs more than it saves."""
    return make_verifier(**vars(humaneval_build_options(pch=False)))


def test_the_toolchain_has_boost_and_openssl(plain_verifier):
    check_humaneval_toolchain(plain_verifier)


def test_reference_solutions_of_a_subset_pass(problems_by_id, plain_verifier):
    selected = [problems_by_id[task] for task in SUBSET]
    results = verify_samples(plain_verifier, selected, reference_samples(selected), workers=2)
    failures = {r.sample.task_id: (r.verdict.status, r.verdict.detail) for r in results
                if not r.verdict.passed}
    assert failures == {}


@pytest.mark.slow
def test_all_164_reference_solutions_pass_with_the_cli_defaults(problems):
    verifier = make_verifier(**vars(humaneval_build_options()))  # precompiled headers, gold
    results = verify_samples(verifier, problems, reference_samples(problems), workers=2)
    failures = {r.sample.task_id: (r.verdict.status, r.verdict.detail) for r in results
                if not r.verdict.passed}
    assert len(results) == 164 and failures == {}


def test_mutants_change_exactly_one_token(problems_by_id):
    problem = problems_by_id["CPP/2"]  # return number - int(number);
    [mutant] = mutants(problem, per_problem=1)
    assert mutant.completion == problem.canonical_solution.replace("-", "+", 1)
    assert "'-' -> '+'" in mutant.description
    assert len(mutants(problem, per_problem=50)) < 50  # only what the solution offers


def test_wrong_solutions_fail(problems_by_id, plain_verifier):
    selected = [problems_by_id[f"CPP/{i}"] for i in (2, 3, 4, 12, 23, 27, 45, 53)]
    found = all_mutants(selected, per_problem=2)
    samples = [Sample(m.task_id, i, m.completion) for i, m in enumerate(found)]
    results = verify_samples(plain_verifier, selected, samples, workers=2)
    killed = [r for r in results if not r.verdict.passed]
    assert len(killed) / len(results) >= 0.8, [m.description for m, r in zip(found, results)
                                               if r.verdict.passed]
    # a wrong answer is reported as a failed assertion of the hidden tests
    assert any(r.verdict.status is Status.FAILED and "assertion failed" in r.verdict.detail
               for r in killed)
