"""megacpp.eval: verifier-first C++ evaluation.

A completion counts only if it compiles and its tests pass inside a sandbox that hostile or
broken code cannot escape.

- :class:`Sandbox` / :class:`Limits` -- run one command in isolation (``sandbox.py``, ``jail.c``);
- :class:`CppVerifier` / :class:`BuildOptions` -- compile + run a program, return a :class:`Verdict`;
- :func:`load_problem_set` / :class:`Problem` -- C++ problem sets (HumanEval-X, MultiPL-E,
  MBXP layouts); :class:`SuiteConfig` -- a set's standard, flags and libraries;
- :func:`evaluate_generator` / :func:`evaluate_samples` -- pass@k with results and a receipt;
- :func:`pass_at_k` -- the unbiased estimator; :func:`mutants` -- the mutation check.
"""

from megacpp.eval.cpp import BuildOptions, CppVerifier, leading_system_includes
from megacpp.eval.harness import (
    EvalReport,
    Generator,
    Sample,
    SampleResult,
    SamplingSettings,
    evaluate_generator,
    evaluate_samples,
    read_samples,
    reference_samples,
    verify_samples,
)
from megacpp.eval.launcher import SandboxError
from megacpp.eval.mutations import Mutant, all_mutants, mutants
from megacpp.eval.passk import DEFAULT_KS, mean_pass_at_k, pass_at_k
from megacpp.eval.problems import (
    Problem,
    ProblemSet,
    ProblemSetError,
    humaneval_build_options,
    load_problem_set,
    load_problems,
    locate_problems,
    select_problems,
)
from megacpp.eval.sandbox import Execution, Isolation, Limits, Mount, Sandbox
from megacpp.eval.suite import FORMATS, SuiteConfig, SuiteConfigError
from megacpp.eval.verdict import Status, Verdict

__all__ = [
    "DEFAULT_KS", "FORMATS", "BuildOptions", "CppVerifier", "EvalReport", "Execution",
    "Generator", "Isolation", "Limits", "Mount", "Mutant", "Problem", "ProblemSet",
    "ProblemSetError", "Sample", "SampleResult", "SamplingSettings", "Sandbox", "SandboxError",
    "Status", "SuiteConfig", "SuiteConfigError", "Verdict", "all_mutants", "evaluate_generator",
    "evaluate_samples", "humaneval_build_options", "leading_system_includes", "load_problem_set",
    "load_problems", "locate_problems", "mean_pass_at_k", "mutants",
    "pass_at_k", "read_samples", "reference_samples", "select_problems", "verify_samples",
]
