"""Does fill-in-the-middle hurt left-to-right loss? The tiny preset trained on the same corpus
built without FIM and with FIM at each ``--fim-rate``, compared on the same left-to-right
validation split.

Run (docs/data.md quotes its numbers, measured on a shared 2-core CPU)::

    PYTHONPATH=src python benchmarks/fim_loss.py --fim-rate 0.5 0.25

1. ``megacpp data build`` of ``--sources`` (default ``/usr/include/c++/12``) with the shipped
   ``tiny`` data config and ``[fim] rate = 0`` (this build trains the tokenizer), then once
   per ``--fim-rate`` with that tokenizer. The validation split is never FIM-transformed, so
   every build's validation shards are the same bytes (checked).
2. The ``tiny-cpu`` run config trained ``--steps`` steps (300) on each dataset, with the same
   seed, batch, schedule and initialization, on ``--threads`` torch threads.
3. The validation loss of each run over ``--val-batches`` batches of the shared validation
   split (0: all of it), and the relative difference ``(fim - baseline) / baseline``; the
   goal is within ``--goal`` (1%).

``--out`` (default ``benchmarks/results/fim/cpu``) gets ``fim_loss.json``, ``command.txt`` and
an evidence receipt (kind ``bench``) under ``receipts/fim_loss/``, with each training run's
own receipt next to it.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

BENCHMARK = "fim"
STEM = "fim_loss"
DATA_CONFIG, RUN_CONFIG = "tiny", "tiny-cpu"  # the shipped data and run configs


def build(sources: list[str], out: Path, fim_rate: float, seed: int, tokenizer: Path | None,
          workers: int) -> dict[str, Any]:
    """Build ``sources`` with the tiny data config and ``[fim] rate = fim_rate``."""
    from megacpp.data.build import BuildConfig, build_dataset

    cfg = BuildConfig.from_toml(DATA_CONFIG)
    cfg.fim.rate, cfg.fim.seed = fim_rate, seed
    cfg.fim.validate()
    start = time.perf_counter()
    result = build_dataset(sources, out, cfg, tokenizer_path=tokenizer, workers=workers)
    fim_stage = next(s for s in result.manifest["stages"] if s["name"] == "fim")
    return {"fim_rate": fim_rate, "seconds": round(time.perf_counter() - start, 1),
            "documents": result.manifest["documents"]["count"],
            "train_rows": result.manifest["splits"]["train"]["rows"],
            "validation_rows": result.manifest["splits"]["validation"]["rows"],
            "train_tokens": result.manifest["splits"]["train"]["tokens"],
            "fim_documents": dict(fim_stage["notes"])}


def train(data: Path, run_dir: Path, args: argparse.Namespace) -> dict[str, Any]:
    """The tiny-cpu run on ``data`` for ``args.steps`` steps; its final validation loss."""
    from megacpp.train.config import load_run_config
    from megacpp.train.trainer import train as run_training

    overrides = [f"data.dir={data}", f"run.out_dir={run_dir}", f"train.steps={args.steps}",
                 f"data.val_batches={args.val_batches}", "train.eval_every=0",
                 f"checkpoint.every={args.steps}", "run.device=cpu", "run.plots=false",
                 f"run.seed={args.seed}", f"run.cpu_threads={args.threads}",
                 f"schedule.warmup_steps={max(1, args.steps // 10)}"]
    cfg = load_run_config(RUN_CONFIG, overrides)
    start = time.perf_counter()
    result = run_training(cfg, show_progress=False)
    return {"steps": result.steps, "final_train_loss": round(result.final_loss, 4),
            "val_loss": result.final_val_loss, "val_bpb": result.final_val_bpb,
            "tokens": result.tokens, "seconds": round(time.perf_counter() - start, 1),
            "receipt": result.receipt}


def main() -> None:
    from megacpp.receipts.results import results_dir

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sources", nargs="+", default=["/usr/include/c++/12"])
    parser.add_argument("--fim-rate", type=float, nargs="+", default=[0.5],
                        help="one FIM build and run per rate, each against the one baseline")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--val-batches", type=int, default=0,
                        help="validation batches of 8 rows (0: the whole split)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--workers", type=int, default=2, help="data build worker processes")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads of training (1 keeps a shared CPU from stalling "
                             "the step on a descheduled thread)")
    parser.add_argument("--goal", type=float, default=0.01)
    parser.add_argument("--out", type=Path, default=results_dir(BENCHMARK, "cpu",
                                                                ROOT / "benchmarks" / "results"))
    args = parser.parse_args()
    run(args)


def run(args: argparse.Namespace) -> None:
    from megacpp.data.build import BuildConfig
    from megacpp.receipts import write_receipt
    from megacpp.receipts.results import begin

    begin(args.out, STEM, STEM)  # command.txt
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="fim-loss-") as tmp:
        tmp_dir = Path(tmp)
        datasets = {"baseline": tmp_dir / "data-base"}
        builds = [build(args.sources, datasets["baseline"], 0.0, args.seed, None, args.workers)]
        print(f"built baseline: {builds[-1]}", flush=True)
        tokenizer = datasets["baseline"] / "tokenizer.json"
        for rate in args.fim_rate:
            datasets[f"fim_{rate:g}"] = tmp_dir / f"data-fim-{rate:g}"
            builds.append(build(args.sources, datasets[f"fim_{rate:g}"], rate, args.seed,
                                tokenizer, args.workers))
            print(f"built FIM rate {rate:g}: {builds[-1]}", flush=True)
        validation = {_validation_shards(path) for path in datasets.values()}
        if len(validation) != 1:
            raise SystemExit("error: the builds' validation splits differ; the comparison "
                             "would not be on the same tokens")
        runs = {}
        for name, data in datasets.items():
            runs[name] = train(data, tmp_dir / f"run-{name}", args)
            print(f"trained {name}: {runs[name]}", flush=True)
            receipt = Path(runs[name].pop("receipt"))
            target = args.out / "receipts" / STEM / f"train-{name}.receipt.json"
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(receipt, target)
            runs[name]["receipt"] = str(target.relative_to(args.out))
    base = runs["baseline"]["val_loss"]
    comparisons = []
    for rate in args.fim_rate:
        fim = runs[f"fim_{rate:g}"]["val_loss"]
        relative = (fim - base) / base
        comparisons.append({"fim_rate": rate, "val_loss": round(fim, 5),
                            "relative_difference": round(relative, 5),
                            "within_goal": abs(relative) <= args.goal})
    result = {
        "benchmark": STEM, "device": "cpu", "cpus": os.cpu_count(),
        "sources": [str(Path(s).resolve()) for s in args.sources],
        "data_config": DATA_CONFIG, "run_config": RUN_CONFIG, "steps": args.steps,
        "val_batches": args.val_batches, "seed": args.seed, "threads": args.threads,
        "fim_rates": args.fim_rate,
        "spm_rate": BuildConfig.from_toml(DATA_CONFIG).fim.spm_rate,  # what build() used
        "validation_split_identical": True,
        "val_loss_baseline": round(base, 5), "goal": args.goal, "comparisons": comparisons,
        "builds": builds, "runs": runs,
        "loadavg_before": [round(x, 2) for x in load_before],
        "loadavg_after": [round(x, 2) for x in os.getloadavg()],
    }
    out = args.out / f"{STEM}.json"
    out.write_text(json.dumps(result, indent=2) + "\n")
    metrics = {"val_loss_baseline": base}
    for c in comparisons:
        metrics[f"val_loss_fim_{c['fim_rate']:g}"] = c["val_loss"]
        metrics[f"relative_difference_fim_{c['fim_rate']:g}"] = c["relative_difference"]
    write_receipt(args.out / "receipts" / STEM / f"{STEM}.receipt.json", "bench",
                  config={k: v for k, v in result.items() if k not in ("builds", "runs")},
                  metrics=metrics, artifacts=[out])
    print(f"validation loss: baseline {base:.4f}", flush=True)
    for c in comparisons:
        verdict = "within" if c["within_goal"] else "NOT within"
        print(f"  FIM rate {c['fim_rate']:g}: {c['val_loss']:.4f} "
              f"({c['relative_difference']:+.2%}, {verdict} {args.goal:.0%})")
    print(f"wrote {out}")


def _validation_shards(dataset: Path) -> tuple[str, ...]:
    manifest = json.loads((dataset / "manifest.json").read_text())
    return tuple(s["sha256"] for s in manifest["splits"]["validation"]["shards"])


if __name__ == "__main__":
    main()
