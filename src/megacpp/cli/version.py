"""``megacpp version``."""

from __future__ import annotations

import typer

app = typer.Typer()


@app.command()
def version() -> None:
    """Print the megacpp and torch versions."""
    import torch

    from megacpp import __version__

    typer.echo(f"megacpp {__version__} (torch {torch.__version__})")
