"""The ``megacpp`` console script: a lazy root group over one module per area.

Each entry below names a module exposing ``app`` (a ``typer.Typer``). A group's module
(``model``, ``data``, ...) holds several commands; a top-level command's module (``train``,
``quickstart``, ...) holds exactly one. Modules are imported only when their command runs,
so ``megacpp --help`` is instant and one area's heavy imports never slow another's.

Bad input gets one line on stderr, ``error: <what is wrong and what is accepted>``, and exit
status 2 (or the error's own status): a :class:`megacpp.errors.MegaCppError` from the library,
and a usage error (unknown option, a value of the wrong type, a missing argument) alike. The
line is printed without markup and with control characters escaped, so a hostile file name
cannot break it into several lines or drive the terminal. Bugs still show their traceback.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys

import typer
from rich.console import Console
from rich.text import Text
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
    "posttrain": ("megacpp.cli.posttrain", "Post-train with the verifier: tasks, SFT, GRPO."),
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


def _print_version(value: bool) -> None:
    if value:
        from megacpp.cli.version import version_line

        typer.echo(version_line())
        raise typer.Exit()


@app.callback()
def _root(
    version: bool = typer.Option(False, "--version", is_eager=True, callback=_print_version,
                                 help="Print the megacpp and torch versions and exit."),
) -> None:
    """MegaCpp: train, measure and serve small hybrid language models for C++ code."""


# click's exception classes, from wherever this typer takes click (vendored or not)
_click_exceptions = sys.modules[typer.BadParameter.__module__]
_CONTROL = {c: f"\\x{c:02x}" for c in (*range(0x20), 0x7F)} | {0x0A: "\\n", 0x0D: "\\r",
                                                                0x09: "\\t"}


def one_line(message: str) -> str:
    """``message`` as one printable line: control characters escaped, lone surrogates (from
    non-UTF-8 file names and arguments) shown as ``\\udcff``."""
    text = message.strip().translate(_CONTROL)
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def fail(message: str, exit_code: int = 2) -> None:
    """Print ``error: message`` as one line on stderr and exit with ``exit_code``."""
    err_console = Console(stderr=True, highlight=False, soft_wrap=True)
    err_console.print(Text.assemble(("error:", "bold red"), " ", one_line(message)))
    sys.exit(exit_code)


def _usage_message(exc: Exception) -> str:
    message = exc.format_message()
    ctx = getattr(exc, "ctx", None)
    return f"{message} (see '{ctx.command_path} --help')" if ctx is not None else message


def main(argv: list[str] | None = None) -> None:
    try:
        status = app(args=argv, prog_name="megacpp", standalone_mode=False)
    except MegaCppError as exc:
        fail(str(exc), exc.exit_code)
    except _click_exceptions.NoArgsIsHelpError as exc:  # a group without its command: help
        message = exc.format_message()  # rich help prints itself and returns ""
        if message:
            typer.echo(message, err=True)
        sys.exit(exc.exit_code)
    except _click_exceptions.ClickException as exc:  # a usage error: unknown option, bad value
        fail(_usage_message(exc), exc.exit_code)
    except typer.Abort:
        fail("interrupted", 130)
    except BrokenPipeError:  # stdout closed early (`megacpp ... | head`): nothing to report
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # the exit-time flush
        sys.exit(1)
    except OSError as exc:
        if exc.filename is None:
            raise
        # the file system refused a path the command was given or writes (disk full, read-only,
        # permission): the path and the reason, as one line
        where = exc.filename if exc.filename2 is None else f"{exc.filename} -> {exc.filename2}"
        fail(f"{where}: {exc.strerror or exc}")
    # as click's standalone mode does: exit 0 at the end, or typer.Exit's code (130: Ctrl-C)
    sys.exit(status if isinstance(status, int) and not isinstance(status, bool) else 0)


if __name__ == "__main__":  # pragma: no cover
    main()
