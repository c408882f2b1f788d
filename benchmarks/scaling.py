"""Weak scaling of ``megacpp train``: the same rows per GPU on 1..N GPUs, per strategy.

Each configuration is a real run -- ``torchrun --standalone --nproc-per-node W -m megacpp
train`` -- of a short length (30 steps by default) with the run preset's own modes (on CUDA
the defaults: the catalog's kernels, compile, CUDA graphs). The step time is the median of
the steps after warm-up and capture (steps 9-30 by default) from the run's metrics.jsonl; the
table gives step ms, tokens/s over all GPUs and per GPU, the efficiency per GPU against the
single-GPU run of the same preset (the best single-GPU step: graphed by default), the peak
memory of the fullest GPU and MFU as the trainer reports it (against the bf16 matmul peak
measured in each run, named in its receipt). Run on a GPU machine::

    python benchmarks/scaling.py --presets nam56r-350m --strategies ddp fsdp \\
        --world-sizes 1 2 4

    # the 1B preset, FSDP2 only, on a built dataset
    python benchmarks/scaling.py --presets nam56r-1b --strategies fsdp --world-sizes 1 2 4 \\
        --data data/libstdcxx-32k

``--presets`` takes run configs (a path, a shipped run config name, or a model preset P with
a shipped run config P-gpu). Without ``--data`` it first builds a dataset from ``--sources``
(default: the newest /usr/include/c++/N) with the shipped ``cpp`` data config (32k vocabulary,
2048-token rows; about 15 s on 2 CPU cores) into OUT/data. World size 1 runs once per preset
(strategy ``single``). ``--out`` (default ``benchmarks/results/scaling/<device>x<GPUs>``, e.g.
``h100x4``; ``cpu`` with ``--device cpu``) gets ``results.json``, ``scaling.png``, ``command.txt``,
``receipt.json`` (this benchmark's) and ``receipts/`` (every run's own receipt), and keeps
the runs' directories and logs under ``runs/``. A second invocation with the same ``--out``
on the same machine adds its rows to the first's (a row of the same preset, strategy and
world size is replaced), so a sweep longer than one sitting can be split and still relate to
one single-GPU run; ``command.txt`` then lists every invocation.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

import torch
from rich.console import Console
from rich.table import Table

from megacpp import configs as shipped_configs
from megacpp.receipts import write_receipt
from megacpp.train.config import load_run_config
from megacpp.train.metrics import read_metrics


def _libstdcxx() -> Path:
    """The newest installed libstdc++ header directory (/usr/include/c++/<version>)."""
    versions = [p for p in Path("/usr/include/c++").glob("*") if (p / "utility").is_file()]
    return max(versions, key=lambda p: int(p.name) if p.name.isdigit() else -1,
               default=Path("/usr/include/c++/12"))


DEFAULT_SOURCES = _libstdcxx()
DATA_CONFIG = "cpp"  # the shipped data build config (32k vocabulary)
console = Console(highlight=False, width=max(160, shutil.get_terminal_size().columns))


@dataclass
class Row:
    preset: str
    strategy: str
    world_size: int
    status: str = "ok"  # ok | failed | skipped
    error: str | None = None
    step_ms: float | None = None
    step_ms_spread: float | None = None  # max - min over the measured steps
    tokens_per_s: float | None = None  # all GPUs
    tokens_per_s_per_gpu: float | None = None
    efficiency: float | None = None  # per-GPU tokens/s / the single-GPU run's
    speedup: float | None = None  # tokens/s / the single-GPU run's
    peak_mem_gib: float | None = None  # the fullest GPU (max over ranks)
    mfu: float | None = None
    mfu_peak_tflops: float | None = None
    mfu_peak_source: str | None = None
    modes: dict = field(default_factory=dict)
    measured_steps: int = 0
    global_batch: int | None = None
    seq_len: int | None = None
    wall_s: float | None = None
    run_dir: str | None = None
    note: str | None = None  # e.g. a run that completed but whose processes did not exit


def resolve_config(preset: str) -> str:
    """A run config for ``preset``: a .toml path, or the shipped run config NAME or NAME-gpu."""
    if shipped_configs.is_path(preset):
        if not Path(preset).is_file():
            sys.exit(f"error: run config {preset} does not exist")
        return preset
    for name in (preset, f"{preset}-gpu"):
        if shipped_configs.shipped("run", name) is not None:
            return name
    known = ", ".join(shipped_configs.names("run"))
    sys.exit(f"error: no run config for {preset!r} (a .toml path or one of: {known})")


def build_dataset(sources: Path, out: Path, workers: int) -> Path:
    """``megacpp data build`` of ``sources`` with the shipped `cpp` data config into ``out``."""
    if (out / "manifest.json").is_file():
        console.print(f"dataset: {out} (already built)")
        return out
    if not sources.is_dir():
        sys.exit(f"error: no --data given and {sources} (the sources to build one from) is not "
                 "a directory; pass --data DIR or --sources DIR")
    started = time.perf_counter()
    cmd = [sys.executable, "-m", "megacpp", "data", "build", str(sources), "--out", str(out),
           "--config", str(DATA_CONFIG), "--workers", str(workers)]
    console.print(f"building the dataset: {shlex.join(cmd)}")
    result = subprocess.run(cmd, capture_output=True, text=True, env=_env(), check=False)
    if result.returncode != 0:
        sys.exit(f"error: the dataset build failed:\n{result.stderr[-3000:]}")
    console.print(f"dataset: {out} ({time.perf_counter() - started:.0f} s)")
    return out


def _env() -> dict[str, str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(ROOT / "src"), *filter(None, [os.environ.get("PYTHONPATH")])]),
           "PYTHONUNBUFFERED": "1", "COLUMNS": "400"}
    if not torch.cuda.is_available():
        env.setdefault("OMP_NUM_THREADS", "1")  # processes share the cores
    return env


def train_command(config: Path, world_size: int, run_dir: Path, strategy: str,
                  args: argparse.Namespace, data: Path) -> list[str]:
    overrides = [
        f"data.dir={data}", f"run.out_dir={run_dir}", f"run.device={args.device}",
        f"train.steps={args.steps}", "train.eval_every=0", "data.val_batches=1",
        "checkpoint.every=0", "checkpoint.final=false", "run.plots=false",
        "run.check_site_integrity=false", f"parallel.strategy={strategy}",
    ]
    if args.micro_batch:
        overrides += [f"train.micro_batch_size={args.micro_batch}", "train.grad_accum_steps=1",
                      "train.global_batch_size=0"]
    overrides += args.set
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                "--nproc-per-node", str(world_size)]
    return [*launcher, "-m", "megacpp", "train", "--config", str(config), "--no-progress",
            *[part for item in overrides for part in ("--set", item)]]


def run_one(preset: str, config: Path, strategy: str, world_size: int,
            args: argparse.Namespace, data: Path) -> Row:
    label = "single" if world_size == 1 else strategy
    row = Row(preset, label, world_size)
    run_dir = args.out / "runs" / f"{preset}-{label}-w{world_size}"
    row.run_dir = str(run_dir)
    if run_dir.exists():  # a rerun of the benchmark measures afresh
        shutil.rmtree(run_dir)
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    cmd = train_command(config, world_size, run_dir, label, args, data)
    log = run_dir.parent / f"{run_dir.name}.log"
    started = time.perf_counter()
    try:
        with open(log, "w") as out:
            out.write(shlex.join(cmd) + "\n")
            out.flush()
            result = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, env=_env(),
                                    timeout=args.timeout, check=False)
        failed = result.returncode != 0 and f"exit status {result.returncode}"
    except subprocess.TimeoutExpired:
        failed = f"timed out after {args.timeout} s"
        if completed(run_dir):  # every step and the receipt are in: only the exit hung
            row.note = (f"the run completed, but its processes had not exited {args.timeout} s "
                        "after the start and were killed")
            failed = False
    row.wall_s = time.perf_counter() - started
    if failed:
        errors = [line for line in log.read_text(errors="replace").splitlines()
                  if line.startswith("error:")]
        row.status, row.error = "failed", (errors[0] if errors else failed) + f" (log: {log})"
        return row
    return measure(row, run_dir, args.skip_steps)


def completed(run_dir: Path) -> bool:
    """True when ``run_dir`` holds a finished run: its receipt says completed."""
    try:
        receipt = json.loads((run_dir / "receipt.json").read_text())
    except (OSError, ValueError):
        return False
    return receipt.get("config", {}).get("outcome", {}).get("status") == "completed"


def last_step(run_dir: Path) -> int:
    """The last training step in ``run_dir``'s metrics.jsonl (0 if none)."""
    try:
        records = read_metrics(run_dir / "metrics.jsonl")
    except (OSError, ValueError):
        return 0
    return max((r["step"] for r in records if r.get("type") == "train"), default=0)


