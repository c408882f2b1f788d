"""E -- mixture-of-experts FFN (DeepSeek-V3 style routing).

* Token-choice top-k over sigmoid router scores; the chosen scores are normalized over the
  chosen experts (times ``routed_scaling``) to give the combine weights.
* Auxiliary-loss-free balancing: a per-expert ``expert_bias`` is added to the scores for
  *selection only* and nudged toward uniform load by :meth:`MoE.update_bias` after each step
  (bias += rate * sign(mean_load - load)). Under data parallelism the caller all-reduces
  ``routed_tokens`` before updating so every rank moves its bias identically.
* Optional sequence-level auxiliary loss (the complementary balance loss of DeepSeek-V3).
* Shared experts (always on) are one SwiGLU of width ``n_shared * expert_ffn``.
* Dropless: every token reaches its k experts.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from megacpp.kernels.runtime import resolve
from megacpp.model.cache import PagedView
from megacpp.model.mixer import Mixer
from megacpp.model.mlp import SwiGLU

if TYPE_CHECKING:
    from megacpp.model.config import ModelConfig

LOAD_CHUNKS = 64  # row chunks of the per-expert load's first reduction (MoE._load)


class MoE(Mixer):
    def __init__(
        self,
        d_model: int,
        n_experts: int,
        top_k: int,
        expert_ffn: int,
        n_shared_experts: int = 1,
        bias_update_rate: float = 1e-3,
        seq_aux_loss_coef: float = 0.0,
        routed_scaling: float = 1.0,
        init_std: float = 0.02,
    ) -> None:
        super().__init__()
        self.n_experts, self.top_k, self.expert_ffn = n_experts, top_k, expert_ffn
        self.bias_update_rate = bias_update_rate
        self.seq_aux_loss_coef = seq_aux_loss_coef
        self.routed_scaling = routed_scaling
        self.router = nn.Linear(d_model, n_experts, bias=False)
        self.w_in = nn.Parameter(torch.empty(n_experts, 2 * expert_ffn, d_model))
        self.out_proj = nn.Parameter(torch.empty(n_experts, d_model, expert_ffn))
        self.shared = SwiGLU(d_model, n_shared_experts * expert_ffn) if n_shared_experts else None
        # selection-only bias (not trained by gradients) and the load it is steered by
        self.register_buffer("expert_bias", torch.zeros(n_experts))
        self.register_buffer("routed_tokens", torch.zeros(n_experts), persistent=False)
        self.register_buffer("last_load", torch.zeros(n_experts), persistent=False)
        self.aux_loss: torch.Tensor | None = None
        nn.init.normal_(self.w_in, std=init_std)
        nn.init.normal_(self.out_proj, std=init_std)

    @classmethod
    def from_config(cls, cfg: ModelConfig) -> MoE:
        e = cfg.moe
        return cls(cfg.d_model, e.n_experts, e.top_k, e.expert_ffn, e.n_shared_experts,
                   e.bias_update_rate, e.seq_aux_loss_coef, e.routed_scaling, cfg.init_std)

    # the pre-norm block may hand x in twice (Block, RMSNorm.with_skip's fanout): ``again`` for
    # the routed experts, x for the router / shared projection; the norm's backward kernel then
    # sums the two gradients (autograd's add of them took 26 us per layer at the nam56r-350m
    # step's shape on an H100)
    INPUT_FANOUT = 2

    def forward(
        self, x: torch.Tensor, doc_ids: torch.Tensor | None = None,
        again: tuple[torch.Tensor, ...] = (),
    ) -> torch.Tensor:
        """x [B, L, D] -> [B, L, D]. ``again``: (the same values as x, as a tensor of its own)
        for the routed experts to read; default x."""
        B, L, D = x.shape
        tokens = x.reshape(-1, D)  # [T, D]
        logits, shared_gate_up = self.project(tokens)
        scores, expert_idx, weights = self.choose(logits)

        routed = again[0].reshape(-1, D) if again else tokens
        # the shared experts' output goes into the routed combine's kernel (an Inductor addmm
        # added it after the experts' graph break, copying the routed output first)
        shared = None if self.shared is None else self.shared.down(shared_gate_up)
        experts = resolve("moe_experts", tokens).fn  # reference unless MEGACPP_KERNELS says so
        out = experts(routed, expert_idx, weights, self.w_in, self.out_proj, shared)

        with torch.no_grad():
            load = self._load(expert_idx)
            self.last_load.copy_(load)
            if self.training:
                self.routed_tokens += load
        self.aux_loss = (
            self._sequence_aux_loss(scores.view(B, L, -1), expert_idx.view(B, L, -1))
            if self.training and self.seq_aux_loss_coef > 0
            else None
        )
        return out.view(B, L, D)

    def forward_paged(
        self, x: torch.Tensor, cache: PagedView, again: tuple[torch.Tensor, ...] = ()
    ) -> torch.Tensor:
        """One-token steps (decode) through :func:`moe_all_experts` (fixed shapes, no host
        sync); longer inputs (prefill) through :meth:`forward`, or also densely while a CUDA
        graph is being captured with the reference experts (which read counts on the host)."""
        if x.shape[1] == 1 or (x.is_cuda and torch.cuda.is_current_stream_capturing()
                               and resolve("moe_experts", x).name == "reference"):
            return moe_all_experts(self, x)
        return self.forward(x, again=again)

    def _load(self, expert_idx: torch.Tensor) -> torch.Tensor:
        """Tokens routed to each expert [E] (float32) from the chosen experts [T, k]: the
        one-hot comparison summed per chunk of rows, then over the chunks (bincount would sync
        the host on CUDA; an index_add of ones was a 14 us kernel of 16-address atomics per
        layer under torch.compile on an H100, nam56r-350m). In
        one column sum (E outputs over T * k rows) Inductor's single reduction kernel took
        606 us per layer on one H100 host (13.9 ms of its 92.7 ms step, profiled); another
        host ran the whole step in 78.9 ms. 64 chunks give the first reduction 64 * E outputs
        of T * k / 64 rows each (78.7 ms there)."""
        ids = expert_idx.reshape(-1)
        chunks = LOAD_CHUNKS if ids.numel() % LOAD_CHUNKS == 0 else 1
        experts = torch.arange(self.n_experts, device=ids.device)
        hits = ids.view(chunks, -1, 1) == experts  # [chunks, rows per chunk, E]
        return hits.sum(1, dtype=torch.float32).sum(0)

    def project(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """tokens [T, D] -> (router logits [T, E], the shared experts' gate|up [T, 2F] or None).

        One GEMM over the router's and the shared in_proj's weights stacked: the input's
        gradient is then one product with K = E + 2F instead of a K = E product (a [T, D]
        output written for 16 columns of work) added to the shared experts' by a kernel of its
        own (nam56r-350m on an H100: the router's three GEMMs and that add took 1.4 ms of an
        86 ms step). The parameters stay apart."""
        if self.shared is None:
            return self.router(tokens), None
        weight = torch.cat([self.router.weight, self.shared.in_proj.weight])
        logits, gate_up = F.linear(tokens, weight).split(
            [self.n_experts, weight.shape[0] - self.n_experts], dim=-1)
        return logits, gate_up

    def route(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """tokens [T, D] -> :meth:`choose` of the router's logits (computed by :meth:`project`,
        as in the forward)."""
        return self.choose(self.project(tokens)[0])

    def choose(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Router logits [T, E] -> (sigmoid router scores [T, E] in at least float32, the chosen
        experts [T, k], their combine weights [T, k]).

        The chosen experts are the k largest of ``scores + expert_bias``, in descending order,
        ties going to the lower expert index: a stable descending sort of each row (E values),
        so the choice never depends on how many tokens are routed together (``topk``'s tie
        order is unspecified). Under torch.compile Inductor fuses that sort with the sigmoid
        into one kernel (3.6 us at 16384 x 16 on an H100, where topk took 45 us)."""
        scores = torch.sigmoid(logits.to(torch.promote_types(logits.dtype, torch.float32)))
        ranked = torch.sort(scores + self.expert_bias, dim=-1, descending=True, stable=True)
        expert_idx = ranked.indices[..., : self.top_k]  # [T, k]
        chosen = scores.gather(-1, expert_idx)
        weights = chosen / chosen.sum(-1, keepdim=True) * self.routed_scaling  # [T, k]
        return scores, expert_idx, weights

    def _sequence_aux_loss(self, scores: torch.Tensor, expert_idx: torch.Tensor) -> torch.Tensor:
        """alpha * sum_i f_i * P_i per sequence, averaged over the batch (DeepSeek-V3 eq. 17-20).

        scores: [B, L, E] sigmoid scores; expert_idx: [B, L, k].
        """
        _, L, E = scores.shape
        picked = torch.zeros_like(scores).scatter_(-1, expert_idx, 1.0)  # [B, L, E]
        f = picked.sum(1) * E / (self.top_k * L)  # [B, E]
        p = (scores / scores.sum(-1, keepdim=True)).mean(1)  # [B, E]
        return self.seq_aux_loss_coef * (f * p).sum(-1).mean()

    @torch.no_grad()
    def update_bias(self) -> None:
        """Nudge the selection bias toward uniform load, then reset the load counter. (No
        tokens routed: every load is 0, so the sign is 0 and the bias stays; no host check,
        so a CUDA graph can capture this.)"""
        load = self.routed_tokens
        self.expert_bias += self.bias_update_rate * torch.sign(load.mean() - load)
        load.zero_()

    def flops_per_token(self, seq_len: int = 0) -> int:
        """Router + k active experts + shared experts (forward matmul FLOPs per token)."""
        d_model = self.router.in_features
        expert = 2 * d_model * 2 * self.expert_ffn + 2 * self.expert_ffn * d_model
        shared = self.shared.flops_per_token() if self.shared is not None else 0
        return 2 * d_model * self.n_experts + self.top_k * expert + shared

    def residual_projections(self) -> list[torch.Tensor]:
        """The routed experts' output weights, then the shared experts'."""
        shared = self.shared.residual_projections() if self.shared is not None else []
        return [self.out_proj, *shared]

    def direct_weight_linears(self) -> tuple[str, ...]:
        """The router and the shared in_proj: :meth:`project` multiplies their weights
        stacked, in one GEMM."""
        return () if self.shared is None else ("router", "shared.in_proj")

    def inactive_params(self) -> int:
        """Parameters of the routed experts a token does not visit."""
        per_expert = self.w_in[0].numel() + self.out_proj[0].numel()
        return (self.n_experts - self.top_k) * per_expert

    def load_balance(self) -> float:
        """max/mean of the last forward's per-expert token counts (1.0 is perfectly even)."""
        mean = self.last_load.mean().item()
        return self.last_load.max().item() / mean if mean > 0 else math.nan


