"""One CLI: every subcommand's bad input is one ``error:`` line and exit 2; ``--device`` means
auto|cpu|cuda wherever a device applies; ``--config`` says what it takes; no subcommand
offers shell completion; ``--version``; and ``model describe`` does not import torch._dynamo.

Commands run in-process (``main([...])``); a few run as real processes, to show that the entry
point itself prints one line and exits 2.
"""

from __future__ import annotations

import contextlib
import importlib
import io
import subprocess
import sys
from pathlib import Path

import pytest
import typer

from megacpp.cli.main import COMMANDS, main

MISSING = "/no/such/path"


def run_cli(*args: str) -> tuple[int, str, str]:
    """``megacpp ARGS`` in this process: (exit status, stdout, stderr)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            main([str(a) for a in args])
            code = 0
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else 1
    return code, out.getvalue(), err.getvalue()


def assert_one_error_line(code: int, err: str, args: tuple) -> None:
    lines = err.strip().splitlines()
    assert code == 2, (args, code, err[-2000:])
    assert len(lines) == 1 and lines[0].startswith("error: "), (args, err[-2000:])
    assert "Traceback" not in err


def leaf_commands() -> dict[str, typer.core.TyperCommand]:
    """``{"data build": command, ...}``: every command a user can run."""
    leaves = {}
    for name, (module, _) in COMMANDS.items():
        command = typer.main.get_command(importlib.import_module(module).app)
        subcommands = getattr(command, "commands", {})
        if not subcommands or getattr(command, "invoke_without_command", False):
            leaves[name] = command
        leaves.update({f"{name} {sub}": cmd for sub, cmd in subcommands.items()})
    return leaves


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, str]:
    tmp = tmp_path_factory.mktemp("cli-bad")
    (tmp / "empty_dir").mkdir()
    (tmp / "bad.json").write_bytes(b"\xff\xfe not json")
    (tmp / "x.cpp").write_text("int main() { return 0; }\n")
    return {"dir": str(tmp / "empty_dir"), "json": str(tmp / "bad.json"),
            "cpp": str(tmp / "x.cpp"), "tmp": str(tmp)}


# One bad invocation per command; each must be refused before any real work starts.
BAD_INPUT: dict[str, tuple[str, ...]] = {
    "quickstart": ("--steps", "0", "--source", "{dir}", "--out", "{tmp}/qs"),
    "data build": (MISSING, "--out", "{tmp}/ds"),
    "data verify": ("{dir}",),
    "data stats": ("/dev/zero",),
    "data export-megatron": ("{dir}", "--out", "{tmp}/mg"),
    "tokenizer train": (MISSING, "--out", "{tmp}/t.json"),
    "tokenizer compare": (MISSING, "--vocab-size", "300"),
    "tokenizer info": ("/dev/zero",),
    "tokenizer encode": ("{json}", "int x;"),
    "model translate": ("AEM", "--to", "nemo"),
    "model describe": ("AEM", "--seq-len", "99999999999999999999999"),
    "train": ("--config", "/dev/zero"),
    "plot": ("{dir}",),
    "generate": ("--checkpoint", "{dir}", "--prompt", "int"),
    "eval sandbox-info": ("--isolation", "chroot"),
    "eval run": ("{cpp}", "--wall", "nan"),
    "eval verify-reference": ("--problems", "/dev/zero"),
    "eval mutation-check": ("--per-problem", "0"),
    "eval score": ("{json}", "--out", "{tmp}/score", "--problems", "{json}"),
    "eval humaneval-x": ("--checkpoint", "{dir}", "--out", "{tmp}/he", "--device", "tpu"),
    "posttrain tasks": ("--out", "{tmp}/tasks", "--family", "nope"),
    "posttrain sft": ("--base", "{dir}", "--data", "/dev/zero", "--out", "{tmp}/sft"),
    "posttrain grpo": ("--base", "{dir}", "--train", "{json}", "--out", "{tmp}/grpo",
                       "--group-size", "1"),
    "eval infill": ("{cpp}", "--checkpoint", "{dir}", "--out", "{tmp}/in", "--device", "tpu"),
    "serve": ("--checkpoint", "{dir}", "--device", "tpu"),
    "serve router-train": ("--source", "a={dir}", "--out", "{tmp}/r.json"),
    "kernels list": ("--dtype", "int3"),
    "kernels check": ("--device", "tpu"),
    "kernels bench": ("--surface", "no_such_surface", "--device", "cpu"),
    "env capture": ("--config", "{dir}"),
    "env diff": ("/dev/zero", "{json}"),
    "env devices": ("--bogus",),
    "env mfu": ("--flops-per-token", "many", "--tokens-per-s", "1"),
    "env preflight": ("--config", "{json}"),
    "env verify-site": ("--config", "/dev/zero"),
    "env patches": ("--facts", "{json}"),
    "receipts show": ("/dev/zero",),
    "receipts compare": ("{json}", "{json}"),
    "receipts golden": (MISSING,),
    "version": ("--bogus",),
    "export hf": ("{dir}", "--out", "{tmp}/hf"),
}


def test_every_command_has_a_bad_input_case():
    assert sorted(BAD_INPUT) == sorted(leaf_commands())


@pytest.mark.parametrize("command", sorted(BAD_INPUT))
def test_every_command_refuses_bad_input_with_one_line_and_exit_2(command, files):
    args = (*command.split(), *(a.format(**files) for a in BAD_INPUT[command]))
    before = sorted(p.name for p in Path(files["tmp"]).iterdir())
    code, _, err = run_cli(*args)
    assert_one_error_line(code, err, args)
    assert sorted(p.name for p in Path(files["tmp"]).iterdir()) == before  # nothing written


@pytest.mark.parametrize("args", [
    ("model", "describe", "AEM", "--config", "/dev/zero"),
    ("generate", "--checkpoint", MISSING, "--prompt", "int\udcff"),  # a non-UTF-8 byte
    ("model", "describe", "AEM", "--seq-len", "x"),  # a usage error, from click
])
def test_the_real_entry_point_prints_one_line_and_exits_2(args):
    done = subprocess.run([sys.executable, "-m", "megacpp", *args], capture_output=True,
                          text=True, errors="replace", check=False)
    assert_one_error_line(done.returncode, done.stderr, args)


def test_version_flag_and_command_agree():
    flag = subprocess.run([sys.executable, "-m", "megacpp", "--version"], capture_output=True,
                          text=True, check=True).stdout
    code, command, _ = run_cli("version")
    assert code == 0 and flag == command and flag.startswith("megacpp ") and "torch" in flag


def test_no_subcommand_offers_shell_completion():
    for name in COMMANDS:
        code, out, _ = run_cli(*name.split(), "--help")
        assert code == 0 and "--install-completion" not in out, name
    for name in leaf_commands():
        code, out, _ = run_cli(*name.split(), "--help")
        assert code == 0 and "--show-completion" not in out, name


def test_every_config_option_says_what_it_takes():
    kinds = ("model config", "run config", "data-build config", "[contract]")
    seen = 0
    for name, command in leaf_commands().items():
        for param in command.params:
            if "--config" in getattr(param, "opts", ()):
                seen += 1
                assert any(kind in (param.help or "") for kind in kinds), (name, param.help)
    assert seen >= 7


def test_device_options_take_auto_cpu_cuda():
    with_device = {name for name, command in leaf_commands().items()
                   if any("--device" in getattr(p, "opts", ()) for p in command.params)}
    assert {"generate", "serve", "train", "eval humaneval-x", "kernels list", "kernels check",
            "kernels bench"} <= with_device
    for name in with_device - {"env mfu"}:  # env mfu's --device is a device-profile name
        command = leaf_commands()[name]
        option = next(p for p in command.params if "--device" in getattr(p, "opts", ()))
        assert "auto" in (option.help or "") and "cuda" in option.help, name
    code, _, err = run_cli("kernels", "list", "--device", "auto")
    assert code == 0, err


def test_model_describe_does_not_import_dynamo():
    code = ("import sys\nfrom megacpp.cli.main import main\n"
            "try:\n    main(['model', 'describe', 'NAM56R', '--config', 'tiny', '--json'])\n"
            "except SystemExit as exc:\n    assert exc.code == 0, exc.code\n"
            "print('torch._dynamo' in sys.modules, 'sympy' in sys.modules, file=sys.stderr)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stderr.strip().splitlines()[-1] == "False False", done.stderr[-2000:]