def measure(row: Row, run_dir: Path, skip: int) -> Row:
    """Fill ``row`` from the run's metrics.jsonl (steps after ``skip``) and receipt."""
    records = read_metrics(run_dir / "metrics.jsonl")
    setup = next(r for r in records if r["type"] == "setup")
    train = [r for r in records if r["type"] == "train"]
    steps = [r for r in train if r["step"] > skip]
    if not steps:
        row.status, row.error = "failed", f"no steps after step {skip} in {run_dir}"
        return row
    times = [r["time_s"] for r in steps]
    row.global_batch, row.modes = setup["global_batch"], setup["modes"]
    tokens_per_step = train[0]["tokens"] // train[0]["step"]  # a fresh run: step 1 is first
    row.seq_len = tokens_per_step // row.global_batch
    row.step_ms = 1e3 * statistics.median(times)
    row.step_ms_spread = 1e3 * (max(times) - min(times))
    row.tokens_per_s = tokens_per_step / statistics.median(times)
    row.tokens_per_s_per_gpu = row.tokens_per_s / row.world_size
    receipt = run_dir / "receipt.json"
    peak = (json.loads(receipt.read_text())["metrics"]["peak_mem_bytes"] if receipt.is_file()
            else max(r["peak_mem_bytes"] for r in train))  # no receipt: rank 0's, per step
    row.peak_mem_gib = peak / 2**30
    mfus = [r["mfu"] for r in steps if r.get("mfu") is not None]
    row.mfu = statistics.median(mfus) if mfus else None
    row.mfu_peak_tflops, row.mfu_peak_source = setup["mfu_peak_tflops"], setup["mfu_peak_source"]
    row.measured_steps = len(steps)
    return row


