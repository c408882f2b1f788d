"""``megacpp plot RUN_DIR``: PNG plots of a training run's loss and throughput."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

app = typer.Typer(add_completion=False)


@app.command()
def plot(
    run_dir: Annotated[Path, typer.Argument(help="A training run directory (has metrics.jsonl).")],
    out: Annotated[
        Path | None, typer.Option("--out", help="Where to write the PNGs (default RUN_DIR/plots).")
    ] = None,
) -> None:
    """Write loss.png and throughput.png from the run's metrics.jsonl."""
    from megacpp.train.plot import plot_run

    for path in plot_run(run_dir, out):
        typer.echo(str(path))
