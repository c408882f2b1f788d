"""One pattern letter = one pre-norm residual sublayer: x + mixer(norm(x)).

:data:`MIXERS` is the single place that maps a pattern layer (family, variant) to its
:class:`~megacpp.model.mixer.Mixer`; each mixer builds itself from the config
(``from_config``). Anything not registered fails closed (``require_buildable`` names the
layer first).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from megacpp.model.attention import GroupedQueryAttention
from megacpp.model.cache import PagedView
from megacpp.model.config import ModelConfig
from megacpp.model.dsa import DeepSeekSparseAttention
from megacpp.model.gated_delta import GatedDeltaNetMixer
from megacpp.model.mamba3 import Mamba3Mixer
from megacpp.model.mamba3_mimo import Mamba3MimoMixer
from megacpp.model.mixer import Mixer
from megacpp.model.mla import MultiHeadLatentAttention
from megacpp.model.mlp import SwiGLU
from megacpp.model.moe import MoE
from megacpp.model.norm import RMSNorm

# (pattern family, variant or None) -> the mixer's builder. A new mixer: its file, one line.
MIXERS: dict[tuple[str, str | None], Callable[[ModelConfig], Mixer]] = {
    ("A", "gqa"): GroupedQueryAttention.from_config,
    ("A", "mla"): MultiHeadLatentAttention.from_config,
    ("A", "dsa"): DeepSeekSparseAttention.from_config,
    ("M", "siso"): Mamba3Mixer.from_config,
    ("M", "mimo"): Mamba3MimoMixer.from_config,
    ("R", None): GatedDeltaNetMixer.from_config,
    ("E", None): MoE.from_config,
    ("D", None): SwiGLU.from_config,
}


def build_mixer(family: str, variant: str | None, cfg: ModelConfig) -> Mixer:
    builder = MIXERS.get((family, variant))
    if builder is None:
        # require_buildable() runs first, so reaching this line is a bug in the registries
        known = ", ".join(f if v is None else f"{f}:{v}" for f, v in MIXERS)
        raise AssertionError(f"no mixer registered for {family}:{variant}; registered: {known}")
    return builder(cfg)


class Block(nn.Module):
    """Pre-norm residual sublayer ``x + mixer(norm(x))``."""

    def __init__(self, family: str, variant: str | None, cfg: ModelConfig) -> None:
        super().__init__()
        self.family, self.variant = family, variant
        self.norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.mixer = build_mixer(family, variant, cfg)

    def forward(
        self, x: torch.Tensor, doc_ids: torch.Tensor | None = None,
        pending: torch.Tensor | None = None, defer: bool = False,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """``x + mixer(norm(x))`` over whole rows (training, the full forward). ``pending`` /
        ``defer`` chain the blocks through :meth:`fused_pre_norm` (HybridLM does): ``pending``
        is the previous block's mixer output, not yet added to x; ``defer`` returns
        (x, mixer output) and leaves this block's add to the next block."""
        x, h, again = self.fused_pre_norm(x, pending)
        out = self.mixer(h, doc_ids=doc_ids, again=again)
        return (x, out) if defer else x + out

    def forward_paged(self, x: torch.Tensor, cache: PagedView) -> torch.Tensor:
        """``x + mixer(norm(x))`` through the serving engine's paged caches
        (:meth:`Mixer.forward_paged`)."""
        x, h, again = self.fused_pre_norm(x)
        return x + self.mixer.forward_paged(h, cache, again=again)

    def fused_pre_norm(
        self, x: torch.Tensor, pending: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, ...]]:
        """(s, norm(s), ``again``) with s = x + pending (or x): the block's pre-norm as one
        norm op (:meth:`RMSNorm.with_skip`). The same values as ``s = x + pending;
        h = norm(s)``; with the fused norm kernel it saves, per block:

        * the residual add's kernel: ``pending`` is added inside the norm's kernel;
        * the add of the skip branch's gradient: s leaves through the norm, whose backward
          sums its gradient into ds (instead of autograd adding two float32 gradients);
        * the add of the mixer's input gradients: a mixer whose input is read in
          ``INPUT_FANOUT`` = n places gets n - 1 more copies of norm(s) (``again``, each a
          tensor of its own) and the norm's backward kernel sums the n gradients (on an
          H100, nam56r-350m: 0.32 ms per step for attention, 0.47 ms for Mamba-3, 26 us per
          MoE layer)."""
        *normed, s = self.norm.with_skip(x, pending, fanout=self.mixer.INPUT_FANOUT)
        return s, normed[0], tuple(normed[1:])

    @property
    def letter(self) -> str:
        default = {"A": "gqa", "M": "siso"}.get(self.family)
        return self.family if self.variant in (None, default) else f"{self.family}:{self.variant}"
