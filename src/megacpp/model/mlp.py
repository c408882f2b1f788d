"""D -- the dense SwiGLU MLP (also the MoE's expert and shared-expert shape)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from megacpp.model.cache import PagedView
from megacpp.model.mixer import Mixer

if TYPE_CHECKING:
    from megacpp.model.config import ModelConfig


class SwiGLU(Mixer):
    """out_proj(silu(gate) * up) with gate/up from one fused in_proj [D -> 2F]: position-wise,
    so the paged forward is the plain one."""

    def __init__(self, d_model: int, ffn: int) -> None:
        super().__init__()
        self.in_proj = nn.Linear(d_model, 2 * ffn, bias=False)
        self.out_proj = nn.Linear(ffn, d_model, bias=False)

    @classmethod
    def from_config(cls, cfg: ModelConfig) -> SwiGLU:
        return cls(cfg.d_model, cfg.mlp.ffn)

    def forward(
        self, x: torch.Tensor, doc_ids: torch.Tensor | None = None,
        again: tuple[torch.Tensor, ...] = (),
    ) -> torch.Tensor:
        return self.down(self.in_proj(x))

    def forward_paged(
        self, x: torch.Tensor, cache: PagedView, again: tuple[torch.Tensor, ...] = ()
    ) -> torch.Tensor:
        return self.forward(x)

    def down(self, gate_up: torch.Tensor) -> torch.Tensor:
        """out_proj(silu(gate) * up) from in_proj's output [..., 2F] (gate first)."""
        gate, up = gate_up.chunk(2, dim=-1)
        return self.out_proj(F.silu(gate) * up)

    def residual_projections(self) -> list[torch.Tensor]:
        return [self.out_proj.weight]

    def flops_per_token(self, seq_len: int = 0) -> int:
        return 2 * self.in_proj.in_features * self.in_proj.out_features + 2 * (
            self.out_proj.in_features * self.out_proj.out_features
        )
