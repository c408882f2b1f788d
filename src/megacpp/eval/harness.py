"""Verify many programs in parallel and turn the verdicts into pass@k with evidence.

A *generator* is any callable ``generate(prompts, n, temperature, **options) ->
list[list[str]]`` returning n completions per prompt (the model's sampler plugs in here).
:func:`evaluate_generator` calls it once and hands the completions to
:func:`evaluate_samples`, which also serves completions read from a JSONL file. Outputs in
``out_dir``: ``samples.jsonl`` (one verdict per sample), ``summary.json`` and
``receipt.json`` (kind ``eval``: model, sampling settings, build, limits, environment).
"""

from __future__ import annotations

import json
import os
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol

from megacpp._io import (
    LOG_LIMIT,
    atomic_write_json,
    atomic_write_text,
    parse_json,
    read_text_bounded,
    sha256_file,
)
from megacpp.errors import MegaCppError
from megacpp.eval.cpp import CppVerifier
from megacpp.eval.passk import DEFAULT_KS, mean_pass_at_k
from megacpp.eval.problems import Problem
from megacpp.eval.verdict import Verdict
from megacpp.receipts import write_receipt

SAMPLES_FILE = "samples.jsonl"
SUMMARY_FILE = "summary.json"
RECEIPT_FILE = "receipt.json"


class Generator(Protocol):
    """Returns ``n`` completions for each prompt, in prompt order."""

    def __call__(self, prompts: list[str], n: int, temperature: float,
                 **options: Any) -> list[list[str]]: ...


@dataclass(frozen=True)
class SamplingSettings:
    n: int
    temperature: float
    top_p: float | None = None
    max_new_tokens: int | None = None
    seed: int | None = None

    def __post_init__(self) -> None:
        if self.n < 1:
            raise MegaCppError(f"samples per problem must be >= 1, got {self.n}")
        if self.temperature < 0:
            raise MegaCppError(f"temperature must be >= 0, got {self.temperature}")

    def options(self) -> dict[str, Any]:
        """The settings passed to the generator as keyword options (only those set)."""
        extra = {"top_p": self.top_p, "max_new_tokens": self.max_new_tokens, "seed": self.seed}
        return {key: value for key, value in extra.items() if value is not None}


@dataclass(frozen=True)
class Sample:
    task_id: str
    index: int  # the sample's number within its problem
    completion: str


@dataclass(frozen=True)
class SampleResult:
    sample: Sample
    verdict: Verdict

    def to_json(self) -> dict[str, Any]:
        return {"task_id": self.sample.task_id, "sample": self.sample.index,
                **self.verdict.to_json(), "completion": self.sample.completion}


@dataclass
class EvalReport:
    results: list[SampleResult]  # in sample order
    pass_at_k: dict[int, float]
    counts: dict[str, tuple[int, int]]  # task_id -> (samples, passed)
    status_counts: dict[str, int]
    wall_s: float
    out_dir: Path
    files: dict[str, Path] = field(default_factory=dict)


def verify_samples(
    verifier: CppVerifier,
    problems: Sequence[Problem],
    samples: Sequence[Sample],
    *,
    workers: int,
    on_result: Callable[[SampleResult], None] | None = None,
) -> list[SampleResult]:
    """Compile and run every sample's program on ``workers`` threads; results in input order.

    A sandbox failure (not a verdict) stops the whole batch and is raised.
    """
    if workers < 1:
        raise MegaCppError(f"workers must be >= 1, got {workers}")
    by_id = {problem.task_id: problem for problem in problems}
    unknown = sorted({s.task_id for s in samples} - by_id.keys())
    if unknown:
        raise MegaCppError(f"samples name unknown task id(s): {', '.join(unknown[:5])}")

    def check(sample: Sample) -> SampleResult:
        result = SampleResult(sample, verifier.verify(by_id[sample.task_id].program(sample.completion)))
        if on_result is not None:
            on_result(result)
        return result

    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="verify") as pool:
        futures = [pool.submit(check, sample) for sample in samples]
        done, _ = wait(futures, return_when=FIRST_EXCEPTION)
        failed = [future for future in done if future.exception() is not None]
        if failed:
            pool.shutdown(wait=True, cancel_futures=True)
            raise failed[0].exception()
    return [future.result() for future in futures]


def reference_samples(problems: Iterable[Problem]) -> list[Sample]:
    """One sample per problem that has a canonical solution: that solution."""
    return [Sample(problem.task_id, 0, problem.canonical_solution) for problem in problems
            if problem.canonical_solution is not None]


def evaluate_generator(
    generate: Generator,
    problems: Sequence[Problem],
    sampling: SamplingSettings,
    *,
    verifier: CppVerifier,
    out_dir: str | os.PathLike[str],
    model: Mapping[str, Any],
    ks: Iterable[int] = DEFAULT_KS,
    workers: int = os.cpu_count() or 1,
    on_result: Callable[[SampleResult], None] | None = None,
    problem_file: Path | None = None,
    kernels: Callable[[], Mapping[str, str]] | None = None,
) -> EvalReport:
    """Sample ``sampling.n`` completions per problem from ``generate`` and score them.
    ``kernels``, called after sampling, names the kernel backends the sampler ran (e.g.
    ``megacpp.kernels.runtime.chosen_kernels``) for the receipt."""
    completions = generate([problem.prompt for problem in problems], sampling.n,
                           sampling.temperature, **sampling.options())
    _check_completions(completions, len(problems), sampling.n)
    samples = [Sample(problem.task_id, index, completion)
               for problem, per_problem in zip(problems, completions)
               for index, completion in enumerate(per_problem)]
    return evaluate_samples(problems, samples, verifier=verifier, out_dir=out_dir, model=model,
                            sampling=asdict(sampling), ks=ks, workers=workers,
                            on_result=on_result, problem_file=problem_file,
                            kernels=kernels() if kernels is not None else None)


