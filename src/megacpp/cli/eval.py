"""``megacpp eval ...``: the verifier-first C++ evaluation harness.

Commands: ``sandbox-info``, ``run`` (one file), ``verify-reference`` (a problem set's canonical
solutions), ``mutation-check``, ``score`` (pass@k of completions from a JSONL file),
``humaneval-x`` (sample a problem set from a checkpoint or an OpenAI-compatible endpoint, then
score it), ``infill`` (fill-in-the-middle exact match on held-out C++). Problem sets load in
the HumanEval-X, MultiPL-E and MBXP layouts; each builds with its suite config.
"""

from __future__ import annotations

import json
import math
import os
import statistics
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Annotated, TypeVar

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from megacpp._io import TEXT_LIMIT, read_text_bounded
from megacpp.cli._options import DeviceOpt, FallbackOpt, TokenizerOpt, resolve_device
from megacpp.errors import MegaCppError
from megacpp.eval import (
    DEFAULT_KS,
    BuildOptions,
    CppVerifier,
    EvalReport,
    Limits,
    Problem,
    Sample,
    SampleResult,
    SamplingSettings,
    Sandbox,
    SuiteConfig,
    all_mutants,
    evaluate_samples,
    load_problem_set,
    read_samples,
    reference_samples,
    select_problems,
    verify_samples,
)
from megacpp.eval.cpp import RUN_LIMITS
from megacpp.eval.endpoint import Endpoint, completions_url, sample_endpoint

app = typer.Typer(add_completion=False, no_args_is_help=True)
console = Console(highlight=False)
T = TypeVar("T")

ProblemsOpt = Annotated[Path | None, typer.Option(
    "--problems", help="Problem set, .jsonl or .jsonl.gz (default: $MEGACPP_EVAL_DATA, then "
                       "the HumanEval-X C++ copy shipped in the package).")]
FormatOpt = Annotated[str | None, typer.Option(
    "--format", help="Problem layout: humanevalx, multipl-e or mbxp (default: detected from "
                     "the fields).")]
SuiteConfigOpt = Annotated[Path | None, typer.Option(
    "--suite-config", help="Suite config TOML: std, flags, libs, headers (default: "
                           "<name>.suite.toml beside the problem file, else the layout's).")]
WorkersOpt = Annotated[int, typer.Option(help="Parallel compile+run workers.")]
LimitOpt = Annotated[int | None, typer.Option(help="Only the first N problems.")]
TaskOpt = Annotated[list[str] | None, typer.Option(
    "--task", help="Only this task id (repeatable), e.g. CPP/0.")]
StdOpt = Annotated[str | None, typer.Option(
    help="C++ standard passed as -std= (default: the suite's, c++17 unless it says).")]
SanitizeOpt = Annotated[bool, typer.Option(
    "--sanitize", help="Build with ASan + UBSan (slower; catches out-of-bounds reads).")]
PchOpt = Annotated[bool, typer.Option(
    "--pch/--no-pch", help="Precompile each program's leading #include block (same verdicts, "
                           "faster).")]
LinkerOpt = Annotated[str, typer.Option(
    help="Linker for -fuse-ld (bfd, gold, lld, mold), 'default', or 'auto' (gold if installed).")]
IsolationOpt = Annotated[str | None, typer.Option(
    help="Sandbox isolation: namespaces (default) or rlimits (weaker; also "
         "$MEGACPP_SANDBOX_ISOLATION).")]
DEFAULT_WORKERS = os.cpu_count() or 1
MAX_SECONDS = 24 * 3600  # a sandboxed program's CPU or wall time at most
MAX_MEMORY_MB = 1 << 20  # 1 TiB


def _check_limit(option: str, value: float, high: float) -> None:
    if not (math.isfinite(value) and 0 < value <= high):
        raise MegaCppError(f"{option} {value}: expected a number > 0 and <= {high}")


