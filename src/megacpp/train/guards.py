"""Guards: stop on a non-finite loss or gradient before it reaches the weights; warn on
loss spikes; end a multi-GPU run whose step hangs (:class:`StepWatchdog`).

A non-finite value is checked after backward and before the optimizer step, so the step
that produced it never updates the parameters and no checkpoint is ever written from that
state. The error names the first parameter (in model order) whose gradient is non-finite.
"""

from __future__ import annotations

import math
import os
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from megacpp.errors import MegaCppError
from megacpp.train.config import GuardSection
from megacpp.train.parallelize import all_reduce_


class NonFiniteError(MegaCppError):
    """The loss or a gradient became NaN/inf; the run stopped before applying it."""


def first_nonfinite_grad(named_params: Sequence[tuple[str, nn.Parameter]]) -> str | None:
    """The first parameter (in ``named_params`` order) with a NaN/inf gradient on any rank."""
    first = len(named_params)
    for index, (_, p) in enumerate(named_params):
        grad = p.grad
        if grad is None:
            continue
        local = grad.to_local() if isinstance(grad, DTensor) else grad
        if not bool(torch.isfinite(local).all()):
            first = index
            break
    found = all_reduce_(torch.tensor([first], dtype=torch.int64, device=_device(named_params)),
                        "min")
    index = int(found.item())
    return named_params[index][0] if index < len(named_params) else None


def _device(named_params: Sequence[tuple[str, nn.Parameter]]) -> torch.device:
    p = named_params[0][1]
    return (p.to_local() if isinstance(p, DTensor) else p).device


def check_finite(step: int, loss: float, grad_norm: float,
                 named_params: Sequence[tuple[str, nn.Parameter]]) -> None:
    """Raise :class:`NonFiniteError` if the step's loss or gradient norm is not finite."""
    if math.isfinite(loss) and math.isfinite(grad_norm):
        return
    culprit = first_nonfinite_grad(named_params)
    what = "loss" if not math.isfinite(loss) else "gradient"
    where = (f"first parameter with a non-finite gradient: {culprit}" if culprit
             else "every gradient is finite")
    raise NonFiniteError(f"non-finite {what} at step {step} (loss={loss}, grad_norm={grad_norm}); "
                         f"{where}. The step was not applied and no checkpoint was written "
                         "from this state.")


@dataclass
class SpikeDetector:
    """Warns when the loss jumps far above its recent level.

    Tracks an exponential moving mean and variance of the loss; a step whose loss exceeds
    ``mean + zscore * std`` (after ``warmup_steps`` observations) is a spike. The state is
    saved in checkpoints so a resumed run flags exactly the same steps.
    """

    zscore: float = 6.0
    warmup_steps: int = 20
    decay: float = 0.95
    mean: float = 0.0
    var: float = 0.0
    count: int = 0
    spikes: int = 0

    @classmethod
    def from_config(cls, cfg: GuardSection) -> SpikeDetector:
        return cls(zscore=cfg.spike_zscore, warmup_steps=cfg.spike_warmup_steps,
                   decay=cfg.spike_ema)

    def observe(self, loss: float) -> bool:
        """Record ``loss``; True when it is a spike."""
        spike = (self.count >= self.warmup_steps and self.count > 0
                 and loss > self.mean + self.zscore * math.sqrt(self.var))
        if self.count == 0:
            self.mean = loss
        else:
            delta = loss - self.mean
            self.mean += (1 - self.decay) * delta
            self.var = self.decay * (self.var + (1 - self.decay) * delta * delta)
        self.count += 1
        self.spikes += int(spike)
        return spike

    def state_dict(self) -> dict[str, float]:
        return {"mean": self.mean, "var": self.var, "count": self.count, "spikes": self.spikes}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.mean, self.var = float(state["mean"]), float(state["var"])
        self.count, self.spikes = int(state["count"]), int(state["spikes"])


class StepWatchdog:
    """Ends the process when a step runs longer than ``timeout_s``: the backstop for the
    collectives inside a replayed CUDA graph, which the process group's own timeout does not
    watch (a rank that dies there would leave the others spinning in NCCL forever).

    ``arm()`` at a step's start, ``disarm()`` at its end; a thread checks once a second. On
    expiry it calls ``on_expire(seconds)`` (the trainer writes its receipt and prints the
    error line) and then ``exit_process(1)`` -- ``os._exit``: the main thread is blocked in
    the device and cannot raise."""

    def __init__(self, timeout_s: float, on_expire: Callable[[float], None],
                 exit_process: Callable[[int], None] = os._exit, poll_s: float = 1.0) -> None:
        self.timeout_s = timeout_s
        self.on_expire = on_expire
        self.exit_process = exit_process
        self.poll_s = poll_s
        self._armed_at: float | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="megacpp-step-watchdog",
                                        daemon=True)
        self._thread.start()

    def arm(self) -> None:
        self._armed_at = time.monotonic()

    def disarm(self) -> None:
        self._armed_at = None

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def _watch(self) -> None:
        while not self._stop.wait(self.poll_s):
            armed = self._armed_at
            if armed is None or time.monotonic() - armed <= self.timeout_s:
                continue
            try:
                self.on_expire(time.monotonic() - armed)
            finally:
                self.exit_process(1)
            return
