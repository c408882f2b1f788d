"""FP8 against bf16 training, in one run: tokens/s, peak memory and MFU, then loss curves.

Every row is a real ``megacpp train`` run (one process, ``torchrun --standalone``) of the
preset's shipped GPU run config with ``parallel.float8`` = off (bf16) or a recipe and
``parallel.cuda_graph`` on or off (the other modes are the run config's: on CUDA the
catalog's kernels and regional compile). The speed rows are short (``--steps``, 30 by
default); the step time is the median of the steps after ``--skip-steps`` (warm-up, compile
and capture), from each run's metrics.jsonl. Each row gives tokens/s, its speedup over the
bf16 row of the same preset and graph mode, the peak memory, and MFU against both the bf16
and the float8 matmul peak, each measured once in this process (8192^3 GEMMs after the
clock settles: ``a @ b`` in bf16, ``torch._scaled_mm`` in e4m3;
:mod:`megacpp.kernels.timing`). FLOPs per token are the trainer's analytic count (the same
for both precisions).

``--loss-steps N`` (N >= 500 for the goal) adds the loss curves: for each preset (or each of
``--loss-presets``), bf16 and
each recipe train N steps from the same seed on the same data, and the table gives each
run's final loss (the mean training loss of its last 20 steps) and final validation loss
against bf16's (goal: within 1%); ``loss.png`` draws the curves.

On a GPU machine (the dataset is built first when ``--data`` is not given: about 15 s)::

    # compact (nam56r-350m, tensorwise, graphs on and off: 4 runs; about 4 minutes on an H100)
    python benchmarks/fp8.py --compact --data data/libstdcxx-32k

    # the whole table: both presets, both recipes, graphs on and off (12 runs)
    python benchmarks/fp8.py --presets nam56r-350m nam56r-1b --recipes tensorwise rowwise

    # loss curves only: 500 steps of nam56r-350m, bf16 vs tensorwise
    python benchmarks/fp8.py --presets nam56r-350m --recipes tensorwise --graphs on \\
        --speed-steps 0 --loss-steps 500

A recipe the device cannot run (the CPU, CUDA before sm_89; rowwise before sm_90) is a
``skipped`` row with the reason, not a failure. ``--out`` (default
``benchmarks/results/fp8/<device>``) gets ``results.json``, ``loss.png`` (with
``--loss-steps``), ``command.txt``, ``receipt.json`` and ``receipts/`` (every run's own
receipt), with the runs' directories and logs under ``runs/``.
"""

from __future__ import annotations

import argparse
import json
import shlex
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "benchmarks"))

import scaling  # the run launcher and metrics reader this benchmark shares
import torch

from megacpp.errors import ConfigError
from megacpp.receipts import write_receipt
from megacpp.train.float8 import require_float8
from megacpp.train.metrics import read_metrics

console = scaling.console
FINAL_WINDOW = 20  # final loss: the mean training loss of the last this many steps
LOSS_GOAL = 0.01  # fp8's final loss within 1% of bf16's


@dataclass
class SpeedRow:
    preset: str
    float8: str  # off | tensorwise | rowwise
    graphs: bool
    status: str = "ok"  # ok | failed | skipped
    error: str | None = None
    step_ms: float | None = None
    tokens_per_s: float | None = None
    speedup: float | None = None  # tokens/s over the bf16 row of the same preset and graphs
    peak_mem_gib: float | None = None
    mfu_bf16: float | None = None  # against the measured bf16 matmul peak
    mfu_fp8: float | None = None  # against the measured float8 matmul peak
    flops_per_token: float | None = None
    graph_mode: str | None = None  # what the run's log says ran (a capture may fall back)
    float8_layers: dict | None = None  # the lane's report: converted / kept layer groups
    run_dir: str | None = None