@app.command("sandbox-info")
def sandbox_info(
    isolation: IsolationOpt = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print machine-readable JSON.")] = False,
) -> None:
    """Show the sandbox's isolation level and mechanisms, and prove it works by running a probe."""
    sandbox = Sandbox(isolation)
    sandbox.probe()
    identity = sandbox.execute(["/usr/bin/id", "-u"], mounts=[], cwd="/", limits=Limits())
    info = {
        "isolation": sandbox.isolation.value,
        "harness_uid": os.geteuid(),
        "program_uid": identity.stdout.decode().strip(),
        "probe": "ok",
        "mechanisms": dict(sandbox.describe()),
    }
    if as_json:
        typer.echo(json.dumps(info, indent=2))
        return
    console.print(f"[bold]isolation:[/] {info['isolation']}   [bold]probe:[/] ok   "
                  f"[bold]uid:[/] harness {info['harness_uid']}, program {info['program_uid']}")
    table = Table("mechanism", "what it does here")
    for name, what in sandbox.describe():
        table.add_row(name, what)
    console.print(table)


@app.command()
def run(
    file: Annotated[Path, typer.Argument(help="A single-file C++ program with main().")],
    std: StdOpt = "c++17",
    flag: Annotated[list[str] | None, typer.Option(
        "--flag", help="Extra compiler flag (repeatable), e.g. --flag=-O2.")] = None,
    lib: Annotated[list[str] | None, typer.Option(
        "--lib", help="Link -l<name> (repeatable), e.g. --lib crypto.")] = None,
    sanitize: SanitizeOpt = False,
    cpu: Annotated[int, typer.Option(help="CPU seconds for the program.")] = RUN_LIMITS.cpu_s,
    wall: Annotated[float, typer.Option(help="Wall-clock seconds for the program.")] = RUN_LIMITS.wall_s,
    memory_mb: Annotated[int, typer.Option(help="Address-space limit in MiB.")] = 1024,
    isolation: IsolationOpt = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the verdict as JSON.")] = False,
) -> None:
    """Compile and run one C++ file in the sandbox; exit 0 only if it passed."""
    _check_limit("--cpu", cpu, MAX_SECONDS)
    _check_limit("--wall", wall, MAX_SECONDS)
    _check_limit("--memory-mb", memory_mb, MAX_MEMORY_MB)
    source = read_text_bounded(file, TEXT_LIMIT, what="C++ source")
    build = BuildOptions(std=std, flags=("-O0", *(flag or ())), libs=tuple(lib or ()),
                         sanitize=sanitize)
    limits = RUN_LIMITS.replace(cpu_s=cpu, wall_s=wall, memory_bytes=memory_mb << 20)
    verdict = CppVerifier(build, Sandbox(isolation), run_limits=limits).verify(source)
    if as_json:
        typer.echo(json.dumps(verdict.to_json(), indent=2))
    else:
        console.print(f"[bold]{verdict.status.value}[/]: {verdict.detail}  "
                      f"(compile {verdict.compile_s:.2f} s, run {_seconds(verdict.run_s)})")
        for name, text in (("stdout", verdict.stdout), ("stderr", verdict.stderr)):
            if text.strip():
                console.print(f"[dim]--- {name} ---[/]")
                console.print(text.rstrip(), markup=False)
    if not verdict.passed:
        raise SystemExit(1)


