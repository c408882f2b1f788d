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

import click
import typer
from rich.console import Console

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
    "kernels": ("megacpp.cli.kernels", "The kernel catalog: list, check, bench."),
    "env": ("megacpp.cli.env", "The environment contract: capture, diff, preflight, integrity."),
    "receipts": ("megacpp.cli.receipts", "Show and compare run/bench/eval receipts."),
    "version": ("megacpp.cli.version", "Print the megacpp and torch versions."),
}


def _available(module_name: str) -> bool:
    return importlib.util.find_spec(module_name) is not None


class LazyGroup(click.Group):
    """A click group whose subcommands are imported on first use."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return [name for name, (module, _) in COMMANDS.items() if _available(module)]

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        if name not in COMMANDS or not _available(COMMANDS[name][0]):
            return None
        module = importlib.import_module(COMMANDS[name][0])
        command = typer.main.get_command(module.app)
        command.name = name
        return command

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        rows = [(name, COMMANDS[name][1]) for name in self.list_commands(ctx)]
        with formatter.section("Commands"):
            formatter.write_dl(rows)


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"]})
def cli() -> None:
    """MegaCpp: train, measure and serve small hybrid language models for C++ code."""


err_console = Console(stderr=True)


def main(argv: list[str] | None = None) -> None:
    try:
        cli.main(args=argv, prog_name="megacpp", standalone_mode=True)
    except MegaCppError as exc:
        err_console.print(f"[bold red]error:[/] {exc}", highlight=False, soft_wrap=True)
        sys.exit(exc.exit_code)


if __name__ == "__main__":  # pragma: no cover
    main()