def relate(rows: list[Row]) -> None:
    """Efficiency and speedup against each preset's single-GPU run."""
    for row in rows:
        base = next((r for r in rows if r.preset == row.preset and r.world_size == 1
                     and r.status == "ok"), None)
        if base is None or row.status != "ok":
            continue
        row.efficiency = row.tokens_per_s_per_gpu / base.tokens_per_s_per_gpu
        row.speedup = row.tokens_per_s / base.tokens_per_s


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def print_table(rows: list[Row], title: str) -> None:
    table = Table(title=title, title_justify="left")
    for name in ("preset", "strategy", "GPUs", "step ms", "tokens/s", "per GPU", "speedup",
                 "efficiency", "peak GiB/GPU", "MFU", "graph", "compile", "status"):
        table.add_column(name, justify="left" if name in ("preset", "strategy", "status")
                         else "right")
    for r in rows:
        table.add_row(
            r.preset, r.strategy, str(r.world_size), _fmt(r.step_ms, ".1f"),
            _fmt(r.tokens_per_s, ",.0f"), _fmt(r.tokens_per_s_per_gpu, ",.0f"),
            _fmt(r.speedup, ".2f") + ("x" if r.speedup else ""), _fmt(r.efficiency, ".2f"),
            _fmt(r.peak_mem_gib, ".1f"), _fmt(r.mfu and 100 * r.mfu, ".1f"),
            _onoff(r.modes.get("cuda_graph")), _onoff(r.modes.get("compile")),
            r.status if r.status == "ok" else f"{r.status}: {r.error}")
    console.print(table)


def _onoff(value: object) -> str:
    return "-" if value is None else ("on" if value else "off")


