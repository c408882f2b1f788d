"""Per-step metrics: the JSONL log, throughput and MFU, peak memory, the progress bar.

``metrics.jsonl`` holds one JSON object per line:

* ``{"type": "train", "step", "loss", "aux_loss", "mtp_loss", "grad_norm", "lr", "tokens",
  "tokens_per_s", "mfu", "peak_mem_bytes", "moe_balance", "spike", "time_s", "clock_s"}``
  per step (``clock_s``: the run's clock when the record is written, :class:`RunClock`)
  (``loss`` is the next-token cross-entropy; ``aux_loss`` the auxiliary losses (MoE balance,
  DSA indexer KL) and ``mtp_loss`` the multi-token-prediction loss before its weight, null
  without MTP; ``mfu`` is null where the device's peak is unknown; ``moe_balance`` is the
  worst MoE layer's max/mean expert load over the step, null without MoE layers);
* ``{"type": "val", "step", "val_loss", "val_tokens", "val_bytes", "val_bpb", "tokens",
  "clock_s"}`` per evaluation (``val_bpb``: bits per byte of the source text the targets
  cover, :func:`bits_per_byte`; ``tokens``: training tokens so far; ``clock_s``: the run's
  clock, :class:`RunClock`);
* ``{"type": "setup", "step", "world_size", "strategy", "modes", "global_batch",
  "mfu_peak_tflops", "mfu_peak_source"}`` when a run (or a resumed segment) starts: how it
  runs and what MFU divides by.

On resume the log is cut back to the checkpoint's step, so every step appears once.
"""

from __future__ import annotations

import json
import math
import os
import resource
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Self

import torch
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from megacpp._io import LOG_LIMIT, atomic_write_text, read_bounded
from megacpp.contract.devices import DeviceProfile, mfu
from megacpp.errors import MegaCppError, describe_error
from megacpp.kernels.timing import matmul_peak_tflops

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


def bits_per_byte(nll_nats: float, n_bytes: int) -> float | None:
    """Summed next-token negative log-likelihood (nats) over the UTF-8 bytes those tokens
    cover, in bits per byte: ``nll / (ln 2 * bytes)``; None without bytes. It does not depend
    on the tokenizer, so models with different vocabularies compare on it."""
    return nll_nats / (math.log(2) * n_bytes) if n_bytes > 0 else None


def target_bytes(labels: torch.Tensor, token_nbytes: torch.Tensor, ignore_index: int) -> int:
    """The source bytes the targets of ``labels`` (any shape; ``ignore_index`` = no target)
    stand for: each target token's byte length (``token_nbytes``, 0 for special tokens such
    as EOS) summed."""
    targets = labels[labels != ignore_index]
    return int(token_nbytes[targets].sum())


def process_age_s() -> float | None:
    """Seconds since this process started (Linux: /proc/self/stat against CLOCK_BOOTTIME,
    10 ms resolution); None where that cannot be read."""
    try:
        with open("/proc/self/stat", encoding="ascii") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        started = int(fields[19]) / os.sysconf("SC_CLK_TCK")  # field 22: start time, ticks
        return time.clock_gettime(time.CLOCK_BOOTTIME) - started
    except (OSError, ValueError, IndexError, AttributeError):
        return None


class RunClock:
    """A run's clock for time budgets: seconds since construction -- or, with
    ``from_process_start``, since the process started, so imports count too -- with setup,
    compilation, warm-up and graph capture all counted, less the time spent in :meth:`paused`
    blocks (validation, checkpoints), plus the clock of the checkpoint a run resumed from.
    Where the process start cannot be read it starts at construction."""

    def __init__(self, from_process_start: bool = False) -> None:
        now = time.perf_counter()
        age = process_age_s() if from_process_start else None
        self.startup_s = age if age is not None and age >= 0 else 0.0  # before construction
        self.origin = now - self.startup_s
        self.base = 0.0  # a resumed run's clock at its checkpoint
        self.paused_s = 0.0

    def __call__(self) -> float:
        return self.base + time.perf_counter() - self.origin - self.paused_s

    def wall_s(self) -> float:
        """Seconds since the process started (paused time included)."""
        return time.perf_counter() - self.origin

    def paused(self) -> _Paused:
        return _Paused(self)


class _Paused:
    def __init__(self, clock: RunClock) -> None:
        self.clock = clock

    def __enter__(self) -> None:
        self.started = time.perf_counter()

    def __exit__(self, *exc: object) -> None:
        self.clock.paused_s += time.perf_counter() - self.started


def peak_memory_bytes(device: torch.device) -> int:
    """CUDA: peak allocated tensor memory; CPU: the process's peak resident set size."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(rss if sys.platform == "darwin" else rss * 1024)  # Linux reports KiB


@dataclass(frozen=True)
class PeakFlops:
    """The bf16 rate MFU divides by, and how it was obtained."""

    tflops: float | None  # None: unknown (MFU is n/a)
    source: str
    measured: bool = False


def bf16_matmul_peak(device: torch.device, profile: DeviceProfile) -> PeakFlops:
    """The bf16 matmul peak of ``device``: measured (an 8192^3 GEMM after the clock settles,
    :func:`megacpp.kernels.timing.matmul_peak_tflops`, about 3 s) on CUDA; the device
    profile's datasheet peak where it cannot be measured, saying so; unknown on CPU."""
    if device.type == "cuda":
        try:
            with torch.cuda.device(device):
                value = matmul_peak_tflops()
        except (RuntimeError, torch.OutOfMemoryError) as exc:
            return _datasheet(profile, f"measuring it failed: {describe_error(exc)}")
        name = torch.cuda.get_device_name(device)
        return PeakFlops(value, f"measured in this run: bf16 8192^3 matmul on {name}", True)
    return _datasheet(profile, f"nothing to measure on {device.type}")


def _datasheet(profile: DeviceProfile, why: str) -> PeakFlops:
    value = profile.peak("bf16")
    if value is None:
        return PeakFlops(None, f"no measured or published dense bf16 peak for {profile.name} "
                               f"({why})")
    source = profile.sources.get("peak_dense_tflops") or profile.sources.get("*", "")
    return PeakFlops(value, f"datasheet dense bf16 of {profile.name} ({why}; {source})".rstrip())


class MfuMeter:
    """MFU = analytic training FLOPs per token x tokens/s per device / the bf16 peak ``peak``
    (measured on the device: :func:`bf16_matmul_peak`), through :func:`megacpp.contract.mfu`."""

    def __init__(self, train_flops_per_token: int, profile: DeviceProfile, dtype: str,
                 peak: PeakFlops) -> None:
        self.flops_per_token = train_flops_per_token
        self.profile = profile
        self.dtype = dtype  # "bf16" (autocast) or "fp32"
        self.peak = peak
        if dtype != "bf16":
            self.note = (f"n/a: {profile.name} runs fp32 here and MFU is quoted against dense "
                         "bf16/fp8/fp4 peaks only")
        elif peak.tflops is None:
            self.note = f"n/a: {peak.source}"
        else:
            self.note = f"against {peak.tflops:.0f} TFLOP/s bf16, {peak.source}"

    def __call__(self, tokens_per_s_per_device: float) -> float | None:
        if self.dtype != "bf16" or self.peak.tflops is None or tokens_per_s_per_device <= 0:
            return None
        return mfu(self.flops_per_token, tokens_per_s_per_device, self.profile, "bf16",
                   peak_tflops=self.peak.tflops, peak_source=self.peak.source).mfu


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