@app.command("verify-reference")
def verify_reference(
    problems: ProblemsOpt = None,
    problem_format: FormatOpt = None,
    suite_config: SuiteConfigOpt = None,
    workers: WorkersOpt = DEFAULT_WORKERS,
    limit: LimitOpt = None,
    task: TaskOpt = None,
    std: StdOpt = None,
    sanitize: SanitizeOpt = False,
    pch: PchOpt = True,
    linker: LinkerOpt = "auto",
    isolation: IsolationOpt = None,
    out: Annotated[Path | None, typer.Option(
        help="Write samples.jsonl, summary.json and an eval receipt here.")] = None,
) -> None:
    """Run every canonical solution against its tests; exit 0 only if all pass. Problems
    without a reference solution are skipped and counted."""
    problem_set = load_problem_set(problems, layout=problem_format, suite_config=suite_config)
    problem_file = problem_set.path
    selected = _with_reference(select_problems(problem_set.problems, task or (), limit))
    verifier = _suite_verifier(problem_set.suite, std, sanitize, pch, linker, isolation)
    samples = reference_samples(selected)
    if out is None:
        results, wall_s = _with_progress("reference solutions", len(samples), lambda tick: (
            verify_samples(verifier, selected, samples, workers=workers, on_result=tick)))
    else:
        report, wall_s = _with_progress("reference solutions", len(samples), lambda tick: (
            evaluate_samples(selected, samples, verifier=verifier, out_dir=out,
                             model={"name": "canonical-solutions"}, sampling={"n": 1},
                             ks=(1,), workers=workers, problem_file=problem_file,
                             on_result=tick)))
        results = report.results
        console.print(f"wrote {', '.join(str(p) for p in report.files.values())}")
    _print_verification(results, wall_s, workers, verifier)
    if any(not result.verdict.passed for result in results):
        raise SystemExit(1)


@app.command("mutation-check")
def mutation_check(
    problems: ProblemsOpt = None,
    problem_format: FormatOpt = None,
    suite_config: SuiteConfigOpt = None,
    workers: WorkersOpt = DEFAULT_WORKERS,
    limit: LimitOpt = None,
    task: TaskOpt = None,
    per_problem: Annotated[int, typer.Option(help="Mutants per problem.")] = 2,
    min_kill_rate: Annotated[float, typer.Option(
        help="Exit 1 when fewer than this fraction of mutants fail.")] = 0.7,
    sanitize: SanitizeOpt = False,
    pch: PchOpt = True,
    linker: LinkerOpt = "auto",
    isolation: IsolationOpt = None,
) -> None:
    """Check that wrong solutions fail: mutate each reference once per mutant and verify."""
    if per_problem < 1:
        raise MegaCppError(f"--per-problem must be >= 1, got {per_problem}")
    problem_set = load_problem_set(problems, layout=problem_format, suite_config=suite_config)
    selected = _with_reference(select_problems(problem_set.problems, task or (), limit))
    mutants = all_mutants(selected, per_problem)
    samples = [Sample(m.task_id, i, m.completion) for i, m in enumerate(mutants)]
    verifier = _suite_verifier(problem_set.suite, None, sanitize, pch, linker, isolation)
    results, wall_s = _with_progress("mutants", len(samples), lambda tick: verify_samples(
        verifier, selected, samples, workers=workers, on_result=tick))
    survivors = [(m, r) for m, r in zip(mutants, results) if r.verdict.passed]
    killed = len(results) - len(survivors)
    rate = killed / len(results) if results else 0.0
    console.print(f"[bold]{killed}/{len(results)} mutants killed ({rate:.1%})[/] over "
                  f"{len(selected)} problems in {wall_s:.1f} s; by status: "
                  f"{_status_summary(results)}")
    if survivors:
        table = Table("task", "surviving mutation (equivalent or untested)")
        for mutant, _ in survivors:
            table.add_row(mutant.task_id, mutant.description)
        console.print(table)
    if rate < min_kill_rate:
        raise SystemExit(1)


