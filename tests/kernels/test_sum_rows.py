"""``ops.sum_rows``: the column sums of per-program float32 partials, against torch's float64
sum, and the same bits on every call. CPU: the Triton interpreter (skipped without triton, as
in CI); GPU: compiled, at the shapes the training step sums."""

from __future__ import annotations

import pytest
import torch

from tests.kernels.interpreter import run_interpreter_check

gpu = pytest.mark.gpu


def _check(device: str, shapes) -> dict[str, float]:
    from megacpp.kernels.ops.sum_rows import sum_rows

    g = torch.Generator().manual_seed(0)
    errors = {}
    for rows, cols, stride in shapes:
        wide = torch.randn(rows, stride, generator=g).to(device)
        partials = wide[:, :cols]  # a row stride wider than the columns
        got = sum_rows(partials)
        assert got.shape == (cols,) and got.dtype == torch.float32
        assert torch.equal(got, sum_rows(partials)), "not deterministic"
        want = partials.double().sum(0)
        key = f"{rows}x{cols}/{stride}"
        errors[key] = float((got.double() - want).norm() / want.norm().clamp_min(1e-30))
        assert errors[key] < 1e-6, (key, errors[key])  # NaN fails
    assert torch.equal(sum_rows(torch.zeros(0, 5, device=device)), torch.zeros(5, device=device))
    with pytest.raises(ValueError, match="float32"):
        sum_rows(torch.zeros(4, 4, device=device, dtype=torch.float64))
    with pytest.raises(ValueError, match="unit column stride"):
        sum_rows(torch.zeros(4, 4, device=device).t())
    return errors


def _interpreter_check() -> dict[str, float]:
    """Ragged row and column tiles, one row, more columns than one program holds."""
    return _check("cpu", ((37, 100, 100), (1, 64, 64), (70, 130, 160), (33, 5, 8)))


def test_sum_rows_interpreter_matches_torch() -> None:
    run_interpreter_check(__file__, "_interpreter_check")


@gpu
def test_sum_rows_gpu_at_the_training_steps_shapes() -> None:
    # RMSNorm's dw partials (d_model 768, head / state rows of 64), Mamba-3's bias parts
    print(_check("cuda", ((1024, 768, 768), (528, 64, 64), (521, 64, 64), (256, 1536, 1536),
                          (1000, 777, 800))))
