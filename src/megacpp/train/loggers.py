"""Experiment logs besides ``metrics.jsonl``: TensorBoard and Weights & Biases.

``[run] loggers`` lists them (``["jsonl"]`` by default; ``"jsonl"`` is always required:
plots, receipts and resume read ``metrics.jsonl``). Every metrics record's numbers go to each
logger under ``<type>/<key>`` at the record's step, so ``train/loss`` at step 7 is
metrics.jsonl's ``loss`` of step 7 (``null`` values are skipped, booleans are 0/1).

* ``tensorboard`` (``pip install 'megacpp[tensorboard]'``): event files in
  ``RUN_DIR/tensorboard/``, written by ``torch.utils.tensorboard`` as float64 scalars (the
  same numbers as the JSONL, not float32 roundings). A resumed run purges the steps after
  its checkpoint, as metrics.jsonl is cut back.
* ``wandb`` (``pip install 'megacpp[wandb]'``): one W&B run per ``megacpp train`` invocation
  under ``RUN_DIR/wandb/``, in project ``$WANDB_PROJECT`` (default ``megacpp``) and group
  ``run.name``, with the resolved run config; ``WANDB_MODE=offline`` keeps it local. A resumed
  run starts a new W&B run in the same group from the resumed step.

Only rank 0 logs.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from typing import Any, Protocol

from megacpp.errors import ConfigError, MegaCppError

LOGGERS = ("jsonl", "tensorboard", "wandb")
# logger -> (module it needs, the pip extra that installs it)
_NEEDS = {"tensorboard": ("tensorboard", "tensorboard"), "wandb": ("wandb", "wandb")}
TENSORBOARD_DIR = "tensorboard"
WANDB_DIR = "wandb"


def check_loggers(names: tuple[str, ...]) -> None:
    """Fail closed on an unknown logger, a missing ``jsonl``, a repeat, or a logger whose
    package is not installed (naming the pip extra)."""
    for name in names:
        if name not in LOGGERS:
            raise ConfigError(f"run.loggers: unknown logger {name!r}; allowed: "
                              f"{', '.join(LOGGERS)}")
    if "jsonl" not in names:
        raise ConfigError(f"run.loggers = {list(names)!r} must include \"jsonl\" (plots, "
                          "receipts and resume read metrics.jsonl)")
    if len(set(names)) != len(names):
        raise ConfigError(f"run.loggers = {list(names)!r} names a logger twice")
    for name in names:
        if name in _NEEDS:
            module, extra = _NEEDS[name]
            if importlib.util.find_spec(module) is None:
                raise ConfigError(f"run.loggers: {name!r} needs the {module} package: "
                                  f"pip install 'megacpp[{extra}]'")


def scalars(record: dict[str, Any]) -> dict[str, float]:
    """``{"<type>/<key>": value}`` for every number of a metrics record (not its step)."""
    kind = record.get("type", "train")
    out = {}
    for key, value in record.items():
        if key in ("type", "step") or value is None:
            continue
        if isinstance(value, bool):
            out[f"{kind}/{key}"] = float(value)
        elif isinstance(value, (int, float)):
            out[f"{kind}/{key}"] = value
    return out


class ScalarLogger(Protocol):
    def log(self, step: int, values: dict[str, float]) -> None: ...

    def close(self) -> None: ...


class ExperimentLoggers:
    """The TensorBoard and W&B loggers of one run (``jsonl`` is :class:`MetricsLog`)."""

    def __init__(self, loggers: list[ScalarLogger]) -> None:
        self.loggers = loggers

    @classmethod
    def open(cls, names: tuple[str, ...], run_dir: Path, run_name: str, config: dict[str, Any],
             start_step: int) -> ExperimentLoggers:
        """Open every logger in ``names`` but ``jsonl``; ``start_step`` is the step the run
        continues from (0 for a fresh run)."""
        check_loggers(names)
        opened: list[ScalarLogger] = []
        try:
            if "tensorboard" in names:
                opened.append(_TensorBoard(run_dir / TENSORBOARD_DIR, start_step))
            if "wandb" in names:
                opened.append(_WandB(run_dir, run_name, config))
        except BaseException:
            for logger in opened:
                logger.close()
            raise
        return cls(opened)

    def log(self, record: dict[str, Any]) -> None:
        values = scalars(record)
        for logger in self.loggers:
            logger.log(int(record["step"]), values)

    def close(self) -> None:
        for logger in self.loggers:
            logger.close()
        self.loggers = []


class _TensorBoard:
    def __init__(self, log_dir: Path, start_step: int) -> None:
        from torch.utils.tensorboard import SummaryWriter

        # purge_step writes a session start: TensorBoard drops the directory's older events
        # from that step on. Fresh runs write one too (the first start is not a restart).
        self.writer = SummaryWriter(str(log_dir), purge_step=start_step + 1)

    def log(self, step: int, values: dict[str, float]) -> None:
        for tag, value in values.items():
            self.writer.add_scalar(tag, value, step, new_style=True, double_precision=True)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class _WandB:
    def __init__(self, run_dir: Path, run_name: str, config: dict[str, Any]) -> None:
        import wandb

        (run_dir / WANDB_DIR).mkdir(parents=True, exist_ok=True)
        try:
            self.run = wandb.init(
                project=os.environ.get("WANDB_PROJECT") or "megacpp", name=run_name,
                group=run_name, dir=str(run_dir), config=config,
                settings=wandb.Settings(console="off", silent=True))
        except wandb.errors.Error as exc:  # login, network, bad WANDB_* settings: one line
            raise MegaCppError(f"wandb could not start a run ({type(exc).__name__}: {exc}); "
                               "set WANDB_MODE=offline to log locally") from None

    def log(self, step: int, values: dict[str, float]) -> None:
        self.run.log(values, step=step)

    def close(self) -> None:
        self.run.finish()
