"""``megacpp quickstart``: the main job, end to end on a CPU in a few minutes.

1. Build a corpus from C++ sources found on this machine (libstdc++ headers at least).
2. Train the C++ tokenizer on it (part of the build) and pack 256-token rows.
3. Train the ``tiny`` preset on the CPU, showing the loss fall.
4. Sample a C++ completion from the trained checkpoint.
5. Print where the checkpoint, plots and receipt are, and the validation loss next to the
   corpus's unigram entropy (what a model that ignores context would score).
"""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Annotated

import numpy as np
import typer
from rich.console import Console
from rich.panel import Panel
from rich.syntax import Syntax
from rich.table import Table

from megacpp.errors import MegaCppError

app = typer.Typer(add_completion=False)

DATA_CONFIG = "tiny"  # shipped in megacpp/configs/data/
RUN_CONFIG = "tiny-cpu"
# Small header-only libraries that Debian packages put under /usr/include (used when present).
EXTRA_SOURCES = ("fmt", "nlohmann", "gtest", "gmock")
DEFAULT_PROMPT = "template <typename T>\nT clamp_value(T value, T lo, T hi) {\n"


def default_sources() -> list[Path]:
    """The newest libstdc++ header tree plus small header libraries found on the machine."""
    libstdcxx = sorted(
        (p for p in Path("/usr/include/c++").glob("*") if p.is_dir() and p.name.split(".")[0].isdigit()),
        key=lambda p: [int(x) for x in p.name.split(".") if x.isdigit()],
    )
    found = libstdcxx[-1:] + [Path("/usr/include") / n for n in EXTRA_SOURCES]
    return [p for p in found if p.is_dir()]


def unigram_entropy_nats(data_dir: Path) -> float:
    """Entropy of the train split's token distribution (padding excluded), in nats/token."""
    from megacpp.data.shards import ShardedDataset

    dataset = ShardedDataset.open(data_dir, verify=False)
    pad = dataset.tokenizer().pad_id
    counts = np.zeros(0, dtype=np.int64)
    for block in dataset.iter_blocks("train", with_provenance=False):
        c = np.bincount(block.tokens.ravel())
        counts = np.pad(counts, (0, max(0, len(c) - len(counts))))
        counts[: len(c)] += c
    if pad < len(counts):
        counts[pad] = 0
    p = counts[counts > 0] / counts.sum()
    return float(-(p * np.log(p)).sum())


@app.command()
def quickstart(
    out: Annotated[Path, typer.Option(help="Where the corpus and the run go.")] = Path("runs/quickstart"),
    sources: Annotated[
        list[Path] | None, typer.Option("--source", help="C++ source tree (repeatable); default: found on the machine.")
    ] = None,
    steps: Annotated[int, typer.Option(help="Training steps for the tiny model.")] = 300,
    threads: Annotated[int, typer.Option(help="CPU threads for training (0 = torch's default).")] = 0,
    prompt: Annotated[str, typer.Option(help="Prompt for the sample at the end.")] = DEFAULT_PROMPT,
    rebuild: Annotated[bool, typer.Option(help="Rebuild the corpus even if one is there.")] = False,
) -> None:
    """Build a corpus from C++ sources on this machine, train a tiny model on the CPU, and
    sample from it. Prints the checkpoint, plot and receipt paths."""
    console = Console()
    srcs = list(sources) if sources else default_sources()
    if not srcs:
        raise MegaCppError("no C++ sources found (looked for /usr/include/c++/*); pass --source DIR")
    if steps < 1:
        raise MegaCppError(f"--steps must be >= 1, got {steps}")
    out = out.absolute()
    data_dir = build_corpus(console, srcs, out / "data", rebuild)
    entropy = unigram_entropy_nats(data_dir)
    run_dir = fresh_run_dir(out)
    result = train_tiny(console, data_dir, run_dir, steps, threads)
    sample_completion(console, result.checkpoint, prompt)
    report(console, result, entropy)