def plot(rows: list[Row], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    for preset in dict.fromkeys(r.preset for r in rows):
        base = [r for r in rows if r.preset == preset and r.world_size == 1 and r.status == "ok"]
        for strategy in dict.fromkeys(r.strategy for r in rows if r.world_size > 1):
            series = base + [r for r in rows if r.preset == preset and r.strategy == strategy
                             and r.world_size > 1 and r.status == "ok"]
            if len(series) == len(base):
                continue
            gpus = [r.world_size for r in series]
            label = f"{preset} {strategy}"
            left.plot(gpus, [r.tokens_per_s / 1e3 for r in series], "o-", label=label)
            if base:
                right.plot(gpus, [r.efficiency for r in series], "o-", label=label)
        if base:
            top = max(r.world_size for r in rows)
            left.plot([1, top], [base[0].tokens_per_s / 1e3, top * base[0].tokens_per_s / 1e3],
                      ":", color="grey", label=f"{preset} linear")
    left.set(xlabel="GPUs", ylabel="thousand tokens/s (all GPUs)", title="throughput")
    right.set(xlabel="GPUs", ylabel="per-GPU tokens/s / single GPU", title="efficiency",
              ylim=(0, 1.1))
    right.axhline(1.0, color="grey", linestyle=":")
    for ax in (left, right):
        ax.set_xticks(sorted({r.world_size for r in rows}))
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def save(rows: list[Row], args: argparse.Namespace, title: str, data: Path,
         device: str | None = None, torch_version: str | None = None,
         bench_receipt: bool = True) -> None:
    out = args.out
    results = out / "results.json"
    results.write_text(json.dumps({
        "title": title, "device": device or _device_name(),
        "torch": torch_version or torch.__version__,
        "steps": args.steps, "median_of_steps": f"{args.skip_steps + 1}-{args.steps}",
        "dataset": str(data), "rows": [asdict(r) for r in rows]}, indent=2) + "\n")
    png = out / "scaling.png"
    plot(rows, png, title)
    receipts = out / "receipts"
    receipts.mkdir(exist_ok=True)
    for r in rows:
        source = Path(r.run_dir or "") / "receipt.json"
        if r.run_dir and source.is_file():
            (receipts / f"{Path(r.run_dir).name}.json").write_text(source.read_text())
    if not bench_receipt:
        console.print(f"results: {results}, {png}, {receipts}/")
        return
    metrics: dict[str, float] = {}
    for r in rows:
        if r.status != "ok":
            continue
        key = f"{r.preset}.{r.strategy}.w{r.world_size}"
        for name in ("step_ms", "tokens_per_s", "tokens_per_s_per_gpu", "efficiency",
                     "peak_mem_gib", "mfu"):
            value = getattr(r, name)
            if value is not None:
                metrics[f"{key}.{name}"] = float(value)
    config = {"benchmark": "scaling", "presets": args.presets, "strategies": args.strategies,
              "world_sizes": args.world_sizes, "steps": args.steps,
              "median_of_steps": [args.skip_steps + 1, args.steps], "device": args.device,
              "overrides": args.set, "dataset": str(data), "command": _command()}
    write_receipt(out / "receipt.json", "bench", config, metrics,
                  artifacts=[results, png, out / "command.txt"])
    console.print(f"results: {results}, {png}, {out / 'receipt.json'}, {receipts}/")


def _device_name() -> str:
    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"


def _command() -> str:
    return shlex.join([sys.executable, *sys.argv])


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--presets", nargs="+", default=["nam56r-350m"],
                    help="run configs (path, shipped run config name, or P for the shipped P-gpu)")
    ap.add_argument("--strategies", nargs="+", default=["ddp", "fsdp"], choices=["ddp", "fsdp"])
    ap.add_argument("--world-sizes", nargs="+", type=int, default=[1, 2])
    ap.add_argument("--steps", type=int, default=30, help="steps per run (default 30)")
    ap.add_argument("--skip-steps", type=int, default=8,
                    help="steps before the median: warm-up, compile, capture (default 8)")
    ap.add_argument("--micro-batch", type=int, default=8,
                    help="rows per GPU per step, the same on every world size (0 = the "
                    "preset's own)")
    ap.add_argument("--data", type=Path, default=None, help="a built megacpp dataset")
    ap.add_argument("--sources", type=Path, default=DEFAULT_SOURCES,
                    help="what to build the dataset from without --data")
    ap.add_argument("--device", choices=["cuda", "cpu"],
                    default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--set", action="append", default=[], metavar="TABLE.KEY=VALUE",
                    help="an override for every run (repeatable)")
    ap.add_argument("--timeout", type=int, default=900, help="seconds per run")
    ap.add_argument("--out", type=Path, default=None,
                    help="results folder (default: benchmarks/results/scaling/<device>x<GPUs>)")
    ap.add_argument("--remeasure", action="store_true",
                    help="run nothing: rebuild the table, results.json and PNG from the run "
                    "directories under OUT/runs (e.g. copied from the GPU machine after the "
                    "benchmark process was stopped); no benchmark receipt is written, since "
                    "this machine did not measure (each run keeps its own)")
    args = ap.parse_args(argv)
    if args.out is None:
        from megacpp.receipts.results import device_slug, results_dir

        args.out = results_dir("scaling", device_slug(count=torch.cuda.device_count())
                               if args.device == "cuda" else "cpu")
    if args.remeasure:
        remeasure(args)
        return
    if args.steps <= args.skip_steps:
        sys.exit(f"error: --steps {args.steps} leaves no step after --skip-steps "
                 f"{args.skip_steps}")
    available = torch.cuda.device_count() if args.device == "cuda" else os.cpu_count() or 1
    args.out.mkdir(parents=True, exist_ok=True)
    with open(args.out / "command.txt", "a") as commands:
        commands.write(_command() + "\n")
    data = args.data or build_dataset(args.sources, args.out / "data",
                                      workers=min(16, os.cpu_count() or 1))
    configs = {p: resolve_config(p) for p in args.presets}
    for preset, path in configs.items():
        load_run_config(path, args.set)  # a bad preset or override stops before any run
    plan = []
    for preset in args.presets:
        for world_size in sorted(set(args.world_sizes)):
            for strategy in (["single"] if world_size == 1 else args.strategies):
                plan.append((preset, strategy, world_size))
    names = {p: Path(p).stem if p.endswith(".toml") else p for p in args.presets}
    rows = []
    for i, (preset, strategy, world_size) in enumerate(plan, 1):
        if args.device == "cuda" and world_size > available:
            rows.append(Row(names[preset], strategy, world_size, status="skipped",
                            error=f"{available} GPU(s) here"))
            continue
        console.print(f"[{i}/{len(plan)}] {names[preset]} {strategy} x{world_size} ...")
        row = run_one(names[preset], configs[preset], strategy, world_size, args, data)
        console.print(f"    {row.status}: {_fmt(row.step_ms, '.1f')} ms/step, "
                      f"{_fmt(row.tokens_per_s, ',.0f')} tokens/s ({row.wall_s:.0f} s)"
                      + (f" -- {row.error}" if row.error else ""))
        rows.append(row)
    failed = any(r.status == "failed" for r in rows)
    rows = merged(earlier_rows(args.out / "results.json"), rows)
    relate(rows)
    title = (f"megacpp train, weak scaling on {_device_name()}: median of steps "
             f"{args.skip_steps + 1}-{args.steps}, {args.micro_batch or 'preset'} rows/GPU")
    print_table(rows, title)
    save(rows, args, title, data)
    if failed:
        sys.exit(1)


