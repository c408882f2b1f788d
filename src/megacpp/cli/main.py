"""The ``megacpp`` console script: one typer app with a sub-app per area.

Each area owns one module here (``cli/model.py``, ``cli/data.py``, ...) exposing ``app``.
Errors a user can cause (:class:`megacpp.errors.MegaCppError`) print one line and exit
non-zero; they never show a traceback.
"""

from __future__ import annotations

import importlib
import sys

import typer
from rich.console import Console

from megacpp.errors import MegaCppError

# (command name, module, help) -- a group is shown once its module registers a command.
_GROUPS: list[tuple[str, str, str]] = [
    ("model", "megacpp.cli.model", "Hybrid patterns: describe, translate."),
    ("data", "megacpp.cli.data", "Build, inspect and export C/C++ corpora."),
    ("tokenizer", "megacpp.cli.tokenizer", "Train and inspect the C++ tokenizer."),
    ("env", "megacpp.cli.env", "The environment contract: capture, diff, preflight, integrity."),
    ("receipts", "megacpp.cli.receipts", "Show and compare run/bench/eval receipts."),
    ("eval", "megacpp.cli.eval", "Verifier-first C++ evaluation."),
    ("kernels", "megacpp.cli.kernels", "The kernel catalog: list, check, bench."),
]

# Top-level commands (``megacpp train``, ``megacpp quickstart``...) live in modules that
# expose ``register(app)``.
_TOP_LEVEL: list[str] = [
    "megacpp.cli.train",
    "megacpp.cli.generate",
    "megacpp.cli.serve",
    "megacpp.cli.quickstart",
]

err_console = Console(stderr=True)


def build_app() -> typer.Typer:
    app = typer.Typer(
        name="megacpp",
        help="MegaCpp: train, measure and serve small hybrid language models for C++ code.",
        no_args_is_help=True,
        pretty_exceptions_show_locals=False,
        add_completion=False,
    )
    @app.callback()
    def _root() -> None:
        """MegaCpp: train, measure and serve small hybrid language models for C++ code."""

    @app.command()
    def version() -> None:
        """Print the megacpp and torch versions."""
        import torch

        from megacpp import __version__

        typer.echo(f"megacpp {__version__} (torch {torch.__version__})")

    for name, module_name, help_text in _GROUPS:
        module = _import_optional(module_name)
        sub = getattr(module, "app", None) if module else None
        if sub is not None and (sub.registered_commands or sub.registered_groups):
            app.add_typer(sub, name=name, help=help_text)
    for module_name in _TOP_LEVEL:
        module = _import_optional(module_name)
        if module is not None and hasattr(module, "register"):
            module.register(app)
    return app


def _import_optional(module_name: str):
    """Import an area's CLI module; a module that does not exist yet is simply absent."""
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name == module_name:
            return None
        raise


def main(argv: list[str] | None = None) -> None:
    app = build_app()
    try:
        app(args=argv, prog_name="megacpp", standalone_mode=True)
    except MegaCppError as exc:
        err_console.print(f"[bold red]error:[/] {exc}", highlight=False, soft_wrap=True)
        sys.exit(exc.exit_code)


if __name__ == "__main__":  # pragma: no cover
    main()
