"""Guards: stop on a non-finite loss or gradient before it reaches the weights; warn on
loss spikes.

A non-finite value is checked after backward and before the optimizer step, so the step
that produced it never updates the parameters and no checkpoint is ever written from that
state. The error names the first parameter (in model order) whose gradient is non-finite.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
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
