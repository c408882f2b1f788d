"""``megacpp train --config FILE [--set key=value ...]``: train (or resume) a run.

Works the same in one process and under ``torchrun --nproc-per-node N -m megacpp train ...``.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console

app = typer.Typer(add_completion=False)


@app.command()
def train(
    config: Annotated[
        Path, typer.Option("--config", help="A run config: a TOML path ([run], [model], [data], "
                           "[train]... tables) or the name of a shipped run config "
                           "(tiny-cpu, nam56r-350m-gpu).")
    ],
    set_: Annotated[
        list[str] | None,
        typer.Option("--set", help="Override a config key: TABLE.KEY=VALUE (repeatable)."),
    ] = None,
    resume: Annotated[
        str | None,
        typer.Option("--resume", help="'auto' (the newest checkpoint of the run directory, or a "
                     "fresh start when it has none) or a checkpoint directory."),
    ] = None,
    fallback_to_previous: Annotated[
        bool,
        typer.Option("--fallback-to-previous", help="If the checkpoint to resume is incomplete "
                     "or corrupt, resume from the newest intact one before it."),
    ] = False,
    skip_preflight: Annotated[
        list[str] | None,
        typer.Option("--skip-preflight", help="Run despite this preflight rule's error "
                     "(repeatable; recorded in the receipt)."),
    ] = None,
    device: Annotated[str | None, typer.Option(
        "--device", help="auto (cuda when a GPU is present, else cpu), cpu or cuda; overrides "
        "the config's [run] device.")] = None,
    progress: Annotated[bool, typer.Option(help="Show the progress bar.")] = True,
) -> None:
    """Train a model from a run config: AdamW + Muon, checkpoints, metrics and a receipt."""
    from megacpp.train.config import load_run_config
    from megacpp.train.trainer import train as run_training

    overrides = [*(set_ or []), *([f"run.device={device}"] if device is not None else [])]
    cfg = load_run_config(config, overrides)
    result = run_training(cfg, resume=resume, fallback_to_previous=fallback_to_previous,
                          skip_preflight=skip_preflight or [], show_progress=progress,
                          clock_from_process_start=True)
    if os.environ.get("RANK", "0") != "0":  # under torchrun only rank 0 reports
        return
    val = f", validation loss {result.final_val_loss:.4f}" if result.final_val_loss else ""
    mfu = f", MFU {result.mfu:.1%}" if result.mfu is not None else ""
    Console(highlight=False).print(
        f"trained {result.steps} steps: loss {result.final_loss:.4f}{val}, "
        f"{result.tokens_per_s:,.0f} tokens/s{mfu}\n"
        f"checkpoint {result.checkpoint}\nreceipt {result.receipt}")
