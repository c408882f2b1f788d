"""Per-step metrics: the JSONL log, throughput and MFU, peak memory, the progress bar.

``metrics.jsonl`` holds one JSON object per line:

* ``{"type": "train", "step", "loss", "aux_loss", "mtp_loss", "grad_norm", "lr", "tokens",
  "tokens_per_s", "mfu", "peak_mem_bytes", "moe_balance", "spike", "time_s"}`` per step
  (``loss`` is the next-token cross-entropy; ``aux_loss`` the auxiliary losses (MoE balance,
  DSA indexer KL) and ``mtp_loss`` the multi-token-prediction loss before its weight, null
  without MTP; ``mfu`` is null where the device's peak is unknown; ``moe_balance`` is the
  worst MoE layer's max/mean expert load over the step, null without MoE layers);
* ``{"type": "val", "step", "val_loss", "val_tokens"}`` per evaluation.

On resume the log is cut back to the checkpoint's step, so every step appears once.
"""

from __future__ import annotations

import json
import resource
import sys
from pathlib import Path
from typing import Any, Self

import torch
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from megacpp._io import LOG_LIMIT, atomic_write_text, read_bounded
from megacpp.contract.devices import DeviceProfile, mfu
from megacpp.errors import MegaCppError

METRICS_FILE = "metrics.jsonl"


class MetricsLog:
    """Append-only JSONL metrics of one run (written by rank 0 only)."""

    def __init__(self, path: Path, enabled: bool = True) -> None:
        self.path = path
        self.enabled = enabled

    def truncate_after(self, step: int) -> None:
        """Keep only records of steps <= ``step`` (and drop a line cut short by a crash)."""
        if not self.enabled or not self.path.exists():
            return
        kept = [r for r in read_metrics(self.path, tolerate_partial=True) if r["step"] <= step]
        atomic_write_text(self.path, "".join(json.dumps(r) + "\n" for r in kept))

    def reset(self) -> None:
        if self.enabled:
            atomic_write_text(self.path, "")

    def write(self, record: dict[str, Any]) -> None:
        if not self.enabled:
            return
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps(record) + "\n")
            f.flush()


def read_metrics(path: Path, tolerate_partial: bool = False) -> list[dict[str, Any]]:
    """The records of a metrics log. A malformed line is an error naming it, except (with
    ``tolerate_partial``) an unterminated last line, which a crash mid-write can leave."""
    lines = read_bounded(path, LOG_LIMIT, what="metrics log").split(b"\n")
    records = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line.decode("utf-8"))
            step = record.get("step") if isinstance(record, dict) else None
            valid = isinstance(step, int) and not isinstance(step, bool)
        except (ValueError, RecursionError) as exc:  # UnicodeDecodeError is a ValueError
            if tolerate_partial and number == len(lines):
                break
            what = str(exc).splitlines()[0][:120]
            raise MegaCppError(f"{path}:{number}: malformed metrics line ({what}); fix or "
                               "delete that line") from None
        if not valid:
            raise MegaCppError(f"{path}:{number}: not a metrics record (an object with a 'step')")
        records.append(record)
    return records


def peak_memory_bytes(device: torch.device) -> int:
    """CUDA: peak allocated tensor memory; CPU: the process's peak resident set size."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(rss if sys.platform == "darwin" else rss * 1024)  # Linux reports KiB


class MfuMeter:
    """MFU = analytic training FLOPs per token x tokens/s per device / the device's peak."""

    def __init__(self, train_flops_per_token: int, profile: DeviceProfile, dtype: str) -> None:
        self.flops_per_token = train_flops_per_token
        self.profile = profile
        self.dtype = dtype  # "bf16" (autocast) or "fp32"
        if dtype != "bf16":
            self.note = (f"n/a: {profile.name} runs fp32 here and MFU is quoted against dense "
                         "bf16/fp8/fp4 peaks only")
        elif profile.peak("bf16") is None:
            self.note = f"n/a: no published dense bf16 peak for {profile.name}"
        else:
            self.note = f"against {profile.peak('bf16')} TFLOP/s dense bf16 ({profile.name})"

    def __call__(self, tokens_per_s_per_device: float) -> float | None:
        if self.dtype != "bf16" or tokens_per_s_per_device <= 0:
            return None
        return mfu(self.flops_per_token, tokens_per_s_per_device, self.profile, "bf16").mfu


class TrainProgress:
    """Rank 0's progress bar and messages; other ranks stay silent."""

    def __init__(self, console: Console, total: int, start: int, is_main: bool,
                 show_bar: bool = True) -> None:
        self.enabled = is_main
        self.progress = Progress(
            TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(),
            TextColumn("{task.fields[status]}"), TimeElapsedColumn(),
            console=console, disable=not (is_main and show_bar), transient=False,
        )
        self.task = self.progress.add_task("train", total=total, completed=start, status="")

    def __enter__(self) -> Self:
        self.progress.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.progress.stop()

    def update(self, record: dict[str, Any]) -> None:
        status = (f"loss {record['loss']:.4f}  lr {record['lr']:.2e}  "
                  f"{record['tokens_per_s']:,.0f} tok/s")
        if record.get("mfu") is not None:
            status += f"  MFU {record['mfu']:.1%}"
        self.progress.update(self.task, completed=record["step"], status=status)

    def print(self, message: str) -> None:
        if self.enabled:
            self.progress.console.print(message, highlight=False)