def moe_all_experts(moe: MoE, x: torch.Tensor) -> torch.Tensor:
    """The routed + shared experts of ``moe`` on x [B, L, D] -> [B, L, D], computed densely:
    every expert runs on every token and is weighted by the router's combine weight (0 for
    the experts a token did not choose). The same function as ``MoE.forward`` (same routing,
    same weights) without its host sync and with fixed shapes -- for decode steps, where the
    few tokens make the dense compute cheap and reading every expert's weights is what the
    sparse path costs anyway at batch sizes >= n_experts / top_k. Load statistics are not
    updated (serving does not balance)."""
    B, L, D = x.shape
    tokens = x.reshape(-1, D)  # [T, D]
    logits, shared_gate_up = moe.project(tokens)
    scores, expert_idx, weights = moe.choose(logits)
    dense = torch.zeros_like(scores).scatter_(-1, expert_idx, weights)  # [T, E]
    gate, up = torch.einsum("td,efd->etf", tokens, moe.w_in).chunk(2, dim=-1)  # [E, T, F]
    y = torch.bmm(F.silu(gate) * up, moe.out_proj.transpose(1, 2))  # [E, T, D]
    out = (y * dense.t()[..., None].to(y.dtype)).sum(0)  # [T, D]
    if moe.shared is not None:
        out = out + moe.shared.down(shared_gate_up)
    return out.view(B, L, D)