@app.command()
def score(
    samples_file: Annotated[Path, typer.Argument(
        help='JSONL of {"task_id": ..., "completion": ...}; several lines per task = n samples.')],
    out: Annotated[Path, typer.Option(help="Directory for samples.jsonl, summary.json, receipt.json.")],
    problems: ProblemsOpt = None,
    problem_format: FormatOpt = None,
    suite_config: SuiteConfigOpt = None,
    k: Annotated[list[int] | None, typer.Option(
        "--k", help="k for pass@k (repeatable; default 1, 10, 100 where n allows).")] = None,
    model: Annotated[str, typer.Option(help="Model name recorded in the receipt.")] = "unknown",
    temperature: Annotated[float | None, typer.Option(
        help="Sampling temperature recorded in the receipt.")] = None,
    workers: WorkersOpt = DEFAULT_WORKERS,
    std: StdOpt = None,
    sanitize: SanitizeOpt = False,
    pch: PchOpt = True,
    linker: LinkerOpt = "auto",
    isolation: IsolationOpt = None,
) -> None:
    """pass@k of completions read from a file (the offline path of the pass@k driver)."""
    problem_set = load_problem_set(problems, layout=problem_format, suite_config=suite_config)
    problem_file, all_problems = problem_set.path, problem_set.problems
    samples = read_samples(samples_file)
    verifier = _suite_verifier(problem_set.suite, std, sanitize, pch, linker, isolation)
    per_task = Counter(s.task_id for s in samples)
    sampling = {"n": min(per_task.values()), "temperature": temperature,
                "source": str(samples_file)}
    report, _ = _with_progress("samples", len(samples), lambda tick: evaluate_samples(
        all_problems, samples, verifier=verifier, out_dir=out, model={"name": model},
        sampling=sampling, ks=tuple(k or DEFAULT_KS), workers=workers,
        problem_file=problem_file, on_result=tick))
    table = Table("metric", "value")
    for kk, value in report.pass_at_k.items():
        table.add_row(f"pass@{kk}", f"{value:.4f}")
    table.add_row("problems", f"{len(report.counts)} of {len(all_problems)}")
    table.add_row("samples per problem", _range(per_task.values()))
    table.add_row("statuses", ", ".join(f"{s}={c}" for s, c in sorted(report.status_counts.items())))
    console.print(table)
    console.print(f"wrote {', '.join(str(p) for p in report.files.values())}")


@app.command("humaneval-x")
def humaneval_x(
    out: Annotated[Path, typer.Option(help="Directory for samples.jsonl, summary.json, receipt.json.")],
    n: Annotated[int, typer.Option(help="Samples per problem.")] = 10,
    temperature: Annotated[float, typer.Option(help="Sampling temperature (0 = greedy).")] = 0.8,
    top_p: Annotated[float, typer.Option(help="Nucleus sampling mass.")] = 0.95,
    max_new_tokens: Annotated[int, typer.Option(help="Tokens per completion at most.")] = 384,
    seed: Annotated[int | None, typer.Option(help="Seed for reproducible samples.")] = None,
    limit: LimitOpt = None,
    task: TaskOpt = None,
    problems: ProblemsOpt = None,
    problem_format: FormatOpt = None,
    suite_config: SuiteConfigOpt = None,
    k: Annotated[list[int] | None, typer.Option(
        "--k", help="k for pass@k (repeatable; default 1, 10, 100 where n allows).")] = None,
    tokenizer: TokenizerOpt = None,
    device: DeviceOpt = "auto",
    fallback_to_previous: FallbackOpt = False,
    workers: WorkersOpt = DEFAULT_WORKERS,
    std: StdOpt = None,
    sanitize: SanitizeOpt = False,
    pch: PchOpt = True,
    linker: LinkerOpt = "auto",
    isolation: IsolationOpt = None,
    checkpoint: Annotated[Path | None, typer.Option(
        help="Run directory or checkpoints/step_N directory (or sample from --endpoint).")] = None,
    endpoint: EndpointOpt = None,
    endpoint_model: EndpointModelOpt = None,
    api_key: ApiKeyOpt = None,
    concurrency: ConcurrencyOpt = 8,
    retries: RetriesOpt = 3,
    request_timeout: RequestTimeoutOpt = 600.0,
    n_per_request: NPerRequestOpt = None,
) -> None:
    """Sample completions of a problem set's prompts (HumanEval-X C++ by default) from a
    checkpoint, or from an OpenAI-compatible server (--endpoint URL --model NAME), and score
    pass@k."""
    server = _model_source("samples", checkpoint, tokenizer, fallback_to_previous, endpoint,
                           endpoint_model, api_key, concurrency, retries, request_timeout,
                           n_per_request)
    if server is None:
        device = resolve_device(device)
    problem_set = load_problem_set(problems, layout=problem_format, suite_config=suite_config)
    problem_file = problem_set.path
    chosen = select_problems(problem_set.problems, task or (), limit)
    verifier = _suite_verifier(problem_set.suite, std, sanitize, pch, linker, isolation)
    sampling = SamplingSettings(n=n, temperature=temperature, top_p=top_p,
                                max_new_tokens=max_new_tokens, seed=seed)
    if server is not None:
        _print_report(_score_endpoint(server, chosen, sampling, verifier=verifier,
                                      out_dir=out, workers=workers, ks=tuple(k or DEFAULT_KS),
                                      problem_file=problem_file))
        return
    from megacpp.cli._checkpoint import load_for_inference
    from megacpp.eval import evaluate_generator
    from megacpp.infer.generate import FunctionBodyGenerator, TextGenerator
    from megacpp.kernels.runtime import chosen_kernels

    model, tok, ckpt = load_for_inference(checkpoint, tokenizer, device,
                                          fallback_to_previous=fallback_to_previous)
    generate = FunctionBodyGenerator(TextGenerator(model, tok, device), max_new_tokens)
    console.print(f"sampling {n} completions for each of {len(chosen)} problems from {ckpt}")
    report, _ = _with_progress("samples", n * len(chosen), lambda tick: evaluate_generator(
        generate, chosen, sampling, verifier=verifier, out_dir=out, workers=workers,
        model=_local_model(ckpt, model),
        ks=tuple(k or DEFAULT_KS), on_result=tick, problem_file=problem_file,
        kernels=chosen_kernels))
    _print_report(report)


