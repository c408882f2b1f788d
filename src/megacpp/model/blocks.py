"""One pattern letter = one pre-norm residual sublayer: x + mixer(norm(x)).

``build_mixer`` is the single place that maps a (family, variant) to a module built from
the config. Anything it cannot build fails closed (the pattern package names the layer).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from megacpp.model.attention import GroupedQueryAttention
from megacpp.model.config import ModelConfig
from megacpp.model.dsa import DeepSeekSparseAttention
from megacpp.model.gated_delta import GatedDeltaNetMixer
from megacpp.model.mamba3 import Mamba3Mixer
from megacpp.model.mla import MultiHeadLatentAttention
from megacpp.model.mlp import SwiGLU
from megacpp.model.moe import MoE
from megacpp.model.norm import RMSNorm


def build_mixer(family: str, variant: str, cfg: ModelConfig) -> nn.Module:
    a, m, r, e = cfg.attention, cfg.mamba, cfg.rnn, cfg.moe
    key = (family, variant)
    if key == ("A", "gqa"):
        return GroupedQueryAttention(
            cfg.d_model, a.n_heads, a.n_kv_heads, a.head_dim, a.rope_base, a.qk_norm, cfg.norm_eps
        )
    if key == ("A", "mla"):
        return _latent_attention(cfg)
    if key == ("A", "dsa"):
        d = cfg.dsa
        return DeepSeekSparseAttention(
            _latent_attention(cfg),
            index_n_heads=d.index_n_heads,
            index_head_dim=d.index_head_dim,
            top_k=d.top_k,
            mode=d.mode,
            indexer_loss_coef=d.indexer_loss_coef,
            query_chunk=d.query_chunk,
            norm_eps=cfg.norm_eps,
        )
    if key == ("M", "siso"):
        return Mamba3Mixer(
            d_model=cfg.d_model,
            d_state=m.d_state,
            headdim=m.headdim,
            expand=m.expand,
            ngroups=m.ngroups,
            chunk_size=m.chunk_size,
            rope_fraction=m.rope_fraction,
            outproj_norm=m.outproj_norm,
            norm_eps=cfg.norm_eps,
            init_std=cfg.init_std,
        )
    if family == "R":
        return GatedDeltaNetMixer(
            d_model=cfg.d_model,
            n_heads=r.n_heads,
            head_k_dim=r.head_k_dim,
            head_v_dim=r.head_v_dim,
            conv_size=r.conv_size,
            chunk_size=r.chunk_size,
            norm_eps=cfg.norm_eps,
            init_std=cfg.init_std,
        )
    if family == "E":
        return MoE(
            cfg.d_model,
            e.n_experts,
            e.top_k,
            e.expert_ffn,
            e.n_shared_experts,
            e.bias_update_rate,
            e.seq_aux_loss_coef,
            e.routed_scaling,
            cfg.init_std,
        )
    if family == "D":
        return SwiGLU(cfg.d_model, cfg.mlp.ffn)
    # require_buildable() runs first, so reaching this line is a bug in the family registry.
    raise AssertionError(f"no builder for {family}:{variant}")


def _latent_attention(cfg: ModelConfig) -> MultiHeadLatentAttention:
    m = cfg.mla
    return MultiHeadLatentAttention(
        d_model=cfg.d_model,
        n_heads=m.n_heads,
        q_lora_rank=m.q_lora_rank,
        kv_lora_rank=m.kv_lora_rank,
        qk_nope_head_dim=m.qk_nope_head_dim,
        qk_rope_head_dim=m.qk_rope_head_dim,
        v_head_dim=m.v_head_dim,
        rope_base=m.rope_base,
        norm_eps=cfg.norm_eps,
    )


class Block(nn.Module):
    """Pre-norm residual sublayer. ``cache`` is the mixer's own cache object (or None)."""

    def __init__(self, family: str, variant: str, cfg: ModelConfig) -> None:
        super().__init__()
        self.family, self.variant = family, variant
        self.norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.mixer = build_mixer(family, variant, cfg)

    def forward(
        self, x: torch.Tensor, doc_ids: torch.Tensor | None = None, cache: Any = None,
        pending: torch.Tensor | None = None, defer: bool = False,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """s + mixer(norm(s)) with s = x, or x + pending: the previous block's mixer output not
        yet added (its add then runs in this block's norm kernel). ``defer``: return
        (s, mixer output) and leave that add to the next block's norm; HybridLM chains its
        blocks this way."""
        # skip: s (its gradient summed in the norm); a mixer with INPUT_FANOUT n > 1 (attention,
        # the MoE, Mamba-3) gets the normed input n times, as tensors of their own (``again``:
        # the copies after the first) whose gradients the norm's backward sums
        fanout = getattr(self.mixer, "INPUT_FANOUT", 1)
        *hs, skip = self.norm.with_skip(x, pending, fanout=fanout)
        if cache is not None and x.shape[1] == 1 and hasattr(self.mixer, "step"):
            out = self.mixer.step(hs[0], cache)  # recurrent decode (M, R)
        elif fanout > 1:
            out = self.mixer(hs[0], doc_ids=doc_ids, cache=cache, again=tuple(hs[1:]))
        else:
            out = self.mixer(hs[0], doc_ids=doc_ids, cache=cache)
        return (skip, out) if defer else skip + out

    @property
    def letter(self) -> str:
        default = {"A": "gqa", "M": "siso"}.get(self.family)
        return self.family if self.variant in (None, default) else f"{self.family}:{self.variant}"