@dataclass
class LossRow:
    preset: str
    float8: str
    status: str = "ok"
    error: str | None = None
    steps: int = 0
    final_loss: float | None = None  # mean of the last FINAL_WINDOW training losses
    final_val_loss: float | None = None
    rel_to_bf16: float | None = None  # final_loss / bf16's - 1
    val_rel_to_bf16: float | None = None
    within_goal: bool | None = None
    run_dir: str | None = None


def measure_peaks(device: str) -> dict[str, float | None]:
    """The bf16 and float8 dense matmul peaks (TFLOP/s) of this process's GPU."""
    from megacpp.kernels.timing import fp8_matmul_peak_tflops, matmul_peak_tflops

    if device != "cuda":
        return {"bf16": None, "fp8": None}
    peaks: dict[str, float | None] = {"bf16": matmul_peak_tflops(), "fp8": None}
    major, minor = torch.cuda.get_device_capability()
    if (major, minor) >= (8, 9):
        peaks["fp8"] = fp8_matmul_peak_tflops()
    return peaks


def unsupported(recipe: str, device: str) -> str | None:
    """Why this machine cannot run ``recipe`` (the training lane's own check), or None."""
    try:
        require_float8(recipe, torch.device(device))
    except ConfigError as exc:
        return str(exc)
    return None


def run(config: str, name: str, overrides: list[str], steps: int,
        args: argparse.Namespace, data: Path) -> tuple[Path, str | None]:
    """One ``megacpp train`` run into OUT/runs/NAME; (its directory, an error or None)."""
    run_dir = args.out / "runs" / name
    if run_dir.exists():
        shutil.rmtree(run_dir)
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    options = argparse.Namespace(device=args.device, steps=steps, micro_batch=args.micro_batch,
                                 set=[*args.set, *overrides])
    cmd = scaling.train_command(Path(config), 1, run_dir, "single", options, data)
    log = run_dir.parent / f"{name}.log"
    with open(log, "w") as out:
        out.write(shlex.join(cmd) + "\n")
        out.flush()
        try:
            result = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT,
                                    env=scaling._env(), timeout=args.timeout, check=False)
            failed = result.returncode != 0 and f"exit status {result.returncode}"
        except subprocess.TimeoutExpired:
            failed = f"timed out after {args.timeout} s"
    if not failed:
        return run_dir, None
    errors = [line for line in log.read_text(errors="replace").splitlines()
              if line.startswith("error:")]
    return run_dir, (errors[0] if errors else failed) + f" (log: {log})"


def speed_row(preset: str, config: str, recipe: str, graphs: bool, args: argparse.Namespace,
              data: Path, peaks: dict[str, float | None]) -> SpeedRow:
    row = SpeedRow(preset, recipe, graphs)
    reason = None if recipe == "off" else unsupported(recipe, args.device)
    if reason:
        row.status, row.error = "skipped", reason
        return row
    name = f"{preset}-{recipe}-{'graphs' if graphs else 'eager'}"
    overrides = [f"parallel.float8={recipe}",
                 f"parallel.cuda_graph={'true' if graphs else 'false'}"]
    run_dir, error = run(config, name, overrides, args.speed_steps, args, data)
    row.run_dir = str(run_dir)
    if error:
        row.status, row.error = "failed", error
        return row
    records = read_metrics(run_dir / "metrics.jsonl")
    setup = next(r for r in records if r["type"] == "setup")
    steps = [r for r in records if r["type"] == "train" and r["step"] > args.skip_steps]
    if not steps:
        row.status, row.error = "failed", f"no steps after step {args.skip_steps} in {run_dir}"
        return row
    full = json.loads((run_dir / "receipt.json").read_text())
    receipt = full["metrics"]
    row.float8_layers = full["config"]["invocation"].get("float8")
    seconds = statistics.median(r["time_s"] for r in steps)
    tokens_per_step = steps[0]["tokens"] // steps[0]["step"]
    row.step_ms = 1e3 * seconds
    row.tokens_per_s = tokens_per_step / seconds
    row.peak_mem_gib = receipt["peak_mem_bytes"] / 2**30
    row.flops_per_token = receipt.get("train_flops_per_token")
    row.graph_mode = f"cuda_graph {'on' if setup['modes']['cuda_graph'] else 'off'}: " \
                     f"{setup['modes']['cuda_graph_why']}"
    if row.flops_per_token:
        model_tflops = row.flops_per_token * row.tokens_per_s / 1e12
        row.mfu_bf16 = model_tflops / peaks["bf16"] if peaks["bf16"] else None
        row.mfu_fp8 = model_tflops / peaks["fp8"] if peaks["fp8"] else None
    return row


