"""Multi-token prediction (DeepSeek-V3): D sequential modules predicting further ahead.

Module k (k = 1..D) at position i combines the previous depth's hidden state with the
embedding of the token k steps ahead, runs one small sublayer stack, and predicts token
i + k + 1 through the main model's (shared) output head::

    h^0      = the main stack's output (before its final norm)
    h^k_i    = blocks_k( in_proj_k([rms_norm(h^{k-1}_i) ; rms_norm(Emb(t_{i+k}))]) )
    logits^k = head(rms_norm_k(h^k_i))                    # predicts t_{i+k+1}

``blocks_k`` is any buildable one-stage pattern (``mtp.pattern``, e.g. ``"A:mla E"``: an
attention + MoE pair, DeepSeek-V3's "one transformer block"). The embedding and head are
the main model's; every module has its own norms, ``in_proj`` and blocks.

Documents: ``Emb(t_{i+k})`` is zero where token i + k lies past the row or in another
document, and the depth-k target ``t_{i+k+1}`` is kept only where the next-token targets
``labels[i], ..., labels[i+k]`` are all real -- an unbroken chain inside one document (the
data loader marks every document boundary with ``IGNORE_INDEX``). The MTP loss is the mean
cross-entropy over depths; the model adds ``loss_weight`` times it to its loss.

:meth:`MultiTokenPrediction.forward` returns each depth's normed hidden states
``rms_norm_k(h^k)``; the head and the loss are the model's. Each depth's loss goes through
the same head loss as the main next-token loss (``HybridLM.lm_loss``): with a fused linear
cross-entropy backend it comes straight from the normed hidden states and the head weight,
and no logits are built; on the reference path it is the cross-entropy of the logits, which
are returned too (and always without labels), so serving can later use them as a
speculative draft.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from megacpp.model.blocks import Block
from megacpp.model.config import ModelConfig
from megacpp.model.norm import RMSNorm
from megacpp.pattern import LayerPlan, load

# (normed hidden states [B, L, D], targets [B, L]) -> (mean cross-entropy, logits [B, L, V]
# or None when a fused linear cross-entropy skipped them)
HeadLoss = Callable[[Tensor, Tensor], tuple[Tensor, Tensor | None]]


class MTPModule(nn.Module):
    """One prediction depth: ``(h^{k-1} [B, L, D], Emb(t_{i+k}) [B, L, D]) -> h^k [B, L, D]``."""

    def __init__(self, cfg: ModelConfig, plan: LayerPlan) -> None:
        super().__init__()
        D = cfg.d_model
        self.hidden_norm = RMSNorm(D, cfg.norm_eps)
        self.embed_norm = RMSNorm(D, cfg.norm_eps)
        self.in_proj = nn.Linear(2 * D, D, bias=False)
        self.blocks = nn.ModuleList(Block(s.family, s.variant, cfg) for s in plan.layers)
        self.norm = RMSNorm(D, cfg.norm_eps)  # before the shared head

    def forward(self, h_prev: Tensor, future_emb: Tensor, doc_ids: Tensor | None) -> Tensor:
        x = self.in_proj(torch.cat([self.hidden_norm(h_prev), self.embed_norm(future_emb)], -1))
        for block in self.blocks:
            x = block(x, doc_ids=doc_ids)
        return x

    def flops_per_token(self, seq_len: int) -> int:
        """in_proj + the blocks' forward FLOPs (the shared head is counted by the caller)."""
        proj = 2 * self.in_proj.in_features * self.in_proj.out_features
        return proj + sum(b.mixer.flops_per_token(seq_len) for b in self.blocks)

    def inactive_params(self) -> int:
        """Routed-expert parameters a token does not visit (E blocks)."""
        return sum(b.mixer.inactive_params() for b in self.blocks)


class MultiTokenPrediction(nn.Module):
    """``cfg.mtp.depth`` sequential :class:`MTPModule` s and their loss."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.plan = load(cfg.mtp.pattern)
        self.loss_weight = cfg.mtp.loss_weight
        self.depths = nn.ModuleList(MTPModule(cfg, self.plan) for _ in range(cfg.mtp.depth))

    def blocks(self) -> list[Block]:
        return [block for module in self.depths for block in module.blocks]

    def forward(
        self, h: Tensor, input_ids: Tensor, doc_ids: Tensor | None, embed: nn.Embedding
    ) -> list[Tensor]:
        """Main-stack output h [B, L, D] -> each depth's normed hidden states [B, L, D], the
        shared head's input (depth k at position i predicts token i + k + 1)."""
        normed = []
        for depth, module in enumerate(self.depths, start=1):
            future, present = future_tokens(input_ids, doc_ids, depth)
            future_emb = embed(future).masked_fill(~present[..., None], 0.0)
            h = module(h, future_emb, doc_ids)
            normed.append(module.norm(h))
        return normed

    def loss(
        self, normed: list[Tensor], labels: Tensor, ignore_index: int, head_loss: HeadLoss
    ) -> tuple[Tensor, list[Tensor] | None]:
        """(mean over depths of ``head_loss`` against :func:`mtp_labels`, the logits of every
        depth or None when ``head_loss`` built none) from :meth:`forward`'s hidden states."""
        losses, logits = [], []
        for depth, depth_normed in enumerate(normed, start=1):
            loss, depth_logits = head_loss(depth_normed, mtp_labels(labels, depth, ignore_index))
            losses.append(loss)
            logits.append(depth_logits)
        kept = None if any(lg is None for lg in logits) else logits
        return torch.stack(losses).mean(), kept


def future_tokens(input_ids: Tensor, doc_ids: Tensor | None, depth: int) -> tuple[Tensor, Tensor]:
    """Token ``depth`` steps ahead of each position: ids [B, L] (0 where absent) and
    ``present`` [B, L] bool (False past the row end or across a document boundary)."""
    L = input_ids.shape[1]
    n = max(L - depth, 0)
    future = torch.zeros_like(input_ids)
    present = torch.zeros_like(input_ids, dtype=torch.bool)
    future[:, :n] = input_ids[:, L - n :]
    if doc_ids is None:
        present[:, :n] = True
    else:
        present[:, :n] = doc_ids[:, L - n :] == doc_ids[:, :n]
    return future, present


def mtp_labels(labels: Tensor, depth: int, ignore_index: int) -> Tensor:
    """Depth-``depth`` targets from next-token ``labels`` [B, L]: ``labels[i + depth]``
    where ``labels[i], ..., labels[i + depth]`` are all real targets, else ``ignore_index``."""
    L = labels.shape[1]
    n = max(L - depth, 0)
    real = labels != ignore_index
    unbroken = real[:, :n].clone()
    for step in range(1, depth + 1):
        unbroken &= real[:, step : step + n]
    out = torch.full_like(labels, ignore_index)
    out[:, :n] = torch.where(unbroken, labels[:, depth : depth + n], ignore_index)
    return out


def mean_cross_entropy(logits: Tensor, labels: Tensor, ignore_index: int) -> Tensor:
    """Mean cross-entropy (float32) over real targets; 0 (not NaN) when there are none -- as
    the fused linear cross-entropy kernel does -- without a host sync, so short rows never
    break a compiled step."""
    total = F.cross_entropy(
        logits.float().flatten(0, 1), labels.flatten(), ignore_index=ignore_index, reduction="sum"
    )
    return total / (labels != ignore_index).sum().clamp(min=1)