def _local_model(checkpoint: Path, model) -> dict:
    """A local model as a receipt records it."""
    return {"checkpoint": str(checkpoint), "pattern": model.cfg.pattern,
            "params": sum(p.numel() for p in model.parameters())}


def _print_report(report: EvalReport) -> None:
    table = Table("metric", "value")
    for kk, value in report.pass_at_k.items():
        table.add_row(f"pass@{kk}", f"{value:.4f}")
    table.add_row("problems", str(len(report.counts)))
    table.add_row("statuses", ", ".join(f"{s}={c}" for s, c in sorted(report.status_counts.items())))
    console.print(table)
    console.print(f"wrote {', '.join(str(p) for p in report.files.values())}")


# ---- sampling from an OpenAI-compatible server (megacpp.eval.endpoint) ------------------------

EndpointOpt = Annotated[str | None, typer.Option(
    "--endpoint", help="Sample from an OpenAI-compatible server instead of a checkpoint: its "
                       "base URL, e.g. http://127.0.0.1:8000/v1 (vLLM, TGI, megacpp serve).")]
EndpointModelOpt = Annotated[str | None, typer.Option(
    "--model", help="With --endpoint: the model name to request.")]
ApiKeyOpt = Annotated[str | None, typer.Option(
    "--api-key", envvar="OPENAI_API_KEY", show_envvar=True,
    help="With --endpoint: bearer token for the server (not recorded).")]
ConcurrencyOpt = Annotated[int, typer.Option(help="With --endpoint: requests in flight at most.")]
RetriesOpt = Annotated[int, typer.Option(
    help="With --endpoint: further attempts after a connection error, timeout, 429 or 5xx.")]
RequestTimeoutOpt = Annotated[float, typer.Option(
    help="With --endpoint: seconds one request may take.")]
NPerRequestOpt = Annotated[int | None, typer.Option(
    help="With --endpoint: completions asked per request (default: all n in one); for servers "
         "that cap or ignore n.")]


def _model_source(verb: str, checkpoint: Path | None, tokenizer: Path | None, fallback: bool,
                  url: str | None, model: str | None, api_key: str | None, concurrency: int,
                  retries: int, timeout_s: float, n_per_request: int | None) -> Endpoint | None:
    """The server to sample from (--endpoint), or None for a local --checkpoint; refuses
    options of both and neither (``verb`` names what the command does in the error)."""
    if url is not None or model is not None:
        if checkpoint is not None or tokenizer is not None or fallback:
            raise MegaCppError(f"--endpoint {verb} from a server: --checkpoint, --tokenizer and "
                               "--fallback-to-previous are for a local model")
        return _endpoint(url, model, api_key, concurrency, retries, timeout_s, n_per_request)
    if checkpoint is None:
        raise MegaCppError("give --checkpoint DIR (a local model) or --endpoint URL --model "
                           "NAME (an OpenAI-compatible server)")
    return None


