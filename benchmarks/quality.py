"""Quality at equal GPU time: validation bits per byte and HumanEval-X C++ pass@k of model
candidates trained for the same wall time, each on its own GPU, side by side.

    PYTHONPATH=src python benchmarks/quality.py --data data/quality --out OUT --minutes 3

Method (docs/quality.md has the long form):

* Every candidate runs the real ``megacpp train`` in its own process with
  ``CUDA_VISIBLE_DEVICES`` set to one GPU; N GPUs run N jobs at a time.
* Equal GPU time: each run has ``train.time_budget_s``. Its clock starts when the process
  starts, so imports, setup, compilation, warm-up and CUDA-graph capture are counted;
  validation and checkpoint writes are not (they pause the clock). The schedule's decay
  follows the clock's share of the budget, so every candidate gets a whole schedule.
* Same tokenizer and data (one dataset), same data order and initialization seed, same batch
  (``--micro-batch`` rows of the dataset's sequence length per step), same schedule shape
  (linear warmup by steps, then cosine over the budget), the same validation rows.
* Learning rate: each candidate runs a short sweep (``--lrs``, ``--sweep-minutes`` each); the
  final run uses the value with the lowest final validation bpb.
* Validation every ``--eval-every-s`` seconds of the clock, in bits per byte of source text:
  summed next-token NLL / (ln 2 x UTF-8 bytes of the text the targets cover).
* Code ability: each final checkpoint samples HumanEval-X C++ completions (greedy, and
  ``--he-n`` at ``--he-temperature``) through the batching engine on its GPU; the sandboxed
  verifier scores them (on this machine if it has the Boost/OpenSSL toolchain, else later
  with ``--phases score report``).

Phases (``--phases``, default all): ``sweep final sample score report``. Outputs under
``--out``: ``quality.json``, ``quality.png`` (bpb against GPU-seconds and against tokens),
``sweep.json`` / ``sweep.png``, ``runs/<phase>/<candidate>/...`` (each run's config, metrics,
receipt and log), ``humaneval/<candidate>/`` (completions, verdicts, summaries, receipts),
``examples.md`` (a few completions per model), ``receipt.json`` (kind ``bench``) and
``command.txt``. Run directories (with the final checkpoints) live under ``--work``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tarfile
import time
from collections import deque
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from megacpp.errors import MegaCppError

PHASES = ("sweep", "final", "sample", "score", "report")
DEFAULT_CANDIDATES = (
    "nam56r-350m=nam56r-350m",
    "dense-350m=dense-350m",
    "dense-150m=dense-150m",
    "nam56r-dense-150m=nam56r-dense-150m",
)
DEFAULT_GOAL = "nam56r-350m:dense-350m,dense-150m"
MIN_SAMPLE_S = 120.0  # --deadline-s: sampling is not started with less left
MIN_SCORE_S = 40.0
CLOCK_NOTE = ("clock = seconds since the training process started (imports, setup, "
              "compilation, warm-up and CUDA-graph capture counted), less validation and "
              "checkpoint time")


@dataclass(frozen=True)
class Candidate:
    name: str
    preset: str
    overrides: tuple[str, ...] = ()  # TABLE.KEY=VALUE, applied after the common settings

    @classmethod
    def parse(cls, text: str) -> Candidate:
        """``NAME=PRESET [TABLE.KEY=VALUE ...]`` (space separated)."""
        head, *overrides = shlex.split(text)
        name, sep, preset = head.partition("=")
        if not sep or not name or not preset or not name.replace("-", "").replace("_", "").replace(
                ".", "").isalnum():
            raise MegaCppError(f"--candidate {text!r}: expected NAME=PRESET [TABLE.KEY=VALUE ...] "
                               "with NAME of letters, digits, '-', '_' and '.'")
        bad = [o for o in overrides if "=" not in o or "." not in o.partition("=")[0]]
        if bad:
            raise MegaCppError(f"--candidate {text!r}: overrides must be TABLE.KEY=VALUE, got {bad}")
        return cls(name, preset, tuple(overrides))


@dataclass
class Job:
    phase: str
    candidate: Candidate
    lr: float
    budget_s: float
    run_dir: Path
    config_path: Path
    log_path: Path
    returncode: int | None = None
    wall_s: float = 0.0
    slot: str = ""


@dataclass
class Settings:
    """Everything a run shares (recorded in quality.json)."""

    data: str
    device: str
    minutes: float
    sweep_minutes: float
    lrs: list[float]
    eval_every_s: float
    micro_batch: int
    val_batches: int
    warmup_steps: int
    schedule: str
    min_lr_ratio: float
    steps_cap: int
    seed: int
    goal: str = DEFAULT_GOAL
    extra: list[str] = field(default_factory=list)


# ---- run configs ---------------------------------------------------------------------------


def run_config(settings: Settings, cand: Candidate, lr: float, budget_s: float, run_dir: Path,
               *, final: bool) -> dict[str, Any]:
    """The ``megacpp train`` config (as TOML data) of one run."""
    from megacpp.train.config import apply_override

    cuda = settings.device == "cuda"
    config: dict[str, Any] = {
        "run": {"name": run_dir.name, "out_dir": str(run_dir), "seed": settings.seed,
                "device": settings.device, "check_site_integrity": False, "plots": False},
        "model": {"preset": cand.preset, "vocab_size": "dataset"},
        "data": {"dir": settings.data, "val_batches": settings.val_batches,
                 "num_workers": 2 if cuda else 0},
        "train": {"steps": settings.steps_cap, "micro_batch_size": settings.micro_batch,
                  "grad_accum_steps": 1, "eval_every": 0, "time_budget_s": budget_s,
                  "eval_every_s": settings.eval_every_s if final else 0.0},
        "optim": {"lr": lr},
        "schedule": {"kind": settings.schedule, "warmup_steps": settings.warmup_steps,
                     "min_lr_ratio": settings.min_lr_ratio},
        "parallel": {"strategy": "single", "compile": cuda, "cuda_graph": cuda},
        "checkpoint": {"every": 0, "keep_last": 1, "final": final},
    }
    for item in [*settings.extra, *cand.overrides]:
        apply_override(config, item)
    return config


def check_config(config: dict[str, Any], where: str) -> None:
    """Validate a run config here, before any GPU time is spent on it."""
    from megacpp.train.config import RunConfig

    try:
        RunConfig.from_dict(json.loads(json.dumps(config)), name=where)
    except MegaCppError as exc:
        raise MegaCppError(f"{where}: {exc}") from None


def make_jobs(phase: str, settings: Settings, work: Path, plan: list[tuple[Candidate, float]],
              budget_s: float) -> list[Job]:
    from megacpp.train.config import to_toml

    jobs = []
    for cand, lr in plan:
        run_dir = work / phase / cand.name / (f"lr{lr:g}" if phase == "sweep" else "run")
        if run_dir.exists():
            shutil.rmtree(run_dir)  # a benchmark run starts clean (an earlier try's leftovers)
        run_dir.mkdir(parents=True)
        config = run_config(settings, cand, lr, budget_s, run_dir, final=phase == "final")
        check_config(config, f"{phase} run of {cand.name} (lr {lr:g})")
        config_path = run_dir.parent / f"{run_dir.name}.toml"
        config_path.write_text(to_toml(config, header=f"quality {phase}: {cand.name}, lr {lr:g}"))
        jobs.append(Job(phase, cand, lr, budget_s, run_dir, config_path,
                        run_dir.parent / f"{run_dir.name}.log"))
    return jobs


# ---- running jobs side by side -------------------------------------------------------------


def slots_for(device: str, gpus: int | None, parallel: int) -> list[str]:
    """Slot names: ``cpuN`` on the CPU; on CUDA the first ``gpus`` devices this process may
    see, named as ``CUDA_VISIBLE_DEVICES`` names them (so ``CUDA_VISIBLE_DEVICES=2,3`` runs
    the jobs on GPUs 2 and 3, not 0 and 1)."""
    if device == "cpu":
        return [f"cpu{i}" for i in range(parallel)]
    import torch

    count = torch.cuda.device_count()
    if count == 0:
        raise MegaCppError("--device cuda: no CUDA device here (use --device cpu)")
    n = count if gpus is None else gpus
    if not 1 <= n <= count:
        raise MegaCppError(f"--gpus {n}: this machine has {count} CUDA device(s)")
    visible = [v.strip() for v in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")
               if v.strip()]
    return visible[:n] if len(visible) >= n else [str(i) for i in range(n)]


def job_env(slot: str, device: str, kernels: str) -> dict[str, str]:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "COLUMNS": "200", "PYTHONPATH": os.pathsep.join(
        [str(ROOT / "src"), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))])}
    if device == "cuda":
        env["CUDA_VISIBLE_DEVICES"] = slot
        env["MEGACPP_KERNELS"] = kernels
    else:
        env["OMP_NUM_THREADS"] = env.get("OMP_NUM_THREADS", "1")
    return env


def run_side_by_side(jobs: list[Job], slots: list[str], device: str, grace_s: float,
                     command: Any, log: Any, kernels: str = "fast") -> None:
    """Run ``jobs`` with at most one per slot (GPU); each is killed if it outlives its budget
    plus ``grace_s``. ``command(job)`` gives the argv; ``kernels``, MEGACPP_KERNELS on a GPU
    (training: ``fast``, which CUDA graphs of MoE models need; sampling: ``auto``, since not
    every surface has a fast decode kernel)."""
    queue = deque(jobs)
    running: dict[str, tuple[Job, subprocess.Popen, float, Any]] = {}
    while queue or running:
        for slot in slots:
            if slot not in running and queue:
                job = queue.popleft()
                job.slot = slot
                out = open(job.log_path, "w")  # noqa: SIM115 -- closed when the job ends
                proc = subprocess.Popen(command(job), stdout=out, stderr=subprocess.STDOUT,
                                        env=job_env(slot, device, kernels), cwd=ROOT,
                                        start_new_session=True)
                running[slot] = (job, proc, time.monotonic(), out)
                log(f"[{slot}] start {job.phase} {job.candidate.name} lr {job.lr:g} "
                    f"(budget {job.budget_s:.0f} s)")
        time.sleep(0.2)
        for slot, (job, proc, started, out) in list(running.items()):
            elapsed = time.monotonic() - started
            if proc.poll() is None and elapsed > job.budget_s + grace_s:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                log(f"[{slot}] killed {job.candidate.name}: past its budget + {grace_s:.0f} s")
            if proc.poll() is not None:
                job.returncode, job.wall_s = proc.returncode, elapsed
                out.close()
                del running[slot]
                log(f"[{slot}] done {job.phase} {job.candidate.name} lr {job.lr:g}: exit "
                    f"{job.returncode} after {elapsed:.0f} s")


def train_command(job: Job) -> list[str]:
    return [sys.executable, "-m", "megacpp", "train", "--config", str(job.config_path),
            "--no-progress"]


# ---- reading runs --------------------------------------------------------------------------


def read_run(run_dir: Path) -> dict[str, Any]:
    """A run's outcome: status, final figures, the validation curve."""
    from megacpp.receipts import read_receipt

    result: dict[str, Any] = {"status": "missing", "curve": []}
    metrics_path = run_dir / "metrics.jsonl"
    if metrics_path.is_file():
        records = [json.loads(line) for line in metrics_path.read_text().splitlines()
                   if line.strip()]
        result["curve"] = [
            {k: r.get(k) for k in ("step", "tokens", "clock_s", "val_bpb", "val_loss",
                                   "val_tokens", "val_bytes")}
            for r in records if r.get("type") == "val" and r.get("val_bpb") is not None]
        steps = [r for r in records if r.get("type") == "train"]
        if steps:
            result["last_train_loss"] = steps[-1]["loss"]
            if steps[0].get("clock_s") is not None:  # when the first step began: the
                # startup (imports, setup) plus the first step's compile
                result["first_step_clock_s"] = steps[0]["clock_s"] - steps[0]["time_s"]
                result["first_step_s"] = steps[0]["time_s"]  # mostly compilation
                steady = steps[len(steps) // 2:]  # tokens/s of the second half: compiled
                span = steady[-1]["clock_s"] - steady[0]["clock_s"] + steady[0]["time_s"]
                result["steady_tokens_per_s"] = (
                    (steady[-1]["tokens"] - steady[0]["tokens"] + steps[0]["tokens"]) / span
                    if span > 0 else None)
    receipt_path = run_dir / "receipt.json"
    if receipt_path.is_file():
        receipt = read_receipt(receipt_path)
        m = receipt.metrics
        outcome = receipt.config.get("outcome", {})
        result["status"] = outcome.get("status", "unknown")
        result["error"] = outcome.get("error")
        for key in ("steps", "tokens", "tokens_per_s", "clock_s", "startup_s", "final_val_bpb",
                    "final_val_loss", "final_loss", "params", "active_params",
                    "train_flops_per_token", "peak_mem_bytes", "mfu", "wall_s"):
            if key in m:
                result[key] = m[key]
        result["kernels"] = receipt.kernels
    if result["status"] == "missing" and result["curve"]:
        # stopped (killed past its budget + grace, or crashed) before its receipt: the curve
        # up to there is real, its last point is not a final figure at equal time
        last = result["curve"][-1]
        result.update(status="stopped", last_val_bpb=last["val_bpb"], last_clock_s=last["clock_s"],
                      last_step=last["step"])
    bpb = result.get("final_val_bpb")
    if result["status"] == "completed" and (bpb is None or not math.isfinite(bpb)):
        result["status"] = "no-validation"
    return result


def keep_run_files(job: Job, out: Path) -> Path:
    """Copy a run's small files (config, metrics, receipt, log) into the results."""
    dest = out / "runs" / job.phase / job.candidate.name
    if job.phase == "sweep":
        dest = dest / f"lr{job.lr:g}"
    dest.mkdir(parents=True, exist_ok=True)
    for src, name in ((job.run_dir / "config.toml", "config.toml"),
                      (job.run_dir / "metrics.jsonl", "metrics.jsonl"),
                      (job.run_dir / "receipt.json", "receipt.json"),
                      (job.log_path, "train.log")):
        if src.is_file():
            shutil.copyfile(src, dest / name)
    return dest


# ---- phases --------------------------------------------------------------------------------


def phase_sweep(args, settings: Settings, candidates: list[Candidate], slots, log) -> dict:
    plan = [(c, lr) for lr in settings.lrs for c in candidates]  # one candidate per slot first
    jobs = make_jobs("sweep", settings, args.work, plan, settings.sweep_minutes * 60)
    run_side_by_side(jobs, slots, settings.device, args.grace_s, train_command, log)
    sweep: dict[str, Any] = {"budget_s": settings.sweep_minutes * 60, "lrs": settings.lrs,
                             "candidates": {}}
    for job in jobs:
        keep_run_files(job, args.out)
        result = read_run(job.run_dir)
        entry = sweep["candidates"].setdefault(job.candidate.name, {"runs": {}})
        entry["runs"][f"{job.lr:g}"] = {
            k: result.get(k) for k in ("status", "final_val_bpb", "steps", "tokens",
                                       "clock_s", "startup_s", "error")}
    for name, entry in sweep["candidates"].items():
        ok = [(r["final_val_bpb"], float(lr)) for lr, r in entry["runs"].items()
              if r["status"] == "completed" and r["final_val_bpb"] is not None]
        entry["best_lr"] = min(ok)[1] if ok else None
        entry["at_grid_edge"] = bool(ok) and entry["best_lr"] in (min(settings.lrs),
                                                                    max(settings.lrs))
        log(f"sweep {name}: " + ", ".join(
            f"lr {lr}: {_fmt(r['final_val_bpb'])} ({r['status']})"
            for lr, r in entry["runs"].items()) + f" -> best {entry['best_lr']}")
    _write_json(args.out / "sweep.json", sweep)
    for job in jobs:  # sweep runs write no checkpoint; their directories are not needed
        shutil.rmtree(job.run_dir, ignore_errors=True)
    return sweep


def chosen_lrs(args, candidates: list[Candidate], sweep: dict | None) -> dict[str, float]:
    """The learning rate of each final run: --lr NAME=VALUE, else the sweep's best."""
    chosen: dict[str, float] = {}
    for item in args.lr:
        name, _, value = item.partition("=")
        chosen[name] = float(value)
    if sweep is None and (args.out / "sweep.json").is_file():
        sweep = json.loads((args.out / "sweep.json").read_text())
    if sweep is None and args.sweep_json:
        if not Path(args.sweep_json).is_file():
            raise MegaCppError(f"--sweep-json {args.sweep_json}: no such file")
        sweep = json.loads(Path(args.sweep_json).read_text())
        _write_json(args.out / "sweep.json", sweep)  # the report shows the sweep it used
    for cand in candidates:
        if cand.name in chosen:
            continue
        best = ((sweep or {}).get("candidates", {}).get(cand.name) or {}).get("best_lr")
        if best is None:
            raise MegaCppError(
                f"no learning rate for {cand.name}: run the sweep phase, pass --sweep-json "
                f"(an earlier sweep.json) or --lr {cand.name}=VALUE")
        chosen[cand.name] = float(best)
    return chosen


def phase_final(args, settings: Settings, candidates: list[Candidate], slots, lrs, log) -> None:
    plan = [(c, lrs[c.name]) for c in candidates]
    jobs = make_jobs("final", settings, args.work, plan, settings.minutes * 60)
    run_side_by_side(jobs, slots, settings.device, args.grace_s, train_command, log)
    for job in jobs:
        keep_run_files(job, args.out)


def sample_command(args, settings: Settings):
    def command(job: Job) -> list[str]:
        return [sys.executable, str(Path(__file__).resolve()), "_sample", "--run",
                str(job.run_dir), "--out", str(args.out / "humaneval" / job.candidate.name),
                "--device", settings.device, "--n", str(args.he_n),
                "--temperature", str(args.he_temperature), "--top-p", str(args.he_top_p),
                "--max-new-tokens", str(args.he_max_new_tokens),
                "--max-num-seqs", str(args.he_max_num_seqs),
                *(["--limit", str(args.he_limit)] if args.he_limit else []),
                *(["--problems", str(args.problems)] if args.problems else [])]
    return command


def phase_sample(args, settings: Settings, candidates: list[Candidate], slots, log) -> None:
    jobs = []
    for cand in candidates:
        run_dir = args.work / "final" / cand.name / "run"
        if not (run_dir / "checkpoints").is_dir():
            log(f"sample {cand.name}: no final checkpoint in {run_dir}; skipped")
            continue
        (args.out / "humaneval" / cand.name).mkdir(parents=True, exist_ok=True)
        jobs.append(Job("sample", cand, 0.0, args.sample_budget_s, run_dir, Path(),
                        args.out / "humaneval" / cand.name / "sample.log"))
    run_side_by_side(jobs, slots, settings.device, 0.0, sample_command(args, settings), log,
                     kernels="auto")


def phase_score(args, candidates: list[Candidate], log) -> None:
    from megacpp.eval import (
        CppVerifier,
        Sandbox,
        evaluate_samples,
        humaneval_build_options,
        load_problems,
        locate_problems,
        read_samples,
    )
    from megacpp.eval.problems import check_humaneval_toolchain

    try:
        verifier = CppVerifier(humaneval_build_options(), Sandbox(None))
        check_humaneval_toolchain(verifier)
    except MegaCppError as exc:
        log(f"score: deferred, this machine cannot verify HumanEval-X ({exc}); run "
            f"`python benchmarks/quality.py --out {args.out} --phases score report` where it can")
        return
    problem_file = locate_problems(args.problems)
    problems = load_problems(problem_file)
    workers = args.score_workers or os.cpu_count() or 1
    for cand in candidates:
        folder = args.out / "humaneval" / cand.name
        meta_path = folder / "sampling.json"
        if not meta_path.is_file():
            log(f"score {cand.name}: no samples ({meta_path} missing)")
            continue
        meta = json.loads(meta_path.read_text())
        if not meta.get("complete", True):
            log(f"score {cand.name}: sampling stopped early; scoring the problems it finished "
                f"({meta.get('problems_done')} of {meta.get('problems')})")
        for kind, ks in (("greedy", (1,)), ("sampled", (1, 10))):
            if not (folder / f"{kind}.jsonl").read_text().strip():
                log(f"score {cand.name} {kind}: no finished problem")
                continue
            samples = read_samples(folder / f"{kind}.jsonl")
            n = meta[kind]["n"]
            report = evaluate_samples(
                problems, samples, verifier=verifier, out_dir=folder / kind,
                model={"name": cand.name, "checkpoint": meta.get("checkpoint")},
                sampling=meta[kind], ks=[k for k in ks if k <= n], workers=workers,
                problem_file=problem_file, kernels=meta.get("kernels"))
            log(f"score {cand.name} {kind}: " + ", ".join(
                f"pass@{k} {v:.4f}" for k, v in report.pass_at_k.items())
                + f" ({report.status_counts})")


def phase_report(args, settings: Settings, candidates: list[Candidate], goal: str,
                 started: float, log) -> dict[str, Any]:
    sweep_path = args.out / "sweep.json"
    sweep = json.loads(sweep_path.read_text()) if sweep_path.is_file() else None
    report: dict[str, Any] = {
        "benchmark": "quality",
        "settings": asdict(settings),
        "clock": CLOCK_NOTE,
        "warmup_and_compile_counted": True,
        "dataset": _read_json(args.out / "dataset.json"),
        "candidates": {},
    }
    for cand in candidates:
        final = read_run(args.work / "final" / cand.name / "run") if (
            args.work / "final" / cand.name / "run").is_dir() else _read_kept(args.out, cand)
        entry = {"preset": cand.preset, "overrides": list(cand.overrides),
                 "lr": None, "sweep": None, "final": final,
                 "humaneval": humaneval_summary(args.out / "humaneval" / cand.name)}
        if sweep and cand.name in sweep["candidates"]:
            entry["sweep"] = sweep["candidates"][cand.name]
            entry["lr"] = sweep["candidates"][cand.name].get("best_lr")
        config_path = args.out / "runs" / "final" / cand.name / "config.toml"
        if config_path.is_file():
            import tomllib

            entry["lr"] = tomllib.loads(config_path.read_text())["optim"]["lr"]
        report["candidates"][cand.name] = entry
    report["goal"] = goal_verdict(report["candidates"], goal)
    report["wall_s"] = time.monotonic() - started
    _write_json(args.out / "quality.json", report)
    plot_curves(report, args.out / "quality.png")
    if sweep:
        plot_sweep(sweep, args.out / "sweep.png")
    write_examples(args.out, candidates)
    print_table(report, log)
    write_bench_receipt(args.out, report)
    return report


def _read_kept(out: Path, cand: Candidate) -> dict[str, Any]:
    """A final run's outcome from the files kept in the results (work dir gone)."""
    kept = out / "runs" / "final" / cand.name
    return read_run(kept) if kept.is_dir() else {"status": "missing", "curve": []}


def dataset_summary(data: Path) -> dict[str, Any]:
    manifest_path = data / "manifest.json"
    if not manifest_path.is_file():
        return {"dir": str(data), "manifest": None}
    manifest = json.loads(manifest_path.read_text())
    splits = manifest["splits"]
    split_stage = next((s for s in manifest["stages"] if s["name"] == "split"), {})
    return {
        "dir": str(data),
        "seq_len": manifest["seq_len"],
        "tokenizer_sha256": manifest["tokenizer"]["sha256"],
        "vocab_size": manifest["tokenizer"]["vocab_size"],
        "sources": manifest["sources"],
        "val_sources": manifest["config"]["packing"].get("val_sources", []),
        "train": {k: splits["train"][k] for k in ("documents", "tokens", "bytes", "rows")},
        "validation": {k: splits["validation"][k] for k in ("documents", "tokens", "bytes",
                                                              "rows")},
        "split_notes": split_stage.get("notes", {}),
    }


def humaneval_summary(folder: Path) -> dict[str, Any] | None:
    meta_path = folder / "sampling.json"
    if not meta_path.is_file():
        return None
    meta = json.loads(meta_path.read_text())
    out: dict[str, Any] = {"sampling": {k: meta[k] for k in ("greedy", "sampled")},
                           "complete": meta.get("complete"),
                           "problems_done": meta.get("problems_done"),
                           "sampling_wall_s": meta.get("wall_s"),
                           "generated_tokens": meta.get("generated_tokens"), "scored": False}
    for kind in ("greedy", "sampled"):
        summary_path = folder / kind / "summary.json"
        if summary_path.is_file():
            summary = json.loads(summary_path.read_text())
            out[kind] = {"pass_at_k": summary["pass_at_k"],
                         "status_counts": summary["status_counts"]}
            out["scored"] = True
    return out


def goal_verdict(candidates: dict[str, Any], goal: str) -> dict[str, Any]:
    """Whether the hybrid's final validation bpb is below every dense model's, at equal GPU
    time (each run's last validation, at the end of the same time budget)."""
    hybrid, _, dense_text = goal.partition(":")
    dense = [d for d in dense_text.split(",") if d]
    names = [hybrid, *dense]
    missing = [n for n in names if n not in candidates]
    if missing:
        return {"hybrid": hybrid, "dense": dense, "met": None,
                "statement": f"not evaluated: {', '.join(missing)} not among the candidates"}
    bpb = {n: candidates[n]["final"].get("final_val_bpb") for n in names}
    failed = [n for n in names if candidates[n]["final"].get("status") != "completed"
              or bpb[n] is None]
    if failed:
        return {"hybrid": hybrid, "dense": dense, "met": None, "final_val_bpb": bpb,
                "statement": f"not evaluated: {', '.join(failed)} did not complete"}
    met = all(bpb[hybrid] < bpb[d] for d in dense)
    best_dense = min(dense, key=lambda d: bpb[d])
    margin = bpb[best_dense] - bpb[hybrid]
    statement = (f"{hybrid} reaches {bpb[hybrid]:.4f} bits/byte; the best dense model "
                 f"({best_dense}) {bpb[best_dense]:.4f}: the goal is "
                 f"{'MET' if met else 'NOT met'} (the hybrid {abs(margin):.4f} bits/byte "
                 f"{'lower' if margin >= 0 else 'higher'})")
    return {"hybrid": hybrid, "dense": dense, "met": met, "final_val_bpb": bpb,
            "margin_bpb": margin, "statement": statement}


# ---- outputs -------------------------------------------------------------------------------


def plot_curves(report: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_t, ax_n) = plt.subplots(1, 2, figsize=(13, 5), sharey=True)
    for name, entry in report["candidates"].items():
        curve = entry["final"].get("curve") or []
        if not curve:
            continue
        label = f"{name} (lr {entry['lr']:g})" if entry.get("lr") else name
        ax_t.plot([p["clock_s"] for p in curve], [p["val_bpb"] for p in curve], marker="o",
                  markersize=3, label=label)
        ax_n.plot([p["tokens"] / 1e6 for p in curve], [p["val_bpb"] for p in curve],
                  marker="o", markersize=3, label=label)
    ax_t.set_xlabel(f"{'GPU' if report['settings']['device'] == 'cuda' else 'CPU'}-seconds "
                    "on the run's clock (compile and warm-up counted)")
    ax_n.set_xlabel("training tokens (millions)")
    ax_t.set_ylabel("validation bits per byte")
    for ax in (ax_t, ax_n):
        ax.grid(alpha=0.3)
    ax_t.legend()
    minutes = report["settings"]["minutes"]
    fig.suptitle(f"quality at equal GPU time ({minutes:g} min per candidate, one GPU each)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_sweep(sweep: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    for name, entry in sweep["candidates"].items():
        points = sorted((float(lr), r["final_val_bpb"]) for lr, r in entry["runs"].items()
                        if r["final_val_bpb"] is not None)
        if points:
            ax.plot(*zip(*points), marker="o", label=name)
    ax.set_xscale("log")
    ax.set_xlabel("peak learning rate")
    ax.set_ylabel("final validation bits per byte")
    ax.set_title(f"learning-rate sweep ({sweep['budget_s']:.0f} s per run)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_examples(out: Path, candidates: list[Candidate], per_model: int = 3) -> None:
    """A few greedy completions per model, with their verdicts where scored."""
    lines = ["# HumanEval-X C++ completions (greedy, the first problems)", ""]
    for cand in candidates:
        folder = out / "humaneval" / cand.name
        source = folder / "greedy" / "samples.jsonl"
        if not source.is_file():
            source = folder / "greedy.jsonl"
        if not source.is_file():
            continue
        lines += [f"## {cand.name}", ""]
        rows = [json.loads(line) for line in source.read_text().splitlines()[:per_model]]
        for row in rows:
            verdict = f" -- {row['status']}" if "status" in row else " -- not scored"
            lines += [f"### {row['task_id']}{verdict}", "", "```cpp",
                      row["completion"].rstrip(), "```", ""]
    (out / "examples.md").write_text("\n".join(lines) + "\n")


def print_table(report: dict[str, Any], log) -> None:
    log(f"{'candidate':<22} {'lr':>8} {'params':>8} {'active':>8} {'steps':>7} {'tokens':>8} "
        f"{'clock s':>8} {'setup s':>7} {'step1 s':>7} {'tok/s':>7} {'val bpb':>8} "
        f"{'pass@1 g':>8} {'pass@1':>7} {'pass@10':>7}")
    for name, entry in report["candidates"].items():
        final, he = entry["final"], entry["humaneval"] or {}
        greedy = (he.get("greedy") or {}).get("pass_at_k", {})
        sampled = (he.get("sampled") or {}).get("pass_at_k", {})
        log(f"{name:<22} {_fmt(entry['lr'], '.2g'):>8} {_millions(final.get('params')):>8} "
            f"{_millions(final.get('active_params')):>8} {_fmt(final.get('steps'), '.0f'):>7} "
            f"{_millions(final.get('tokens')):>8} {_fmt(final.get('clock_s'), '.0f'):>8} "
            f"{_fmt(final.get('first_step_clock_s'), '.0f'):>7} "
            f"{_fmt(final.get('first_step_s'), '.0f'):>7} "
            f"{_fmt(final.get('steady_tokens_per_s'), '.0f'):>7} "
            f"{_fmt(final.get('final_val_bpb', final.get('last_val_bpb'))):>8} "
            f"{_fmt(greedy.get('pass@1')):>8} {_fmt(sampled.get('pass@1')):>7} "
            f"{_fmt(sampled.get('pass@10')):>7}  {final.get('status')}")
    log(f"goal: {report['goal']['statement']}")


def write_bench_receipt(out: Path, report: dict[str, Any]) -> None:
    from megacpp.receipts import write_receipt

    metrics: dict[str, float] = {}
    for name, entry in report["candidates"].items():
        final = entry["final"]
        for key in ("final_val_bpb", "tokens", "steps", "clock_s", "startup_s", "tokens_per_s"):
            value = final.get(key)
            if isinstance(value, (int, float)) and math.isfinite(value):
                metrics[f"{name}.{key}"] = float(value)
        for kind in ("greedy", "sampled"):
            for k, value in ((entry["humaneval"] or {}).get(kind) or {}).get("pass_at_k",
                                                                           {}).items():
                metrics[f"{name}.{kind}.{k}"] = float(value)
    if report["goal"]["met"] is not None:
        metrics["goal_met"] = float(report["goal"]["met"])
    artifacts = [p for p in (out / "quality.json", out / "quality.png", out / "sweep.json",
                             out / "command.txt") if p.is_file()]
    config = {"benchmark": "quality", "settings": report["settings"], "clock": CLOCK_NOTE,
              "candidates": {n: {"preset": e["preset"], "overrides": e["overrides"],
                                 "lr": e["lr"]} for n, e in report["candidates"].items()},
              "goal": report["goal"]["statement"]}
    write_receipt(out / "receipt.json", "bench", config, metrics, artifacts)


def bundle(out: Path, path: Path, work: Path) -> None:
    """One tar.gz of the results (the device returns few files), without the run
    directories of ``work`` (checkpoints)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    skip = {work.resolve(), path.resolve()}

    def keep(info: tarfile.TarInfo) -> tarfile.TarInfo | None:
        return None if (out.parent / info.name).resolve() in skip else info

    with tarfile.open(path, "w:gz") as tar:
        tar.add(out, arcname=out.name, filter=keep)


def _write_json(path: Path, data: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1, default=str) + "\n")


def _read_json(path: Path) -> Any:
    return json.loads(path.read_text()) if path.is_file() else None


def _fmt(value: Any, spec: str = ".4f") -> str:
    return "-" if value is None else format(value, spec)


def _millions(value: Any) -> str:
    return "-" if value is None else f"{value / 1e6:.{1 if value >= 1e7 else 2}f}M"


# ---- the sampling worker (one process per GPU) ---------------------------------------------


def sample_main(argv: list[str]) -> None:
    """``quality.py _sample``: HumanEval-X completions of one checkpoint through the engine:
    greedy (n = 1) and ``--n`` samples at ``--temperature``; writes greedy.jsonl,
    sampled.jsonl and sampling.json into ``--out``."""
    ap = argparse.ArgumentParser(prog="quality.py _sample")
    ap.add_argument("--run", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--n", type=int, default=20)
    ap.add_argument("--temperature", type=float, default=0.8)
    ap.add_argument("--top-p", type=float, default=0.95)
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--max-num-seqs", type=int, default=128)
    ap.add_argument("--limit", type=int, default=None)
    ap.add_argument("--problems", type=Path, default=None)
    args = ap.parse_args(argv)

    import torch

    from megacpp.cli._checkpoint import load_for_inference
    from megacpp.eval import load_problems, select_problems
    from megacpp.infer.batch import BatchRequest, run_batch
    from megacpp.infer.engine import Engine, EngineConfig
    from megacpp.infer.generate import CPP_BODY_STOP
    from megacpp.infer.sampling import SamplingParams

    started = time.monotonic()
    problems = select_problems(load_problems(args.problems), (), args.limit)
    model, tok, ckpt = load_for_inference(args.run, None, args.device)
    prompt_lens = [len(tok.encode(p.prompt)) + 1 for p in problems]
    config = EngineConfig(max_num_seqs=args.max_num_seqs,
                          max_model_len=max(prompt_lens) + args.max_new_tokens + 1,
                          prefill_chunk=8192, max_waiting=4 * args.max_num_seqs)
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    engine = Engine(model, tok, config, device=args.device, dtype=dtype)
    greedy = SamplingParams(temperature=0.0, max_new_tokens=args.max_new_tokens,
                            stop=(CPP_BODY_STOP,))
    requests = [BatchRequest(f"g|{p.task_id}|0", p.prompt, greedy) for p in problems]
    for i, p in enumerate(problems):
        for j in range(args.n):
            params = SamplingParams(temperature=args.temperature, top_p=args.top_p,
                                    max_new_tokens=args.max_new_tokens, stop=(CPP_BODY_STOP,),
                                    seed=1000 * i + j)
            requests.append(BatchRequest(f"s|{p.task_id}|{j}", p.prompt, params))
    done = [0]

    def progress(_rid, _result) -> None:
        done[0] += 1
        if done[0] % 500 == 0 or done[0] == len(requests):
            print(f"{done[0]}/{len(requests)} completions, {time.monotonic() - started:.0f} s",
                  flush=True)

    # in waves of max_num_seqs requests (a problem's samples together): each wave's prompts
    # are prefilled together once, then every decode step is a full batch until the wave's
    # longest completion ends; feeding requests as slots free up would instead put a small
    # eager prefill into most decode steps. The files are rewritten after every wave, so a
    # process stopped by its time limit leaves the problems it finished.
    args.out.mkdir(parents=True, exist_ok=True)
    results: dict[str, Any] = {}
    meta: dict[str, Any] = {}
    for start in range(0, len(requests), args.max_num_seqs):
        results.update(run_batch(engine, requests[start:start + args.max_num_seqs],
                                 on_finish=progress))
        meta = write_samples(args, requests, results, problems, config, dtype, ckpt, started)
    print(f"sampled {len(requests)} completions ({meta['generated_tokens']:,} tokens) in "
          f"{meta['wall_s']:.0f} s", flush=True)


def write_samples(args, requests, results, problems, config, dtype, ckpt, started) -> dict:
    """greedy.jsonl and sampled.jsonl with every problem whose completions are all done, and
    sampling.json (``complete``: every problem of both kinds)."""
    from megacpp.infer.generate import CPP_BODY_STOP
    from megacpp.kernels.runtime import chosen_kernels

    counts = {}
    for kind, prefix, n in (("greedy", "g", 1), ("sampled", "s", args.n)):
        lines, done = [], 0
        for problem in problems:
            ids = [f"{prefix}|{problem.task_id}|{j}" for j in range(n)]
            if all(i in results for i in ids):
                done += 1
                lines += [json.dumps({"task_id": problem.task_id,
                                      "completion": results[i].function_body(),
                                      "finish_reason": results[i].finish_reason,
                                      "completion_tokens": results[i].completion_tokens})
                          for i in ids]
        (args.out / f"{kind}.jsonl").write_text("".join(line + "\n" for line in lines))
        counts[kind] = done
    meta = {
        "checkpoint": str(ckpt), "problems": len(problems),
        "problems_done": counts, "complete": all(v == len(problems) for v in counts.values()),
        "greedy": {"n": 1, "temperature": 0.0, "max_new_tokens": args.max_new_tokens},
        "sampled": {"n": args.n, "temperature": args.temperature, "top_p": args.top_p,
                    "max_new_tokens": args.max_new_tokens, "seeds": "1000 * problem + sample"},
        "stop": CPP_BODY_STOP, "engine": asdict(config), "dtype": str(dtype),
        "generated_tokens": sum(r.completion_tokens for r in results.values()),
        "wall_s": time.monotonic() - started,
        "finish_reasons": {r: sum(x.finish_reason == r for x in results.values())
                           for r in ("stop", "eos", "length")},
        "kernels": chosen_kernels(),
    }
    _write_json(args.out / "sampling.json", meta)
    return meta


# ---- main ----------------------------------------------------------------------------------


def parse_args(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", type=Path, help="a `megacpp data build` output (the corpus)")
    ap.add_argument("--out", type=Path, required=True, help="results directory")
    ap.add_argument("--work", type=Path, default=None,
                    help="run directories with checkpoints (default OUT/work)")
    ap.add_argument("--phases", nargs="+", default=list(PHASES), choices=PHASES)
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--gpus", type=int, default=None, help="GPUs to use (default: all)")
    ap.add_argument("--parallel", type=int, default=1, help="--device cpu: runs at a time")
    ap.add_argument("--candidate", action="append", default=[],
                    help="NAME=PRESET [TABLE.KEY=VALUE ...] (repeatable; default: the four "
                         "candidates of docs/quality.md)")
    ap.add_argument("--only", nargs="+", default=None, help="run only these candidates")
    ap.add_argument("--goal", default=None,
                    help=f"HYBRID:DENSE1,DENSE2 -- the hybrid must beat every dense model "
                         f"(default {DEFAULT_GOAL})")
    ap.add_argument("--minutes", type=float, default=3.0, help="GPU time per final run")
    ap.add_argument("--sweep-minutes", type=float, default=None,
                    help="GPU time per sweep run (default: half of --minutes)")
    ap.add_argument("--lrs", type=float, nargs="+", default=[1.5e-3, 3e-3, 6e-3])
    ap.add_argument("--lr", action="append", default=[], metavar="NAME=VALUE",
                    help="the final run's lr for a candidate (skips its sweep result)")
    ap.add_argument("--sweep-json", type=Path, default=None,
                    help="an earlier sweep.json, when this invocation has no sweep phase")
    ap.add_argument("--eval-every-s", type=float, default=None,
                    help="validation interval on the clock (default: --minutes * 6, i.e. "
                         "10 points per run)")
    ap.add_argument("--micro-batch", type=int, default=8, help="rows per step")
    ap.add_argument("--val-batches", type=int, default=16,
                    help="validation batches (of --micro-batch rows) per evaluation")
    ap.add_argument("--warmup-steps", type=int, default=50)
    ap.add_argument("--schedule", default="cosine", choices=("cosine", "wsd", "constant"))
    ap.add_argument("--min-lr-ratio", type=float, default=0.1)
    ap.add_argument("--steps-cap", type=int, default=10_000_000,
                    help="train.steps: a cap; the time budget ends the runs")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--set", action="append", default=[], dest="extra",
                    metavar="TABLE.KEY=VALUE", help="override for every run (repeatable)")
    ap.add_argument("--grace-s", type=float, default=300.0,
                    help="a run still alive this long after its budget is killed")
    ap.add_argument("--he-n", type=int, default=20)
    ap.add_argument("--he-temperature", type=float, default=0.8)
    ap.add_argument("--he-top-p", type=float, default=0.95)
    ap.add_argument("--he-max-new-tokens", type=int, default=256)
    ap.add_argument("--he-max-num-seqs", type=int, default=128)
    ap.add_argument("--he-limit", type=int, default=None, help="only the first N problems")
    ap.add_argument("--problems", type=Path, default=None, help="HumanEval-X C++ jsonl.gz")
    ap.add_argument("--sample-budget-s", type=float, default=420.0,
                    help="a sampling process is killed after this long")
    ap.add_argument("--score-workers", type=int, default=None)
    ap.add_argument("--bundle", type=Path, default=None,
                    help="also pack OUT into this .tar.gz after every phase (the device "
                         "returns few files, and a killed command keeps the last one)")
    ap.add_argument("--deadline-s", type=float, default=None,
                    help="seconds this invocation may take: sample and score are skipped "
                         "(with a message) when too little is left, and sampling is cut short")
    args = ap.parse_args(argv)
    args.work = args.work or args.out / "work"
    if args.sweep_minutes is None:
        args.sweep_minutes = args.minutes / 2
    if args.eval_every_s is None:
        args.eval_every_s = args.minutes * 6
    needs_data = {"sweep", "final"} & set(args.phases)
    if needs_data and args.data is None:
        ap.error(f"--data is needed for the phases {sorted(needs_data)}")
    return args


def main(argv: list[str]) -> int:
    if argv[:1] == ["_sample"]:
        sample_main(argv[1:])
        return 0
    args = parse_args(argv)
    started = time.monotonic()
    args.out.mkdir(parents=True, exist_ok=True)
    log_file = open(args.out / "quality.log", "a")  # noqa: SIM115 -- open for the whole run

    def log(message: str) -> None:
        line = f"[{time.monotonic() - started:6.0f} s] {message}"
        print(line, flush=True)
        log_file.write(line + "\n")
        log_file.flush()

    saved = args.out / "candidates.json"
    if args.candidate or not saved.is_file():
        candidates = [Candidate.parse(c) for c in (args.candidate or DEFAULT_CANDIDATES)]
    else:  # a later phase of an earlier invocation: its candidates
        candidates = [Candidate(c["name"], c["preset"], tuple(c["overrides"]))
                      for c in json.loads(saved.read_text())]
    if args.only:
        unknown = sorted(set(args.only) - {c.name for c in candidates})
        if unknown:
            raise MegaCppError(f"--only {unknown}: not candidates ({[c.name for c in candidates]})")
        candidates = [c for c in candidates if c.name in args.only]
    if len({c.name for c in candidates}) != len(candidates):
        raise MegaCppError("candidate names must be unique")
    settings = Settings(
        data=str(Path(args.data).resolve()) if args.data else "", device=args.device,
        minutes=args.minutes, sweep_minutes=args.sweep_minutes, lrs=list(args.lrs),
        eval_every_s=args.eval_every_s, micro_batch=args.micro_batch,
        val_batches=args.val_batches, warmup_steps=args.warmup_steps, schedule=args.schedule,
        min_lr_ratio=args.min_lr_ratio, steps_cap=args.steps_cap, seed=args.seed,
        goal=args.goal or DEFAULT_GOAL, extra=list(args.extra))
    trains = bool({"sweep", "final"} & set(args.phases))
    if trains:
        if not (Path(settings.data) / "_COMPLETE").is_file():
            raise MegaCppError(
                f"--data {settings.data}: not a complete `megacpp data build` output (no "
                "_COMPLETE marker); build the corpus first (benchmarks/quality_corpus.py build)")
        _write_json(args.out / "settings.json", asdict(settings))
        _write_json(args.out / "candidates.json", [asdict(c) for c in candidates])
        _write_json(args.out / "dataset.json", dataset_summary(Path(settings.data)))
    elif (args.out / "settings.json").is_file():  # score / report of an earlier run
        settings = Settings(**json.loads((args.out / "settings.json").read_text()))
        if args.goal:
            settings.goal = args.goal
    (args.out / "command.txt").write_text(
        "PYTHONPATH=src " + " ".join(shlex.quote(a) for a in [
            "python", "benchmarks/quality.py", *argv]) + "\n"
        + "MEGACPP_KERNELS=fast for the training runs, auto for sampling (set per process)\n")
    gpu_phases = {"sweep", "final", "sample"} & set(args.phases)
    slots = slots_for(args.device, args.gpus, args.parallel) if gpu_phases else []
    if gpu_phases:
        log(f"{len(candidates)} candidates on {len(slots)} {args.device} slot(s): "
            + ", ".join(c.name for c in candidates))
    def left_s() -> float:
        return math.inf if args.deadline_s is None else args.deadline_s - (
            time.monotonic() - started)

    def checkpoint_results() -> None:
        if args.bundle:
            bundle(args.out, args.bundle, args.work)
            log(f"bundle {args.bundle} ({args.bundle.stat().st_size / 1e6:.1f} MB)")

    sweep = None
    if "sweep" in args.phases:
        sweep = phase_sweep(args, settings, candidates, slots, log)
        checkpoint_results()
    if "final" in args.phases:
        lrs = chosen_lrs(args, candidates, sweep)
        phase_final(args, settings, candidates, slots, lrs, log)
        phase_report(args, settings, candidates, settings.goal, started, log)
        checkpoint_results()
    if "sample" in args.phases:
        if left_s() < MIN_SAMPLE_S:
            log(f"sample: skipped, {left_s():.0f} s left of --deadline-s (needs {MIN_SAMPLE_S})")
        else:
            args.sample_budget_s = min(args.sample_budget_s, left_s() - 45)
            phase_sample(args, settings, candidates, slots, log)
            checkpoint_results()
    if "score" in args.phases:
        if left_s() < MIN_SCORE_S:
            log(f"score: skipped, {left_s():.0f} s left of --deadline-s; run `--phases score "
                "report` later")
        else:
            phase_score(args, candidates, log)
    if "report" in args.phases:
        phase_report(args, settings, candidates, settings.goal, started, log)
    checkpoint_results()
    log(f"done in {time.monotonic() - started:.0f} s")
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main(sys.argv[1:]))
    except MegaCppError as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(2)
