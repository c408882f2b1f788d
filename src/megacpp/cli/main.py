"""The ``megacpp`` console script: a lazy root group over one module per area.

Each entry below names a module exposing ``app`` (a ``typer.Typer``). A group's module
(``model``, ``data``, ...) holds several commands; a top-level command's module (``train``,
``quickstart``, ...) holds exactly one. Modules are imported only when their command runs,
so ``megacpp --help`` is instant and one area's heavy imports never slow another's.

Errors a user can cause (:class:`megacpp.errors.MegaCppError`) print one line and exit
non-zero; they never show a traceback.
"""

from __future__ import annotations

import importlib
import sys

import typer
from rich.console import Console
from rich.markup import escape
from typer.core import TyperCommand, TyperGroup

from megacpp.errors import MegaCppError

# name -> (module, one-line help shown by `megacpp --help`)
COMMANDS: dict[str, tuple[str, str]] = {
    "quickstart": ("megacpp.cli.quickstart", "Build a corpus, train a tiny model on CPU, sample."),
    "data": ("megacpp.cli.data", "Build, inspect and export C/C++ corpora."),
    "tokenizer": ("megacpp.cli.tokenizer", "Train and inspect the C++ tokenizer."),
    "model": ("megacpp.cli.model", "Describe hybrid models; translate patterns."),
    "train": ("megacpp.cli.train", "Train a model from a run config (CPU, GPU, torchrun)."),
    "plot": ("megacpp.cli.plot", "Plot a training run's loss and throughput."),
    "generate": ("megacpp.cli.generate", "Sample completions from a checkpoint."),
    "eval": ("megacpp.cli.eval", "Verifier-first C++ evaluation."),
    "serve": ("megacpp.cli.serve", "OpenAI-compatible HTTP server."),
    "export": ("megacpp.cli.export", "Export a trained model (Hugging Face format)."),
    "kernels": ("megacpp.cli.kernels", "The kernel catalog: list, check, bench."),
    "env": ("megacpp.cli.env", "The environment contract: capture, diff, preflight, integrity."),
    "receipts": ("megacpp.cli.receipts", "Show and compare run/bench/eval receipts."),
    "version": ("megacpp.cli.version", "Print the megacpp and torch versions."),
}


def _available(module_name: str) -> bool:
    return importlib.util.find_spec(module_name) is not None


class LazyGroup(TyperGroup):
    """The root group: subcommands are imported on first use.

    While help is being formatted, commands are listed from :data:`COMMANDS` without
    importing them (a placeholder carries the one-line help)."""

    _listing = False

    def list_commands(self, ctx) -> list[str]:
        return [name for name, (module, _) in COMMANDS.items() if _available(module)]

    def get_command(self, ctx, cmd_name: str):
        if cmd_name not in COMMANDS or not _available(COMMANDS[cmd_name][0]):
            return None
        module_name, short_help = COMMANDS[cmd_name]
        if self._listing:
            return TyperCommand(name=cmd_name, help=short_help)
        command = typer.main.get_command(importlib.import_module(module_name).app)
        command.name = cmd_name
        return command

    def format_help(self, ctx, formatter) -> None:
        self._listing = True
        try:
            super().format_help(ctx, formatter)
        finally:
            self._listing = False


app = typer.Typer(
    cls=LazyGroup,
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_show_locals=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)


@app.callback()
def _root() -> None:
    """MegaCpp: train, measure and serve small hybrid language models for C++ code."""


err_console = Console(stderr=True)


def main(argv: list[str] | None = None) -> None:
    try:
        app(args=argv, prog_name="megacpp")
    except MegaCppError as exc:
        # escaped: messages are text, not markup ([model], megacpp[wandb], "[/path/f.cc:537]")
        err_console.print(f"[bold red]error:[/] {escape(str(exc))}", highlight=False,
                          soft_wrap=True)
        sys.exit(exc.exit_code)


if __name__ == "__main__":  # pragma: no cover
    main()
