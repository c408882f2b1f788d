"""Guards: an injected NaN stops the run within the step, names the parameter, writes no
checkpoint from that state, and the receipt records the failure; the spike detector."""

from __future__ import annotations

import io

import pytest
from rich.console import Console

from megacpp.cli.main import main
from megacpp.receipts import read_receipt
from megacpp.train.config import RunConfig
from megacpp.train.guards import SpikeDetector
from megacpp.train.trainer import TrainingFailed, train
from tests.train.helpers import run_config, train_losses, write_config

PARAM = "blocks.2.mixer.in_proj.weight"  # the Mamba mixer's input projection


def _failing_run(tmp_path, dataset, target: str):
    cfg = RunConfig.from_dict(run_config(dataset, tmp_path / "run", train={"steps": 8},
                                         debug={"nan_step": 5, "nan_target": target}))
    with pytest.raises(TrainingFailed) as err:
        train(cfg, console=Console(file=io.StringIO()))
    return err.value, tmp_path / "run"


def test_nan_gradient_stops_the_run_and_names_the_parameter(tmp_path, cpp_dataset):
    error, run_dir = _failing_run(tmp_path, cpp_dataset, PARAM)
    assert "non-finite gradient at step 5" in str(error)
    assert f"first parameter with a non-finite gradient: {PARAM}" in str(error)
    checkpoints = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    assert checkpoints == ["step_000002", "step_000004"]  # nothing from step 5 on
    assert len(train_losses(run_dir)) == 4  # step 5 was never applied nor logged
    receipt = read_receipt(error.receipt)
    assert receipt.metrics["completed"] == 0.0 and receipt.metrics["steps"] == 4
    assert PARAM in receipt.config["outcome"]["error"]
    assert receipt.config["outcome"]["status"] == "failed"


def test_nan_loss_names_the_first_parameter_in_model_order(tmp_path, cpp_dataset):
    error, run_dir = _failing_run(tmp_path, cpp_dataset, "loss")
    assert "non-finite loss at step 5" in str(error)
    assert "first parameter with a non-finite gradient: embed.weight" in str(error)
    assert not (run_dir / "checkpoints" / "step_000005").exists()


def test_unknown_nan_target_is_a_config_error(tmp_path, cpp_dataset):
    cfg = RunConfig.from_dict(run_config(cpp_dataset, tmp_path / "run", train={"steps": 2},
                                         debug={"nan_step": 1, "nan_target": "blocks.99.x"}))
    with pytest.raises(TrainingFailed, match="debug.nan_target = 'blocks.99.x' is not a param"):
        train(cfg, console=Console(file=io.StringIO()))


def test_cli_reports_the_failure_in_one_line(tmp_path, cpp_dataset, capsys):
    config = write_config(tmp_path / "nan.toml", run_config(
        cpp_dataset, tmp_path / "run", train={"steps": 3},
        debug={"nan_step": 2, "nan_target": PARAM}))
    with pytest.raises(SystemExit) as exit_info:
        main(["train", "--config", str(config), "--no-progress"])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and "Traceback" not in err
    last = err.splitlines()[-1]  # the error is one line, after the run's own messages
    assert last.startswith("error: non-finite gradient at step 2") and PARAM in last
    assert last.endswith("receipt.json)")


def test_spike_detector_flags_a_jump_after_warmup_only():
    detector = SpikeDetector(zscore=4.0, warmup_steps=5, decay=0.9)
    losses = [5.0, 4.9, 4.8, 4.75, 4.7, 4.65, 4.6, 4.58, 9.0, 4.55]
    flags = [detector.observe(x) for x in losses]
    assert flags == [False] * 8 + [True, False]
    assert detector.spikes == 1
    early = SpikeDetector(zscore=4.0, warmup_steps=5, decay=0.9)
    assert not any(early.observe(x) for x in (5.0, 50.0, 5.0))  # warming up: no verdict
    state = detector.state_dict()
    restored = SpikeDetector(zscore=4.0, warmup_steps=5, decay=0.9)
    restored.load_state_dict(state)
    assert restored.observe(20.0) and detector.observe(20.0)
