"""D -- the dense SwiGLU MLP (also the MoE's expert and shared-expert shape)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class SwiGLU(nn.Module):
    """out_proj(silu(gate) * up) with gate/up from one fused in_proj [D -> 2F]."""

    def __init__(self, d_model: int, ffn: int) -> None:
        super().__init__()
        self.in_proj = nn.Linear(d_model, 2 * ffn, bias=False)
        self.out_proj = nn.Linear(ffn, d_model, bias=False)

    def forward(
        self, x: torch.Tensor, doc_ids: torch.Tensor | None = None, cache: None = None
    ) -> torch.Tensor:
        return self.down(self.in_proj(x))

    def down(self, gate_up: torch.Tensor) -> torch.Tensor:
        """out_proj(silu(gate) * up) from in_proj's output [..., 2F] (gate first)."""
        gate, up = gate_up.chunk(2, dim=-1)
        return self.out_proj(F.silu(gate) * up)

    def flops_per_token(self, seq_len: int = 0) -> int:
        return 2 * self.in_proj.in_features * self.in_proj.out_features + 2 * (
            self.out_proj.in_features * self.out_proj.out_features
        )
