"""`megacpp train` and `megacpp plot` through the real CLI entry point: clean one-line
errors for bad input, the plots."""

from __future__ import annotations

import io

import pytest
from rich.console import Console

from megacpp.cli.main import main
from megacpp.train.config import RunConfig
from megacpp.train.trainer import train
from tests.train.helpers import run_config, write_config


def _cli(capsys, *argv: str) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as exit_info:
        main(list(argv))
    out = capsys.readouterr()
    return exit_info.value.code, out.out, out.err


def test_train_help_lists_the_options(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")
    code, out, _ = _cli(capsys, "train", "--help")
    assert code == 0
    for option in ("--config", "--set", "--resume", "--fallback-to-previous", "--skip-preflight"):
        assert option in out


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--config", "/no/such/run.toml"], "run config /no/such/run.toml does not exist"),
        (["--config", "tiny-cpu", "--set", "train.steps"], "expected TABLE.KEY=VALUE"),
        (["--config", "tiny-cpu", "--set", "optim.lr=-1"], "optim.lr = -1.0 is invalid"),
    ],
)
def test_train_bad_input_is_one_line_without_traceback(capsys, args, message):
    code, _, err = _cli(capsys, "train", *args)
    assert code == 2 and message in err and "Traceback" not in err
    assert err.startswith("error:")


def test_train_unknown_preflight_rule_is_refused(capsys, tmp_path, cpp_dataset):
    config = write_config(tmp_path / "r.toml", run_config(cpp_dataset, tmp_path / "run"))
    code, _, err = _cli(capsys, "train", "--config", str(config), "--skip-preflight", "no-rule")
    assert code == 2 and "unknown preflight rule(s) to skip: no-rule" in err


def test_plot_writes_loss_and_throughput_pngs(capsys, tmp_path, cpp_dataset):
    cfg = RunConfig.from_dict(run_config(cpp_dataset, tmp_path / "run", train={"steps": 3}))
    train(cfg, console=Console(file=io.StringIO()))
    code, out, _ = _cli(capsys, "plot", str(tmp_path / "run"))
    assert code in (0, None)
    pngs = [line for line in out.splitlines() if line.endswith(".png")]
    assert [p.rsplit("/", 1)[-1] for p in pngs] == ["loss.png", "throughput.png"]
    for png in pngs:
        with open(png, "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_plot_of_a_non_run_directory_is_a_clear_error(capsys, tmp_path):
    code, _, err = _cli(capsys, "plot", str(tmp_path))
    assert code == 2 and "metrics.jsonl not found" in err
    (tmp_path / "metrics.jsonl").write_text('{"type": "train", "step": 1, "loss": 1.0}\nnot json\n'
                                            '{"type": "train", "step": 2}\n')
    code, _, err = _cli(capsys, "plot", str(tmp_path))
    assert code == 2 and "metrics.jsonl:2: malformed metrics line" in err