def loss_row(preset: str, config: str, recipe: str, args: argparse.Namespace,
             data: Path) -> LossRow:
    row = LossRow(preset, recipe, steps=args.loss_steps)
    reason = None if recipe == "off" else unsupported(recipe, args.device)
    if reason:
        row.status, row.error = "skipped", reason
        return row
    overrides = [f"parallel.float8={recipe}", f"train.eval_every={args.loss_steps}",
                 f"data.val_batches={args.val_batches}"]
    run_dir, error = run(config, f"{preset}-{recipe}-loss", overrides, args.loss_steps,
                         args, data)
    row.run_dir = str(run_dir)
    if error:
        row.status, row.error = "failed", error
        return row
    losses = [r["loss"] for r in read_metrics(run_dir / "metrics.jsonl") if r["type"] == "train"]
    row.final_loss = statistics.fmean(losses[-FINAL_WINDOW:])
    row.final_val_loss = json.loads((run_dir / "receipt.json").read_text())["metrics"].get(
        "final_val_loss")
    return row


def relate(speed: list[SpeedRow], loss: list[LossRow]) -> None:
    for row in speed:
        base = next((r for r in speed if r.preset == row.preset and r.graphs == row.graphs
                     and r.float8 == "off" and r.status == "ok"), None)
        if base and row.status == "ok":
            row.speedup = row.tokens_per_s / base.tokens_per_s
    for row in loss:
        base = next((r for r in loss if r.preset == row.preset and r.float8 == "off"
                     and r.status == "ok"), None)
        if base and row.status == "ok":
            row.rel_to_bf16 = row.final_loss / base.final_loss - 1
            if row.final_val_loss is not None and base.final_val_loss:
                row.val_rel_to_bf16 = row.final_val_loss / base.final_val_loss - 1
            row.within_goal = abs(row.rel_to_bf16) <= LOSS_GOAL


_f = scaling._fmt  # a number in ``spec``, "-" for None


def print_tables(speed: list[SpeedRow], loss: list[LossRow], peaks: dict) -> None:
    from rich.table import Table

    if speed:
        table = Table(title=f"FP8 vs bf16 training on {scaling._device_name()} (peaks: bf16 "
                            f"{_f(peaks['bf16'], '.0f')}, fp8 {_f(peaks['fp8'], '.0f')} TFLOP/s)")
        for col in ("preset", "float8", "graphs", "step ms", "tokens/s", "speedup",
                    "peak GiB", "MFU bf16", "MFU fp8", "status"):
            table.add_column(col)
        for r in speed:
            table.add_row(r.preset, r.float8, "on" if r.graphs else "off", _f(r.step_ms, ".1f"),
                          _f(r.tokens_per_s, ",.0f"), _f(r.speedup, ".3f"),
                          _f(r.peak_mem_gib, ".2f"),
                          _f(r.mfu_bf16 and 100 * r.mfu_bf16, ".1f"),
                          _f(r.mfu_fp8 and 100 * r.mfu_fp8, ".1f"),
                          r.status if not r.error else f"{r.status}: {r.error[:120]}")
        console.print(table)
    if loss:
        table = Table(title=f"final loss (mean of the last {FINAL_WINDOW} steps) vs bf16")
        for col in ("preset", "float8", "steps", "final loss", "vs bf16", "val loss",
                    "val vs bf16", "within 1%", "status"):
            table.add_column(col)
        for r in loss:
            table.add_row(r.preset, r.float8, str(r.steps), _f(r.final_loss, ".4f"),
                          _f(r.rel_to_bf16 and 100 * r.rel_to_bf16, "+.2f"),
                          _f(r.final_val_loss, ".4f"),
                          _f(r.val_rel_to_bf16 and 100 * r.val_rel_to_bf16, "+.2f"),
                          "-" if r.within_goal is None else str(r.within_goal),
                          r.status if not r.error else f"{r.status}: {r.error[:120]}")
        console.print(table)


