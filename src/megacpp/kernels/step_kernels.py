"""What the fused decode-step kernels (``mamba3_step``, ``gated_delta_step``) share: their
launch settings (one program per (head, row), warps by the size of its state tile) and, for
the Triton modules, the dtype map and softplus (:mod:`megacpp.kernels.step_triton`)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class StepConfig:
    """Warps of one (head, row) program: ``num_warps`` for a state tile of at least
    ``large_tile`` elements (its two dims padded to powers of two), ``num_warps_small`` below
    it; ``num_warps_f64`` for float64 math at any size."""

    num_warps: int = 4
    num_warps_small: int = 2
    large_tile: int = 4096
    num_warps_f64: int = 8

    def warps(self, tile: int, f64: bool) -> int:
        if f64:
            return self.num_warps_f64
        return self.num_warps if tile >= self.large_tile else self.num_warps_small
