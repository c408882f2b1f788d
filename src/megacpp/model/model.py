"""HybridLM: embedding -> pattern of pre-norm residual sublayers -> final RMSNorm -> LM head,
plus optional multi-token prediction modules on top (``[mtp] depth``, see ``mtp.py``).

Plain single-device PyTorch. Parallelism, activation checkpointing and compilation are
applied from outside (``megacpp.train.parallelize``), never inside this file.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from megacpp.errors import MegaCppError
from megacpp.kernels.runtime import resolve
from megacpp.model.blocks import Block
from megacpp.model.cache import LockstepCache, PagedBatch, PagedView
from megacpp.model.config import ModelConfig
from megacpp.model.dsa import share_indices
from megacpp.model.features import ngram_embedding, structure_embedding
from megacpp.model.mtp import MultiTokenPrediction, mean_cross_entropy
from megacpp.model.norm import RMSNorm
from megacpp.pattern import LayerPlan, load, require_buildable

IGNORE_INDEX = -100


@dataclass
class ModelOutput:
    logits: torch.Tensor | None  # [B, L, V]; None when a fused LM loss skipped the logits
    loss: torch.Tensor | None = None  # LM loss + auxiliary losses + mtp weight * MTP loss
    lm_loss: torch.Tensor | None = None
    aux_loss: torch.Tensor | None = None  # MoE balance + DSA indexer KL (training mode)
    mtp_loss: torch.Tensor | None = None  # mean cross-entropy over MTP depths (unweighted)
    # per MTP depth k: [B, L, V], predicts t+k+1; None without MTP or when a fused loss
    # skipped the logits (as for ``logits``)
    mtp_logits: list[torch.Tensor] | None = None


class HybridLM(nn.Module):
    def __init__(self, cfg: ModelConfig, plan: LayerPlan | None = None) -> None:
        super().__init__()
        self.cfg = cfg
        self.plan = plan if plan is not None else load(cfg.pattern)
        require_buildable(self.plan)
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.structure_embed = structure_embedding(cfg)  # None unless [structure] embedding
        self.ngram_embed = ngram_embedding(cfg)  # None unless [ngram] orders
        self.blocks = nn.ModuleList(Block(s.family, s.variant, cfg) for s in self.plan.layers)
        self.norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.lm_head = (
            None if cfg.tie_embeddings else nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        )
        self.mtp = MultiTokenPrediction(cfg) if cfg.mtp.depth else None
        share_indices([b.mixer for b in self.blocks], cfg.dsa.index_from,  # [dsa] index_from
                      [s.stage for s in self.plan.layers])
        self._init_weights()

    # -- init ---------------------------------------------------------------------------------
    def _init_weights(self) -> None:
        """N(0, init_std) for embeddings and linear maps; residual-output projections scaled
        by 1/sqrt(2 * n_layers) (GPT-2). Mixers keep their own special parameters (A_log,
        dt_bias, norms...) as their constructors initialised them."""
        std = self.cfg.init_std
        out_std = std / math.sqrt(2 * len(self.blocks))
        nn.init.normal_(self.embed.weight, std=std)
        if self.structure_embed is not None:
            nn.init.zeros_(self.structure_embed.weight)
        if self.ngram_embed is not None:
            self.ngram_embed.reset_parameters()
        if self.lm_head is not None:
            nn.init.normal_(self.lm_head.weight, std=std)
        if self.mtp is not None:
            for module in self.mtp.depths:
                nn.init.normal_(module.in_proj.weight, std=std)
        for block in self.all_blocks():
            for module in block.mixer.modules():
                if isinstance(module, nn.Linear):
                    nn.init.normal_(module.weight, std=std)
                    if module.bias is not None:
                        nn.init.zeros_(module.bias)
            for weight in block.mixer.residual_projections():
                nn.init.normal_(weight, std=out_std)

    # -- forward ------------------------------------------------------------------------------
    def all_blocks(self) -> list[Block]:
        """The main stack's blocks, then the MTP modules' blocks (depth order)."""
        return list(self.blocks) + (self.mtp.blocks() if self.mtp is not None else [])

    def embed_inputs(
        self,
        input_ids: torch.Tensor,
        doc_ids: torch.Tensor | None = None,
        structure_ids: torch.Tensor | None = None,
        ngram_context: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """[B, L] token ids -> [B, L, D]: the token embedding plus, where configured, the
        structure-id embedding of ``structure_ids`` [B, L] and the hashed n-gram embedding
        (its predecessors: ``ngram_context`` [B, max order - 1] before each row, then the
        row's own tokens within each document of ``doc_ids``). See ``model/features.py``."""
        x = self.embed(input_ids)
        if self.structure_embed is not None:
            if structure_ids is None:
                raise MegaCppError("this model embeds structure ids ([structure] embedding = "
                                   "true): its inputs must carry structure_ids")
            x = x + self.structure_embed(structure_ids)
        if self.ngram_embed is not None:
            x = x + self.ngram_embed(input_ids, ngram_context, doc_ids)
        return x

    def residual_stream(
        self,
        input_ids: torch.Tensor,
        doc_ids: torch.Tensor | None = None,
        structure_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """[B, L] token ids -> [B, L, D] output of the last block (before the final norm)."""
        x, pending = self.embed_inputs(input_ids, doc_ids, structure_ids), None
        for block in self.blocks:
            # each block adds the previous block's output inside its norm kernel (pending)
            x, pending = block(x, doc_ids=doc_ids, pending=pending, defer=True)
        return x if pending is None else x + pending

    def hidden_states(
        self,
        input_ids: torch.Tensor,
        doc_ids: torch.Tensor | None = None,
        structure_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """[B, L] token ids -> [B, L, D] final-normed hidden states."""
        return self.norm(self.residual_stream(input_ids, doc_ids, structure_ids))

    def _head_weight(self) -> torch.Tensor:
        return self.embed.weight if self.lm_head is None else self.lm_head.weight

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        return F.linear(h, self._head_weight())

    def forward(
        self,
        input_ids: torch.Tensor,
        doc_ids: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        structure_ids: torch.Tensor | None = None,
    ) -> ModelOutput:
        x = self.residual_stream(input_ids, doc_ids, structure_ids)
        h = self.norm(x)
        # per MTP depth: normed hidden states [B, L, D], the shared head's input
        mtp_normed = None if self.mtp is None else self.mtp(x, input_ids, doc_ids, self.embed)
        if labels is None:
            mtp_logits = None if mtp_normed is None else [self.logits(n) for n in mtp_normed]
            return ModelOutput(logits=self.logits(h), mtp_logits=mtp_logits)
        lm_loss, logits = self.lm_loss(h, labels)
        aux_loss = self._aux_loss()
        loss = lm_loss if aux_loss is None else lm_loss + aux_loss
        mtp_loss = mtp_logits = None
        if mtp_normed is not None:
            mtp_loss, mtp_logits = self.mtp.loss(mtp_normed, labels, IGNORE_INDEX, self.lm_loss)
            loss = loss + self.mtp.loss_weight * mtp_loss
        return ModelOutput(
            logits=logits,
            loss=loss,
            lm_loss=lm_loss,
            aux_loss=aux_loss,
            mtp_loss=mtp_loss,
            mtp_logits=mtp_logits,
        )

    def lm_loss(
        self, h: torch.Tensor, labels: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(mean cross-entropy over the real targets of labels [B, L] -- 0 when there are
        none --, the logits or None) from head-input hidden states h [B, L, D] (the final
        ones, or an MTP depth's): when the catalog chose a fused linear cross-entropy backend
        for h's device and dtype, straight from h and the head weight without the logits;
        else from the logits."""
        backend = resolve("linear_cross_entropy", h)
        if backend.role != "fallback":
            loss = backend.fn(h.flatten(0, 1), self._head_weight(), labels.flatten(), IGNORE_INDEX)
            return loss, None
        logits = self.logits(h)
        return mean_cross_entropy(logits, labels, IGNORE_INDEX), logits

    def _aux_loss(self) -> torch.Tensor | None:
        """Sum of the auxiliary losses the last forward left on its mixers (MoE sequence
        balance, DSA indexer KL), or None when there are none."""
        mixers = [b.mixer for b in self.all_blocks()]
        aux = [m.aux_loss for m in mixers if m.aux_loss is not None]
        return torch.stack(aux).sum() if aux else None

    # -- decoding -----------------------------------------------------------------------------
    @torch.no_grad()
    def generate_greedy(self, input_ids: torch.Tensor, max_new_tokens: int) -> torch.Tensor:
        """Greedy continuation, [B, L] -> [B, L + max_new_tokens], through a
        :class:`~megacpp.model.cache.LockstepCache` of the B rows (the paged caches and mixer
        code the serving engine runs, without its scheduler)."""
        if self.structure_embed is not None:
            raise MegaCppError("generate_greedy cannot compute structure ids (token ids only): "
                               "decode a structure-embedding model through the serving engine")
        B, L = input_ids.shape
        cache = LockstepCache(self, B, L + max_new_tokens, input_ids.device,
                              self.embed.weight.dtype)
        out, tokens = [input_ids], input_ids
        for _ in range(max_new_tokens):
            logits = self.forward_paged(tokens, cache.layers, cache.advance(tokens))
            tokens = logits.argmax(-1)[:, None]  # [B, 1]
            out.append(tokens)
        return torch.cat(out, dim=1)

    # -- paged decoding (the serving engine) ---------------------------------------------------
    @torch.no_grad()
    def forward_paged(
        self, input_ids: torch.Tensor, layers: list, batch: PagedBatch, layer_fn=None,
        all_positions: bool = False,
    ) -> torch.Tensor:
        """Rows at their own positions through the engine's paged caches: input_ids [B, L]
        -> next-token logits [B, V] at each row's last real token (``batch.last_index``), or
        with ``all_positions`` [B, L, V] at every token.

        ``layers[i]`` is layer i's pool: a :class:`~megacpp.model.cache.PagedPool` of the
        mixer's ``paged_layout()`` (attention), the mixer's ``init_cache`` state with one row
        per slot (M, R), or None (E, D). Each block runs its mixer's ``forward_paged`` over
        it (:class:`~megacpp.model.mixer.Mixer`): attention appends to its pages, M/R advance
        their rows' slots (``batch.state_slots``), one-token MoE steps run every expert densely
        (:func:`~megacpp.model.moe.moe_all_experts`). No host syncs in a one-token step:
        capturable in a CUDA graph for a fixed batch shape.

        ``layer_fn`` replaces :func:`paged_layer` (same signature), e.g. by a compiled copy."""
        x = self.residual_paged(input_ids, layers, batch, layer_fn)  # [B, L, D]
        if all_positions:
            return self.logits(self.norm(x))  # [B, L, V]
        if batch.last_index is None:
            last = x[:, -1]
        else:
            last = x[torch.arange(x.shape[0], device=x.device), batch.last_index]
        return self.logits(self.norm(last))  # [B, V]

    @torch.no_grad()
    def residual_paged(
        self, input_ids: torch.Tensor, layers: list, batch: PagedBatch, layer_fn=None
    ) -> torch.Tensor:
        """:meth:`forward_paged`'s main stack: input_ids [B, L] -> the last block's output
        [B, L, D] (before the final norm: the MTP modules' input)."""
        batch.forget()  # per-forward tables are recomputed (a replayed step reuses the batch)
        layer_fn = layer_fn or paged_layer
        x = self.embed_inputs(input_ids, structure_ids=batch.structure_ids,
                              ngram_context=batch.ngram_context)  # [B, L, D]
        for block, pool in zip(self.blocks, layers, strict=True):
            x = layer_fn(block, pool, x, batch)
        return x

    def paged_layouts(self) -> list[dict[str, tuple[int, ...]] | None]:
        """Per layer: the mixer's paged layout (attention), or None (M, R, E, D)."""
        return [b.mixer.paged_layout() for b in self.blocks]

    def init_state_pool(
        self, layer: int, slots: int, device: torch.device | str, dtype: torch.dtype
    ) -> object | None:
        """Layer ``layer``'s state pool for ``slots`` sequences (M, R), or None."""
        return self.blocks[layer].mixer.init_cache(slots, device=device, dtype=dtype)

    # -- MoE balancing --------------------------------------------------------------------------
    def moe_blocks(self) -> list[Block]:
        """Every E block, the MTP modules' included."""
        return [b for b in self.all_blocks() if b.family == "E"]

    @torch.no_grad()
    def update_moe_biases(self) -> None:
        for block in self.moe_blocks():
            block.mixer.update_bias()

    def moe_load(self) -> dict[int, list[float]]:
        """Per-layer token counts per expert from the last forward (MTP blocks are numbered
        after the main stack, in :meth:`all_blocks` order)."""
        blocks = enumerate(self.all_blocks())
        return {i: b.mixer.last_load.tolist() for i, b in blocks if b.family == "E"}


def paged_layer(block: Block, pool: object, x: torch.Tensor, batch: PagedBatch) -> torch.Tensor:
    """One block of :meth:`HybridLM.forward_paged`: x [B, L, D] -> [B, L, D]."""
    return block.forward_paged(x, PagedView(pool, batch))


def next_token_labels(input_ids: torch.Tensor, doc_ids: torch.Tensor | None = None) -> torch.Tensor:
    """labels[t] = input_ids[t+1], or IGNORE_INDEX where t+1 is past the row or in another
    document -- so the loss never asks the model to predict across a document boundary."""
    labels = torch.full_like(input_ids, IGNORE_INDEX)
    labels[:, :-1] = input_ids[:, 1:]
    if doc_ids is not None:
        crosses = doc_ids[:, 1:] != doc_ids[:, :-1]
        labels[:, :-1][crosses] = IGNORE_INDEX
    return labels