def plot_losses(loss: list[LossRow], path: Path) -> Path | None:
    rows = [r for r in loss if r.status == "ok"]
    if not rows:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    for r in rows:
        records = read_metrics(Path(r.run_dir) / "metrics.jsonl")
        steps = [(x["step"], x["loss"]) for x in records if x["type"] == "train"]
        ax.plot(*zip(*steps, strict=True), label=f"{r.preset} {r.float8}", linewidth=1)
    ax.set_xlabel("step")
    ax.set_ylabel("training loss")
    ax.set_title(f"FP8 vs bf16 loss on {scaling._device_name()}")
    ax.legend()
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)
    return path


def save(speed: list[SpeedRow], loss: list[LossRow], peaks: dict, args: argparse.Namespace,
         data: Path) -> None:
    out = args.out
    results = out / "results.json"
    results.write_text(json.dumps({
        "device": scaling._device_name(), "torch": torch.__version__,
        "matmul_peak_tflops": peaks, "speed_steps": args.speed_steps,
        "median_of_steps": f"{args.skip_steps + 1}-{args.speed_steps}",
        "loss_steps": args.loss_steps, "final_loss_window": FINAL_WINDOW,
        "dataset": str(data), "speed": [asdict(r) for r in speed],
        "loss": [asdict(r) for r in loss]}, indent=2) + "\n")
    artifacts = [results, out / "command.txt"]
    png = plot_losses(loss, out / "loss.png")
    if png:
        artifacts.append(png)
    receipts = out / "receipts"
    receipts.mkdir(exist_ok=True)
    for r in [*speed, *loss]:
        source = Path(r.run_dir or "") / "receipt.json"
        if r.run_dir and source.is_file():
            (receipts / f"{Path(r.run_dir).name}.json").write_text(source.read_text())
    metrics: dict[str, float] = {f"peak_tflops.{k}": v for k, v in peaks.items() if v}
    for r in speed:
        key = f"{r.preset}.{r.float8}.{'graphs' if r.graphs else 'eager'}"
        for name in ("tokens_per_s", "speedup", "peak_mem_gib", "mfu_bf16", "mfu_fp8"):
            value = getattr(r, name)
            if r.status == "ok" and value is not None:
                metrics[f"{key}.{name}"] = float(value)
    for r in loss:
        for name in ("final_loss", "final_val_loss", "rel_to_bf16"):
            value = getattr(r, name)
            if r.status == "ok" and value is not None:
                metrics[f"{r.preset}.{r.float8}.loss.{name}"] = float(value)
    config = {"benchmark": "fp8", "presets": args.presets, "loss_presets": args.loss_presets,
              "recipes": args.recipes,
              "graphs": args.graphs, "speed_steps": args.speed_steps,
              "loss_steps": args.loss_steps, "device": args.device, "overrides": args.set,
              "dataset": str(data), "command": scaling._command()}
    write_receipt(out / "receipt.json", "bench", config, metrics, artifacts=artifacts)
    console.print(f"results: {results}, {out / 'receipt.json'}, {receipts}/"
                  + (f", {png}" if png else ""))


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--presets", nargs="+", default=["nam56r-350m", "nam56r-1b"],
                    help="run configs (path, shipped run config name, or P for the shipped P-gpu)")
    ap.add_argument("--recipes", nargs="+", default=["tensorwise", "rowwise"],
                    choices=["tensorwise", "rowwise"])
    ap.add_argument("--graphs", nargs="+", default=["on", "off"], choices=["on", "off"],
                    help="parallel.cuda_graph of the speed rows")
    ap.add_argument("--compact", action="store_true",
                    help="nam56r-350m, tensorwise, graphs on and off (4 short runs)")
    ap.add_argument("--speed-steps", type=int, default=30, help="steps of each speed run (0: none)")
    ap.add_argument("--skip-steps", type=int, default=10,
                    help="speed runs: steps left out of the median (warm-up, compile, capture)")
    ap.add_argument("--loss-steps", type=int, default=0,
                    help="steps of each loss-curve run (0: none; >= 500 for the 1%% goal)")
    ap.add_argument("--loss-presets", nargs="+", default=None,
                    help="the presets that get loss curves (default: every --presets one)")
    ap.add_argument("--val-batches", type=int, default=8, help="loss runs: validation batches")
    ap.add_argument("--micro-batch", type=int, default=0,
                    help="rows per micro-step (0: the run config's)")
    ap.add_argument("--data", type=Path, default=None, help="a `megacpp data build` output")
    ap.add_argument("--sources", type=Path, default=scaling.DEFAULT_SOURCES,
                    help="C++ sources to build the dataset from when --data is not given")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                    choices=["cuda", "cpu"])
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="a run config override for every run")
    ap.add_argument("--timeout", type=float, default=1800, help="seconds per run")
    ap.add_argument("--out", type=Path, default=None,
                    help="results folder (default: benchmarks/results/fp8/<device>)")
    args = ap.parse_args(argv)
    if args.compact:
        args.presets, args.recipes, args.graphs = ["nam56r-350m"], ["tensorwise"], ["on", "off"]
    unknown = sorted(set(args.loss_presets or ()) - set(args.presets))
    if unknown:
        ap.error(f"--loss-presets {' '.join(unknown)}: not among --presets")
    if args.device == "cpu" and "on" in args.graphs:
        args.graphs = ["off"]  # CUDA graphs need CUDA
    if args.speed_steps and args.speed_steps <= args.skip_steps:
        ap.error(f"--speed-steps {args.speed_steps} leaves no step after --skip-steps "
                 f"{args.skip_steps}")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    from megacpp.receipts.results import begin, results_dir

    args.out = begin(args.out or results_dir("fp8"), "fp8", "fp8")
    configs = {Path(p).stem if p.endswith(".toml") else p: scaling.resolve_config(p)
               for p in args.presets}
    data = args.data or scaling.build_dataset(args.sources, args.out / "data", 2)
    peaks = measure_peaks(args.device)
    console.print(f"matmul peaks (TFLOP/s): bf16 {_f(peaks['bf16'], '.0f')}, "
                  f"fp8 {_f(peaks['fp8'], '.0f')}")
    speed: list[SpeedRow] = []
    loss: list[LossRow] = []
    started = time.perf_counter()
    for preset, config in configs.items():
        for graphs in (g == "on" for g in args.graphs) if args.speed_steps else ():
            for recipe in ("off", *args.recipes):
                row = speed_row(preset, config, recipe, graphs, args, data, peaks)
                console.print(f"{preset} float8={recipe} graphs={'on' if graphs else 'off'}: "
                              f"{row.status} {_f(row.tokens_per_s, ',.0f')} tok/s "
                              f"({time.perf_counter() - started:.0f} s)")
                speed.append(row)
        if args.loss_steps and (args.loss_presets is None or preset in args.loss_presets):
            for recipe in ("off", *args.recipes):
                row = loss_row(preset, config, recipe, args, data)
                console.print(f"{preset} float8={recipe} loss run: {row.status} final "
                              f"{_f(row.final_loss, '.4f')} "
                              f"({time.perf_counter() - started:.0f} s)")
                loss.append(row)
    relate(speed, loss)
    print_tables(speed, loss, peaks)
    save(speed, loss, peaks, args, data)


if __name__ == "__main__":
    main()