def _endpoint(url: str | None, model: str | None, api_key: str | None, concurrency: int,
              retries: int, timeout_s: float, n_per_request: int | None) -> Endpoint:
    if url is None or model is None:
        raise MegaCppError("--endpoint URL and --model NAME go together: the server's URL and "
                           "the model it serves")
    return Endpoint(completions_url(url), model, api_key=api_key or None, timeout_s=timeout_s,
                    retries=retries, concurrency=concurrency, n_per_request=n_per_request)


def _score_endpoint(server: Endpoint, chosen: Sequence[Problem], sampling: SamplingSettings,
                    **evaluate) -> EvalReport:
    """Sample every problem's completions from ``server``, then verify and score them
    (``evaluate``: :func:`evaluate_samples`'s verifier, out_dir, workers, ks, problem_file)."""
    from megacpp.infer.generate import CPP_BODY_STOP, close_function_body

    console.print(f"sampling {sampling.n} completions for each of {len(chosen)} problems from "
                  f"{server.model} at {server.public_url()}")
    sampled, sampling_s = _with_progress(
        "completions", sampling.n * len(chosen), verb="sampling", work=lambda tick: (
            sample_endpoint(server, [p.prompt for p in chosen], sampling, (CPP_BODY_STOP,),
                            names=[p.task_id for p in chosen], on_completion=tick)))
    samples = [Sample(problem.task_id, index, close_function_body(c.text, c.finish_reason or ""))
               for problem, per_problem in zip(chosen, sampled.completions)
               for index, c in enumerate(per_problem)]
    model = {"endpoint": server.public_url(), "requested": server.model,
             "name": sampled.served_name()}
    settings = {**asdict(sampling), "stop": [CPP_BODY_STOP], "n_per_request": server.n_per_request,
                "concurrency": server.concurrency, "retries": server.retries,
                "request_timeout_s": server.timeout_s, "requests": sampled.requests,
                "retried": sampled.retried, "sampling_s": round(sampling_s, 3)}
    report, _ = _with_progress("samples", len(samples), lambda tick: evaluate_samples(
        chosen, samples, model=model, sampling=settings, on_result=tick, **evaluate))
    return report


def _suite_verifier(suite: SuiteConfig, std: str | None, sanitize: bool, pch: bool,
                    linker: str, isolation: str | None) -> CppVerifier:
    """A verifier with the suite's build (``std`` overrides its standard), after checking
    the headers and libraries the suite needs."""
    sandbox = Sandbox(isolation)
    build = suite.build_options(std=std, sanitize=sanitize, pch=pch,
                                linker=None if linker == "default" else linker)
    verifier = CppVerifier(build, sandbox)
    suite.check_toolchain(verifier)
    return verifier


def _with_reference(problems: Sequence[Problem]) -> list[Problem]:
    """The problems that have a reference solution; says how many were skipped."""
    with_reference = [problem for problem in problems if problem.has_reference]
    skipped = len(problems) - len(with_reference)
    if skipped:
        console.print(f"skipped {skipped} of {len(problems)} problems without a reference "
                      "solution")
    if not with_reference:
        raise MegaCppError(f"none of the {len(problems)} selected problems has a reference "
                           "solution (canonical_solution); nothing to verify")
    return with_reference


def _with_progress(what: str, total: int, work: Callable[[Callable[[object], None]], T],
                   verb: str = "verifying") -> tuple[T, float]:
    """Run ``work(tick)`` under a progress bar; returns its result and the elapsed seconds."""
    started = time.monotonic()
    with Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                  TimeElapsedColumn(), console=Console(stderr=True)) as progress:
        task_id = progress.add_task(f"{verb} {what}", total=total)
        result = work(lambda _result: progress.advance(task_id))
    return result, time.monotonic() - started


