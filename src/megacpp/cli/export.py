"""``megacpp export hf RUN --out DIR``: a trained model as a Hugging Face directory."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console

app = typer.Typer(no_args_is_help=True, add_completion=False)


@app.callback()
def _export() -> None:
    """Export a trained model."""


@app.command()
def hf(
    checkpoint: Annotated[Path, typer.Argument(
        help="Run directory (its newest complete checkpoint) or RUN/checkpoints/step_N.")],
    out: Annotated[Path, typer.Option(help="Directory to write (new, or empty).")],
    max_shard_size: Annotated[str, typer.Option(
        help="Split the weights into safetensors shards of at most this size (2GB, 500MB).")
    ] = "2GB",
    tokenizer: Annotated[Path | None, typer.Option(
        help="tokenizer.json (default: the one of the run's dataset).")] = None,
    eval_dir: Annotated[list[Path] | None, typer.Option("--eval", help=(
        "A `megacpp eval` output directory whose pass@k goes into the model card "
        "(repeatable)."))] = None,
    adapter_only: Annotated[bool, typer.Option("--adapter-only", help=(
        "For a LoRA run: write only its adapter, in peft's format (default: the merged "
        "model)."))] = False,
) -> None:
    """Write a trained model as a Hugging Face directory that transformers loads.

    Safetensors weights, config.json with the modeling files (trust_remote_code), the
    tokenizer files, generation_config.json and a model card from the run's receipt."""
    from megacpp.export.hf import export_run

    written = export_run(checkpoint, out, max_shard_size=max_shard_size, tokenizer=tokenizer,
                         eval_dirs=tuple(eval_dir or ()), adapter_only=adapter_only)
    files = sorted(p.name for p in written.iterdir())
    Console(highlight=False).print(f"wrote {written}: {', '.join(files)}")
