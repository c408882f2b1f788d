"""Learning-rate schedules: a linear warmup, then cosine, WSD or constant.

The schedule is a pure function of the step, so a resumed run recomputes exactly the lr
the uninterrupted run would have used (there is no scheduler state to save). A run with a
time budget (``train.time_budget_s``) decays by the fraction of its budget spent instead of
the fraction of its steps (:func:`lr_factor_by_progress`); its warmup is still in steps.
"""

from __future__ import annotations

import math

from megacpp.train.config import ScheduleSection


def lr_factor(step: int, total_steps: int, cfg: ScheduleSection) -> float:
    """The multiplier of the peak lr at optimizer step ``step`` (1-based) of ``total_steps``.

    * warmup: ``step / warmup_steps`` for the first ``warmup_steps`` steps;
    * cosine: from 1 down to ``min_lr_ratio`` at the last step;
    * wsd (warmup-stable-decay): 1 until the last ``decay_fraction`` of the steps, then a
      linear decay to ``min_lr_ratio`` at the last step;
    * constant: 1.
    """
    if step < 1:
        raise ValueError(f"steps are 1-based, got {step}")
    if step <= cfg.warmup_steps:
        return step / cfg.warmup_steps
    if cfg.kind == "constant":
        return 1.0
    if cfg.kind == "cosine":
        span = max(total_steps - cfg.warmup_steps, 1)
        progress = min((step - cfg.warmup_steps) / span, 1.0)
        return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))
    if cfg.kind == "wsd":
        decay_steps = max(round(cfg.decay_fraction * total_steps), 1)
        decay_start = max(total_steps - decay_steps, cfg.warmup_steps)
        if step <= decay_start:
            return 1.0
        progress = min((step - decay_start) / max(total_steps - decay_start, 1), 1.0)
        return 1.0 - (1.0 - cfg.min_lr_ratio) * progress
    raise ValueError(f"unknown schedule kind {cfg.kind!r}")  # validated in config: a bug


def lr_factor_by_progress(step: int, progress: float, cfg: ScheduleSection) -> float:
    """The multiplier of the peak lr at step ``step`` (1-based) when ``progress`` (0..1, e.g.
    the share of a time budget spent) of the run is done: the warmup as in :func:`lr_factor`
    (by step), then cosine from 1 to ``min_lr_ratio`` over progress 0..1, or WSD's linear
    decay over its last ``decay_fraction``, or constant."""
    if step < 1:
        raise ValueError(f"steps are 1-based, got {step}")
    if step <= cfg.warmup_steps:
        return step / cfg.warmup_steps
    progress = min(max(progress, 0.0), 1.0)
    if cfg.kind == "constant":
        return 1.0
    if cfg.kind == "cosine":
        return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))
    if cfg.kind == "wsd":
        decay_start = 1.0 - cfg.decay_fraction
        if progress <= decay_start:
            return 1.0
        return 1.0 - (1.0 - cfg.min_lr_ratio) * (progress - decay_start) / cfg.decay_fraction
    raise ValueError(f"unknown schedule kind {cfg.kind!r}")  # validated in config: a bug
