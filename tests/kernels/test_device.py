"""The launchers' host arithmetic (megacpp.kernels.device) against Triton's own helpers."""

from __future__ import annotations

import pytest

from megacpp.kernels.device import cdiv, next_power_of_2


def test_cdiv_and_next_power_of_2_values():
    assert [cdiv(a, 4) for a in (0, 1, 4, 5, 8, 9)] == [0, 1, 1, 2, 2, 3]
    assert cdiv(131072, 1024) == 128 and cdiv(131073, 1024) == 129
    assert [next_power_of_2(n) for n in (0, 1, 2, 3, 5, 64, 65, 1000)] == [
        0, 1, 2, 4, 8, 64, 128, 1024]
    assert next_power_of_2(2**40 + 1) == 2**41


def test_match_triton():
    triton = pytest.importorskip("triton")
    for n in range(5000):
        assert next_power_of_2(n) == triton.next_power_of_2(n), n
        for b in (1, 3, 16, 64, 1024):
            assert cdiv(n, b) == triton.cdiv(n, b), (n, b)
