"""Learning-rate schedules."""

from __future__ import annotations

import itertools
import math

import pytest

from megacpp.train.config import ScheduleSection
from megacpp.train.schedule import lr_factor


def test_linear_warmup_then_cosine_to_the_floor():
    cfg = ScheduleSection(kind="cosine", warmup_steps=10, min_lr_ratio=0.1)
    assert [lr_factor(s, 110, cfg) for s in (1, 5, 10)] == [0.1, 0.5, 1.0]
    assert lr_factor(60, 110, cfg) == pytest.approx(0.55)  # half way: (1 + 0.1) / 2
    assert lr_factor(110, 110, cfg) == pytest.approx(0.1)
    values = [lr_factor(s, 110, cfg) for s in range(10, 111)]
    assert all(a >= b for a, b in itertools.pairwise(values))  # monotone decay


def test_wsd_is_flat_then_decays_linearly_over_the_last_fraction():
    cfg = ScheduleSection(kind="wsd", warmup_steps=0, min_lr_ratio=0.0, decay_fraction=0.2)
    assert lr_factor(1, 100, cfg) == 1.0 and lr_factor(80, 100, cfg) == 1.0
    assert lr_factor(90, 100, cfg) == pytest.approx(0.5)
    assert lr_factor(100, 100, cfg) == pytest.approx(0.0)


def test_constant_after_warmup_and_steps_are_one_based():
    cfg = ScheduleSection(kind="constant", warmup_steps=4)
    assert lr_factor(2, 10, cfg) == 0.5 and lr_factor(9, 10, cfg) == 1.0
    with pytest.raises(ValueError):
        lr_factor(0, 10, cfg)
    assert math.isfinite(lr_factor(1, 1, ScheduleSection(kind="cosine")))