def remeasure(args: argparse.Namespace) -> None:
    """The rows of the run directories under ``args.out / "runs"``, measured from their
    metrics and receipts (the device is the one the runs' receipts name)."""
    rows, device, torch_version = [], None, None
    for run_dir in sorted(p for p in (args.out / "runs").glob("*-w*") if p.is_dir()):
        preset, label, world = run_dir.name.rsplit("-", 2)
        row = Row(preset, label, int(world.removeprefix("w")), run_dir=str(run_dir))
        if completed(run_dir):
            measure(row, run_dir, args.skip_steps)
            receipt = json.loads((run_dir / "receipt.json").read_text())
            device = device or receipt["fingerprint"]["devices"][0]["name"]
            torch_version = torch_version or receipt["fingerprint"]["packages"].get("torch")
        elif last_step(run_dir) >= args.steps:  # every step ran; stopped before its receipt
            measure(row, run_dir, args.skip_steps)
            row.note = (f"all {args.steps} steps are in its metrics, but the run was stopped "
                        "before it wrote its receipt: peak memory is rank 0's")
        else:
            row.status, row.error = "failed", f"the run in {run_dir} did not complete"
        rows.append(row)
    if not rows:
        sys.exit(f"error: no run directories under {args.out / 'runs'}")
    rows = merged([], rows)
    relate(rows)
    title = (f"megacpp train, weak scaling on {device}: median of steps "
             f"{args.skip_steps + 1}-{args.steps}, {args.micro_batch or 'preset'} rows/GPU")
    print_table(rows, title)
    save(rows, args, title, Path(rows[0].run_dir).parent.parent / "data", device=device,
         torch_version=torch_version, bench_receipt=False)


def earlier_rows(results: Path) -> list[Row]:
    """The rows of an earlier invocation with the same --out (on the same machine), so a
    sweep can be split over several calls and still relate to one single-GPU run."""
    if not results.is_file():
        return []
    earlier = json.loads(results.read_text())
    if earlier.get("device") != _device_name():
        sys.exit(f"error: {results} holds rows measured on {earlier.get('device')!r}, not on "
                 f"{_device_name()!r}: use another --out")
    return [Row(**row) for row in earlier["rows"]]


def merged(earlier: list[Row], new: list[Row]) -> list[Row]:
    """``earlier`` with the rows of the same preset, strategy and world size replaced by
    ``new``'s, ordered by preset, then world size."""
    key = lambda r: (r.preset, r.strategy, r.world_size)
    fresh = {key(r) for r in new}
    rows = [r for r in earlier if key(r) not in fresh] + new
    presets = list(dict.fromkeys(r.preset for r in rows))
    return sorted(rows, key=lambda r: (presets.index(r.preset), r.world_size,
                                       r.strategy != "ddp"))


if __name__ == "__main__":
    main()