def _print_verification(results: Sequence[SampleResult], wall_s: float, workers: int,
                        verifier: CppVerifier) -> None:
    passed = sum(r.verdict.passed for r in results)
    compile_s = [r.verdict.compile_s for r in results]
    run_s = [r.verdict.run_s for r in results if r.verdict.run_s is not None]
    build = verifier.build
    console.print(
        f"[bold]{passed}/{len(results)} passed[/] in {wall_s:.1f} s "
        f"({len(results) / wall_s if wall_s else 0:.2f} programs/s, {workers} workers); "
        f"median compile {statistics.median(compile_s):.3f} s, median run "
        f"{statistics.median(run_s) if run_s else float('nan'):.4f} s"
    )
    console.print(f"[dim]-std={build.std} flags={' '.join(build.flags) or '-'} "
                  f"libs={','.join(build.libs) or '-'} sanitize={build.sanitize} pch={build.pch} "
                  f"linker={build.linker or 'default'} isolation={verifier.sandbox.isolation.value}[/]")
    failures = [r for r in results if not r.verdict.passed]
    if failures:
        table = Table("task", "status", "detail", "stderr (first line)")
        for r in failures:
            first_line = (r.verdict.stderr.strip().splitlines() or [""])[0]
            table.add_row(r.sample.task_id, r.verdict.status.value, r.verdict.detail, first_line)
        console.print(table)


def _status_summary(results: Sequence[SampleResult]) -> str:
    counts = Counter(r.verdict.status.value for r in results)
    return ", ".join(f"{status}={count}" for status, count in sorted(counts.items()))


def _range(values) -> str:
    low, high = min(values), max(values)
    return str(low) if low == high else f"{low}..{high}"


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f} s"



# ---- infilling (megacpp.eval.infill) ------------------------------------------------------------


@app.command("infill")
def infill(
    source: Annotated[Path, typer.Argument(
        help="Held-out C++: a dataset directory (its validation split), a directory of C/C++ "
             "files (searched recursively) or one file.")],
    out: Annotated[Path, typer.Option(help="Directory for infill.jsonl, summary.json, "
                                           "receipt.json.")],
    span: Annotated[str, typer.Option(
        help="What is cut out: line (one non-blank line) or block (2..--max-lines lines).")
    ] = "line",
    spans_per_file: Annotated[int, typer.Option(help="Spans cut from each file.")] = 1,
    max_lines: Annotated[int, typer.Option(help="Lines of a block at most.")] = 5,
    limit: Annotated[int | None, typer.Option(help="At most N tasks.")] = None,
    seed: Annotated[int, typer.Option(help="Seed of the span choice and the sampling.")] = 0,
    temperature: Annotated[float, typer.Option(help="Sampling temperature (0 = greedy).")] = 0.0,
    max_new_tokens: Annotated[int, typer.Option(help="Tokens per middle at most.")] = 128,
    prefix_chars: Annotated[int, typer.Option(
        help="Characters of text before the span at most (cut at a line start).")] = 2048,
    suffix_chars: Annotated[int, typer.Option(
        help="Characters of text after the span at most (cut at a line end).")] = 1024,
    checkpoint: Annotated[Path | None, typer.Option(
        help="Run directory or checkpoints/step_N directory (or fill from --endpoint).")] = None,
    tokenizer: TokenizerOpt = None,
    device: DeviceOpt = "auto",
    fallback_to_previous: FallbackOpt = False,
    endpoint: EndpointOpt = None,
    endpoint_model: EndpointModelOpt = None,
    api_key: ApiKeyOpt = None,
    concurrency: ConcurrencyOpt = 8,
    retries: RetriesOpt = 3,
    request_timeout: RequestTimeoutOpt = 600.0,
) -> None:
    """Fill-in-the-middle on held-out C++: cut spans (seeded), have the model fill each from
    the text before and after it (a checkpoint, or a server's /v1/completions with
    ``suffix``), and report exact match and line exact match with a receipt."""
    from megacpp.eval.infill import load_documents, make_tasks

    if max_new_tokens < 1:
        raise MegaCppError(f"--max-new-tokens {max_new_tokens}: expected >= 1")
    if not (math.isfinite(temperature) and temperature >= 0):
        raise MegaCppError(f"--temperature {temperature}: expected a number >= 0")
    server = _model_source("fills", checkpoint, tokenizer, fallback_to_previous, endpoint,
                           endpoint_model, api_key, concurrency, retries, request_timeout, 1)
    if server is None:
        device = resolve_device(device)
    documents, where = load_documents(source)
    tasks = make_tasks(documents, span, spans_per_document=spans_per_file, max_lines=max_lines,
                       seed=seed, prefix_chars=prefix_chars, suffix_chars=suffix_chars,
                       limit=limit)
    settings = {"span": span, "spans_per_file": spans_per_file, "max_lines": max_lines,
                "limit": limit, "seed": seed, "temperature": temperature,
                "max_new_tokens": max_new_tokens, "prefix_chars": prefix_chars,
                "suffix_chars": suffix_chars, "order": "psm"}
    if server is not None:
        fill, model = _endpoint_filler(server, temperature, max_new_tokens, seed)
    else:
        fill, model = _local_filler(checkpoint, tokenizer, device, fallback_to_previous,
                                    temperature, max_new_tokens, seed)
    _run_infill(tasks, fill, out, model, settings, where)


