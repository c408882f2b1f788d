"""``megacpp version`` (also ``megacpp --version``)."""

from __future__ import annotations

import typer

app = typer.Typer(add_completion=False)


def version_line() -> str:
    import torch

    from megacpp import __version__

    return f"megacpp {__version__} (torch {torch.__version__})"


@app.command()
def version() -> None:
    """Print the megacpp and torch versions."""
    typer.echo(version_line())