def fresh_run_dir(out: Path) -> Path:
    """A new run directory per quickstart (earlier runs are never overwritten)."""
    stem = out / f"run-{time.strftime('%Y%m%d-%H%M%S')}"
    run_dir, n = stem, 1
    while run_dir.exists():
        n += 1
        run_dir = stem.with_name(f"{stem.name}-{n}")
    return run_dir


def build_corpus(console: Console, sources: list[Path], data_dir: Path, rebuild: bool) -> Path:
    from megacpp.data.build import BuildConfig, build_dataset
    from megacpp.data.shards import read_manifest

    console.rule("[bold]1. corpus")
    console.print("sources: " + ", ".join(str(s) for s in sources))
    if (data_dir / "_COMPLETE").exists() and not rebuild:
        read_manifest(data_dir)  # a complete, untampered dataset, or a clear error
        console.print(f"reusing the corpus in {data_dir} (--rebuild to rebuild it)")
        return data_dir
    result = build_dataset(
        sources, data_dir, BuildConfig.from_toml(DATA_CONFIG), overwrite=True, console=console
    )
    console.print(f"built {data_dir}: {_build_summary(result)}")
    return data_dir


def _build_summary(result) -> str:
    m = result.manifest
    splits = m["splits"]
    return (
        f"{m['documents']['count']} documents, "
        f"{splits['train']['tokens']:,} train / {splits['validation']['tokens']:,} validation tokens"
    )


def train_tiny(console: Console, data_dir: Path, run_dir: Path, steps: int, threads: int):
    from megacpp.train.config import load_run_config
    from megacpp.train.trainer import train

    console.rule("[bold]2. training the tiny model on the CPU")
    overrides = [
        f"data.dir={data_dir}",
        f"run.out_dir={run_dir}",
        f"train.steps={steps}",
        f"train.eval_every={max(1, steps // 3)}",
        f"checkpoint.every={steps}",
        f"run.cpu_threads={threads}",
        "run.device=cpu",
    ]
    table = Table("step", "loss", "val loss", "lr", "tokens/s", title="loss falling", title_justify="left")
    every = max(1, steps // 10)

    def on_record(record: dict) -> None:
        step = record.get("step", 0)
        if "val_loss" in record or step % every == 0 or step == steps:
            table.add_row(
                str(step),
                _fmt(record.get("loss")),
                _fmt(record.get("val_loss")),
                _fmt(record.get("lr"), ".2e"),
                _fmt(record.get("tokens_per_s"), ".0f"),
            )

    result = train(load_run_config(RUN_CONFIG, overrides), on_record=on_record, console=console)
    console.print(table)
    return result


def _fmt(value, spec: str = ".3f") -> str:
    return "" if value is None else format(value, spec)


def sample_completion(console: Console, checkpoint: Path, prompt: str) -> None:
    from megacpp.infer.generate import TextGenerator
    from megacpp.infer.sampling import SamplingParams
    from megacpp.pretrained import load_pretrained

    console.rule("[bold]3. sampling")
    trained = load_pretrained(checkpoint)  # the model and the tokenizer stored with it
    generator = TextGenerator(trained.model, trained.tokenizer)
    params = SamplingParams(temperature=0.8, top_p=0.95, max_new_tokens=160, seed=0)
    (completion,) = generator.complete(prompt, 1, params)
    console.print(Panel(Syntax(prompt + completion.text, "cpp", theme="ansi_dark"),
                        title=f"completion ({completion.finish_reason})", title_align="left"))


def report(console: Console, result, entropy: float) -> None:
    console.rule("[bold]4. results")
    val = result.final_val_loss
    verdict = ""
    if val is not None:
        verdict = "  [green]below[/]" if val < entropy else "  [red]not below[/]"
    console.print(
        f"validation loss {_fmt(val)} nats/token vs unigram entropy {entropy:.3f} nats/token "
        f"({entropy / math.log(2):.2f} bits){verdict}"
    )
    run = result.run_dir
    for label, path in [
        ("checkpoint", result.checkpoint),
        ("loss plot", run / "plots" / "loss.png"),
        ("throughput plot", run / "plots" / "throughput.png"),
        ("metrics", run / "metrics.jsonl"),
        ("receipt", result.receipt),
    ]:
        console.print(f"{label:>16}: {path}")
