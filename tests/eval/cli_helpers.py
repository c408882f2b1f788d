"""Running ``megacpp eval ...`` in-process and reading its one ``error:`` line."""

from __future__ import annotations

from megacpp.cli.main import main


def run_eval(capsys, *args: str) -> tuple[int, str, str]:
    """``megacpp eval ARGS`` in-process; returns (exit code, stdout, stderr)."""
    try:
        main(["eval", *args])
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def error_line(err: str) -> str:
    """The one ``error:`` line of a failed command (and no traceback)."""
    assert "Traceback" not in err, err
    (line,) = [line for line in err.splitlines() if line.startswith("error:")]
    return line