def _run_infill(tasks, fill, out: Path, model: dict, settings: dict, where: dict) -> None:
    from megacpp.eval.infill import evaluate_infill

    console.print(f"filling {len(tasks)} {settings['span']} span(s) from "
                  f"{len({t.document for t in tasks})} file(s) of {where['path']}")
    report, _ = _with_progress("middles", len(tasks), verb="filling", work=lambda tick: (
        evaluate_infill(tasks, lambda chosen: fill(chosen, tick), out_dir=out, model=model,
                        settings=settings, source=where)))
    table = Table("metric", "value")
    table.add_row("exact match", f"{report.exact_match:.4f}")
    table.add_row("line exact match", f"{report.line_exact_match:.4f}")
    table.add_row("tasks", str(report.tasks))
    console.print(table)
    console.print(f"wrote {', '.join(str(p) for p in report.files.values())}")


def _local_filler(checkpoint: Path, tokenizer: Path | None, device: str, fallback: bool,
                  temperature: float, max_new_tokens: int, seed: int):
    """Fill with a local model: every middle through one engine run."""
    from megacpp.cli._checkpoint import load_for_inference
    from megacpp.data.fim import FimIds
    from megacpp.eval.infill import Filled
    from megacpp.infer.generate import TextGenerator
    from megacpp.infer.sampling import SamplingParams

    model, tok, ckpt = load_for_inference(checkpoint, tokenizer, device,
                                          fallback_to_previous=fallback)
    FimIds.of(tok)  # refuse a tokenizer without FIM tokens before any work
    generator = TextGenerator(model, tok)
    params = SamplingParams(temperature=temperature, max_new_tokens=max_new_tokens, seed=seed)

    def fill(tasks, tick):
        middles = generator.infill_all([(t.prefix, t.suffix) for t in tasks], params,
                                       on_finish=lambda _i, c: tick(c))
        return [Filled(c.text, c.finish_reason) for c in middles]

    return fill, _local_model(ckpt, model)


def _endpoint_filler(server: Endpoint, temperature: float, max_new_tokens: int, seed: int):
    """Fill through a server's /v1/completions with ``suffix``."""
    from megacpp.eval.infill import Filled

    def fill(tasks, tick):
        sampling = SamplingSettings(n=1, temperature=temperature,
                                    max_new_tokens=max_new_tokens, seed=seed)
        sampled = sample_endpoint(server, [t.prefix for t in tasks], sampling,
                                  names=[t.task_id for t in tasks], on_completion=tick,
                                  suffixes=[t.suffix for t in tasks])
        model["name"] = sampled.served_name()
        return [Filled(c[0].text, c[0].finish_reason) for c in sampled.completions]

    model = {"endpoint": server.public_url(), "requested": server.model}
    return fill, model
