"""Canonical and compressed text of a plan."""

from __future__ import annotations

import pytest

from megacpp.pattern import format_plan, load, parse


@pytest.mark.parametrize(
    "text,canonical",
    [
        (" A:gqa E | M:siso M:mimo ", "AE|MM:mimo"),
        ("(A:mla E)x2 | D", "A:mlaEA:mlaE|D"),
        ("((AE)x2 R)X2", "AEAERAEAER"),
        ("(AEME|)x2 A:dsa", "AEME|AEME|A:dsa"),
    ],
)
def test_canonical_form(text, canonical):
    plan = parse(text)
    assert format_plan(plan) == canonical
    assert plan.format() == str(plan) == canonical
    assert parse(canonical) == plan


@pytest.mark.parametrize(
    "text,compressed",
    [
        ("NAM56R", "(AEMEAEMEAEMR)x4AEMEAEMR"),
        ("AAAA", "AAAA"),  # "(A)x4" would be longer
        ("AAAAAA", "(A)x6"),
        ("AEAE", "AEAE"),
        ("AEAEAE", "AEAEAE"),  # same length: no gain, keep plain
        ("(AE)x4", "(AE)x4"),
        ("((A:mla E)x2 M)x3", "((A:mlaE)x2M)x3"),
        ("(AAAAAA|)x2 D", "(A)x6|(A)x6|D"),
        ("EAAAAAAE", "E(A)x6E"),
    ],
)
def test_compressed_form(text, compressed):
    plan = load(text)
    assert plan.format(compress=True) == compressed
    assert parse(compressed) == plan


def test_compressed_is_never_longer_than_canonical():
    for text in ["NAM56R", "AEMR", "(A:dsa)x40", "(AEM|)x5 D"]:
        plan = load(text)
        assert len(plan.format(compress=True)) <= len(plan.format())