def evaluate_samples(
    problems: Sequence[Problem],
    samples: Sequence[Sample],
    *,
    verifier: CppVerifier,
    out_dir: str | os.PathLike[str],
    model: Mapping[str, Any],
    sampling: Mapping[str, Any],
    ks: Iterable[int] = DEFAULT_KS,
    workers: int = os.cpu_count() or 1,
    on_result: Callable[[SampleResult], None] | None = None,
    problem_file: Path | None = None,
    kernels: Mapping[str, str] | None = None,
) -> EvalReport:
    """Verify ``samples``, write per-sample results, the pass@k summary and a receipt (with
    ``kernels``, the backends that produced the samples, when given)."""
    if not samples:
        raise MegaCppError("no samples to evaluate")
    started = time.monotonic()
    results = verify_samples(verifier, problems, samples, workers=workers, on_result=on_result)
    wall_s = time.monotonic() - started
    counts = _counts(results)
    report = EvalReport(results=results, pass_at_k=mean_pass_at_k(counts, ks), counts=counts,
                        status_counts=dict(Counter(r.verdict.status.value for r in results)),
                        wall_s=wall_s, out_dir=Path(out_dir))
    config = {
        "model": dict(model),
        "sampling": dict(sampling),
        "build": asdict(verifier.build),
        "compile_limits": asdict(verifier.compile_limits),
        "run_limits": asdict(verifier.run_limits),
        "isolation": verifier.sandbox.isolation.value,
        "sandbox": {**verifier.sandbox.guarantees(),
                    "compile_memory_bound": verifier.sandbox.memory_bound(verifier.compile_limits),
                    "run_memory_bound": verifier.sandbox.memory_bound(verifier.run_limits)},
        "workers": workers,
        "ks": sorted(set(ks)),
        "problems": _problem_set(problems, counts, problem_file),
    }
    _write_outputs(report, results, config, kernels)
    return report


def _counts(results: Sequence[SampleResult]) -> dict[str, tuple[int, int]]:
    totals: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    for result in results:
        totals[result.sample.task_id][0] += 1
        totals[result.sample.task_id][1] += result.verdict.passed
    return {task_id: (n, c) for task_id, (n, c) in totals.items()}


def _problem_set(problems: Sequence[Problem], counts: Mapping[str, tuple[int, int]],
                 problem_file: Path | None) -> dict[str, Any]:
    return {
        "file": str(problem_file) if problem_file else None,
        "sha256": sha256_file(problem_file) if problem_file else None,
        "evaluated": len(counts),
        "available": len(problems),
    }


def _write_outputs(report: EvalReport, results: Sequence[SampleResult],
                   config: dict[str, Any], kernels: Mapping[str, str] | None) -> None:
    out = report.out_dir
    samples_path = atomic_write_text(
        out / SAMPLES_FILE, "".join(json.dumps(r.to_json()) + "\n" for r in results))
    summary = {
        "pass_at_k": {f"pass@{k}": value for k, value in report.pass_at_k.items()},
        "status_counts": report.status_counts,
        "per_problem": {task: {"n": n, "passed": c} for task, (n, c) in report.counts.items()},
        "wall_s": report.wall_s,
        "programs_per_s": len(results) / report.wall_s if report.wall_s > 0 else 0.0,
        **config,
    }
    summary_path = atomic_write_json(out / SUMMARY_FILE, summary)
    metrics = {f"pass@{k}": value for k, value in report.pass_at_k.items()}
    metrics.update(samples=float(len(results)), problems=float(len(report.counts)),
                   programs_per_s=summary["programs_per_s"])
    write_receipt(out / RECEIPT_FILE, "eval", config=config, metrics=metrics,
                  artifacts=[samples_path, summary_path], kernels=kernels)
    report.files = {"samples": samples_path, "summary": summary_path,
                    "receipt": out / RECEIPT_FILE}


def _check_completions(completions: object, n_problems: int, n: int) -> None:
    """The generator must return n strings per prompt; anything else is refused."""
    if not isinstance(completions, list) or len(completions) != n_problems:
        got = len(completions) if isinstance(completions, list) else type(completions).__name__
        raise MegaCppError(f"the generator returned {got} completion lists for {n_problems} prompts")
    for position, per_problem in enumerate(completions):
        if (not isinstance(per_problem, list) or len(per_problem) != n
                or not all(isinstance(text, str) for text in per_problem)):
            raise MegaCppError(f"the generator's completions for prompt {position} are not a "
                               f"list of {n} strings")


def read_samples(path: str | os.PathLike[str]) -> list[Sample]:
    """Completions from JSONL lines ``{"task_id": ..., "completion": ...}`` (file order)."""
    path = Path(path)
    samples: list[Sample] = []
    seen: Counter[str] = Counter()
    text = read_text_bounded(path, LOG_LIMIT, what="samples file")
    for line_no, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        record = _sample_record(line, path, line_no)
        samples.append(Sample(record["task_id"], seen[record["task_id"]], record["completion"]))
        seen[record["task_id"]] += 1
    if not samples:
        raise MegaCppError(f"samples file {path} holds no samples")
    return samples


def _sample_record(line: str, path: Path, line_no: int) -> dict[str, str]:
    record = parse_json(line, f"{path}:{line_no}")
    if not (isinstance(record, dict) and isinstance(record.get("task_id"), str)
            and isinstance(record.get("completion"), str)):
        raise MegaCppError(f"{path}:{line_no}: each line needs string fields task_id and "
                           f"completion")
    return record
