"""Self-speculative decoding: the model's first MTP module drafts, the main stack verifies.

A decoding row whose newest token ``t_N`` (position N) is not yet in the caches runs one
*speculative step* instead of a one-token decode:

1. **draft** ``k`` tokens with MTP module 1 (``model/mtp.py``). Its first draft ``d_1`` (for
   position N + 1) was made at the end of the previous step, from the main stack's output at
   position N - 1 and the embedding of ``t_N`` -- exactly what module 1 was trained on. Draft
   j >= 2 runs module 1 again, one position later, on its own previous output and the
   embedding of ``d_{j-1}`` (module 1 used recursively: deeper modules are not used);
2. **verify** ``[t_N, d_1, ..., d_k]`` at positions N .. N + k in one forward of the main
   stack; its argmax at position N + j - 1 is the model's own next token there;
3. **accept** the longest prefix of drafts equal to those argmaxes (``a`` of them), plus the
   argmax after it: ``a + 1`` tokens per step, the same tokens plain greedy decoding makes;
4. **roll back** the M and R layers to their state after position N + a. Attention needs no
   rollback: entries past N + a are masked (keys past a query's position) and overwritten by
   the next step before anything reads them;
5. **catch up** MTP module 1's own attention cache over the accepted positions N .. N + a
   (each position's main output and the token after it are now known) and draft ``d_1`` for
   the next step from the last of them.

Rollback keeps per-position states from the verify forward (not a snapshot plus a re-run):
the M/R layers advance one token at a time through their decode ``step`` (the kernel plain
decoding runs, so recurrent numerics match it exactly) and each position's state is kept,
so a step is one forward however many drafts are rejected.

On CUDA with ``cuda_graphs`` the step (drafts 2 .. k; verify, acceptance, rollback and
catch-up) replays captured CUDA graphs (:mod:`megacpp.infer.spec_graphs`); elsewhere it runs
eagerly. Both run the same tensor code (:meth:`SpeculativeDecoder.run_drafts`,
:meth:`SpeculativeDecoder.verify`: no host syncs) and one host sync per step.

Only greedy requests without logprobs speculate: a sampled request (temperature > 0) decodes
one token at a time through the plain path, with its usual draws, and so does a request that
asks for logprobs. Speculation needs an MTP module whose
sublayers are attention, MoE or dense MLP (its draft positions are overwritten, which a
recurrent state cannot be), and a model without a structure-id embedding (draft tokens have
no parse).
"""

from __future__ import annotations

from collections.abc import Container
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from megacpp.errors import ConfigError
from megacpp.infer.cache_manager import CacheManager
from megacpp.infer.memory import check_fits
from megacpp.infer.scheduler import ScheduledRequest
from megacpp.model.cache import PagedBatch, gather_state, paged_pool
from megacpp.model.mixer import RecurrentMixer
from megacpp.model.model import HybridLM, paged_layer
from megacpp.model.moe import moe_all_experts

if TYPE_CHECKING:
    from megacpp.infer.model_runner import ModelRunner
    from megacpp.infer.spec_graphs import SpecGraphs

MAX_SPECULATIVE_TOKENS = 16
DRAFT_FAMILIES = ("A", "E", "D")  # MTP sublayers whose draft positions can be overwritten
DENSE_MOE_TOKENS = 16  # MoE over at most this many tokens per row runs every expert densely


def check_speculative(model: HybridLM, k: int) -> None:
    """ConfigError naming what is missing when ``model`` cannot draft ``k`` tokens."""
    if model.mtp is None or not model.mtp.depths:
        raise ConfigError(
            f"--speculative-tokens {k} needs a model with multi-token-prediction heads "
            "([model.mtp] depth >= 1); this model has none (mtp.depth = 0)")
    bad = [b.letter for b in model.mtp.depths[0].blocks if b.family not in DRAFT_FAMILIES]
    if bad:
        raise ConfigError(
            f"--speculative-tokens {k}: the MTP module's sublayers must be attention, MoE or "
            f"dense MLP (A, E, D) to draft; mtp.pattern = {model.cfg.mtp.pattern!r} has "
            f"{', '.join(bad)}")
    if model.structure_embed is not None:
        raise ConfigError(
            f"--speculative-tokens {k}: this model embeds structure ids ([structure] "
            "embedding = true), which draft tokens do not have; serve it without speculation")


@dataclass
class Draft:
    """A row's next draft, made when its token ``t_N`` was appended."""

    position: int  # N: the position of the newest token (not yet in the caches)
    first: int  # d_1, the draft for position N + 1
    hidden: Tensor  # [D] MTP module 1's output (before its norm) that drafted d_1


@dataclass
class StepInputs:
    """A speculative step's inputs, ``B`` rows verifying ``k`` drafts (device tensors; the
    captured graphs' static buffers, or the eager step's own)."""

    newest: Tensor  # [B] t_N
    first: Tensor  # [B] d_1
    h_prev: Tensor  # [B, 1, D] module 1's output that drafted d_1
    positions: Tensor  # [B, k + 1] N .. N + k
    slot_mapping: Tensor  # [B, k + 1] pool row of each position (block * size + offset)
    tables: Tensor  # [B, W] block tables (scratch block past each row's blocks)
    state_slots: Tensor  # [B]
    ngram_context: Tensor | None  # [B, C] tokens before t_N (a hashed n-gram branch)


@dataclass
class SpecStep:
    """One row's result of a speculative step."""

    tokens: list[int]  # the accepted drafts, then the model's token after them
    num_computed: int  # tokens the caches hold now (N + accepted + 1)
    drafted: int
    accepted: int


class _RecordStates:
    """A ``layer_fn`` for :meth:`HybridLM.residual_paged`: attention, MoE and MLP blocks as
    usual; M and R blocks one token at a time through their decode ``step``, keeping their
    state after every position (``states[pool]``: one state object [B, ...] per position)."""

    def __init__(self) -> None:
        self.states: dict[int, tuple[Any, list[Any]]] = {}  # id(pool) -> (pool, per position)

    def __call__(self, block, pool, x: Tensor, batch: PagedBatch) -> Tensor:
        if not isinstance(block.mixer, RecurrentMixer):
            return _few_token_layer(block, pool, x, batch)
        x, h, _ = block.fused_pre_norm(x)
        state = gather_state(pool, batch.state_slots)
        outs, kept = [], []
        for t in range(h.shape[1]):
            outs.append(block.mixer.step(h[:, t : t + 1], state))  # [B, 1, D]
            kept.append(_clone_state(state))
        self.states[id(pool)] = (pool, kept)
        return x + torch.cat(outs, dim=1)

    def restore(self, slots: Tensor, accepted: Tensor) -> None:
        """Write each row's state after its last accepted position (index ``accepted`` [B]
        into the verify's positions) to its slot."""
        rows = torch.arange(slots.shape[0], device=slots.device)
        for pool, kept in self.states.values():
            for f in fields(pool):
                per_position = torch.stack([getattr(s, f.name) for s in kept])  # [L, B, ...]
                getattr(pool, f.name).index_copy_(0, slots, per_position[accepted, rows])


def _few_token_layer(block, pool, x: Tensor, batch: PagedBatch) -> Tensor:
    """:func:`paged_layer`, with MoE over a few tokens (a verify or a draft step) through the
    decode step's dense :func:`moe_all_experts` instead of the routed prefill path: the same
    function, and much cheaper for a handful of tokens."""
    if block.family == "E" and x.shape[1] <= DENSE_MOE_TOKENS:
        x, h, _ = block.fused_pre_norm(x)
        return x + moe_all_experts(block.mixer, h)
    return paged_layer(block, pool, x, batch)


def _clone_state(state: Any) -> Any:
    return type(state)(**{f.name: getattr(state, f.name).clone() for f in fields(state)})


class SpeculativeDecoder:
    """MTP module 1's caches, the rows' pending drafts and the speculative step; see the
    module docstring. ``runner`` builds the batches (block tables, n-gram context)."""

    def __init__(self, model: HybridLM, cache: CacheManager, k: int, max_model_len: int,
                 dtype: torch.dtype) -> None:
        check_speculative(model, k)
        self.model, self.cache, self.k, self.max_model_len = model, cache, k, max_model_len
        self.mtp = model.mtp.depths[0]
        layouts = [b.mixer.paged_layout() for b in self.mtp.blocks]
        need = sum(paged_pool(lay, cache.num_blocks + 1, cache.block_size, "meta", dtype).nbytes()
                   for lay in layouts if lay is not None)
        check_fits(need, cache.device, "the MTP module's KV cache", "lower --max-num-seqs, "
                   "--max-model-len or --num-blocks, or --speculative-tokens 0")
        self.pools = [None if lay is None else
                      paged_pool(lay, cache.num_blocks + 1, cache.block_size, cache.device, dtype)
                      for lay in layouts]
        self.drafts: dict[str, Draft] = {}
        self.pending: dict[str, Tensor] = {}  # prefill chunk's main output, until sampled
        self.runner: ModelRunner | None = None
        self.graphs: SpecGraphs | None = None  # set by the engine on CUDA with cuda_graphs
        self.draft_tokens = self.accepted_tokens = self.steps = 0

    # -- who speculates --------------------------------------------------------------------------
    def wants(self, req: ScheduledRequest) -> bool:
        """Greedy requests that ask for no logprobs speculate."""
        params = req.params
        return (req.generator is None and params.logprobs is None
                and params.prompt_logprobs is None)

    def budget(self, req: ScheduledRequest) -> int:
        """Drafts this decoding row verifies now (0: a plain decode)."""
        draft = self.drafts.get(req.request_id)
        if not self.wants(req) or draft is None or draft.position != req.start:
            return 0
        return max(0, min(self.k, self.max_model_len - 1 - req.start))

    def forget(self, live: Container[str]) -> None:
        """Drop the drafts of requests not in ``live`` (the engine's unfinished requests)."""
        for rid in [r for r in self.drafts if r not in live]:
            del self.drafts[rid]

    # -- prefill ---------------------------------------------------------------------------------
    def prefilled(self, chunks: list[ScheduledRequest], hidden: Tensor) -> None:
        """Keep a prefill group's main output [B, L, D] until its tokens are sampled."""
        for row, chunk in enumerate(chunks):
            if self.wants(chunk):
                self.pending[chunk.request_id] = hidden[row]

    def after_prefill(self, chunks: list[ScheduledRequest], sampled: dict[str, int]) -> None:
        """MTP catch-up over the chunks' positions, now that the token after each is known
        (the next prompt token, or the one just sampled); a last chunk's row gets its draft."""
        rows = [c for c in chunks if c.request_id in self.pending]
        if not rows:
            return
        hidden = torch.stack([self.pending.pop(c.request_id) for c in rows])  # [B, L, D]
        following = []
        for c in rows:
            after = c.history[c.start + 1 : c.end + 1]
            if len(after) < len(c.token_ids):
                after = [*after, sampled[c.request_id]]
            following.append(after)
        last = torch.full((len(rows),), hidden.shape[1] - 1, device=hidden.device)
        self._catch_up(rows, hidden, following, last, done=[c.request_id in sampled for c in rows])

    # -- decode ----------------------------------------------------------------------------------
    def decode(self, rows: list[ScheduledRequest]) -> dict[str, SpecStep]:
        """Speculative steps for ``rows`` (each with ``budget(row) >= 1``), grouped by their
        number of drafts so every forward has rows of equal length."""
        groups: dict[int, list[ScheduledRequest]] = {}
        for r in rows:
            groups.setdefault(self.budget(r), []).append(r)
        out: dict[str, SpecStep] = {}
        for k, group in groups.items():
            out.update(self._step(group, k))
        return out

    def _step(self, rows: list[ScheduledRequest], k: int) -> dict[str, SpecStep]:
        """One speculative step of ``rows`` (each verifying ``k`` drafts): through the
        captured graphs where :attr:`graphs` is set, else eagerly -- the same tensor code
        (:meth:`run_drafts`, :meth:`verify`) either way, and one host sync."""
        pending = [self.drafts.pop(r.request_id) for r in rows]
        graphs = self.graphs
        inputs = (self._inputs(rows, pending, k) if graphs is None
                  else graphs.stage(rows, pending, k))
        drafts = self._draft(rows, k, inputs)  # [B, k]
        if graphs is None:
            packed, final = self.verify(inputs, drafts)
        else:
            packed, final = graphs.verify(drafts)
            final = final.clone()  # a view into the graph's output, rewritten by the next step
        packed_list = packed.tolist()  # per row: k + 1 following tokens, accepted, next d_1
        out = {}
        for i, (r, row) in enumerate(zip(rows, packed_list, strict=True)):
            a, first = row[k + 1], row[k + 2]
            out[r.request_id] = SpecStep(tokens=row[: a + 1], num_computed=r.start + a + 1,
                                         drafted=k, accepted=a)
            self.drafts[r.request_id] = Draft(r.start + a + 1, first, final[i])
        self.steps += 1
        self.draft_tokens += k * len(rows)
        self.accepted_tokens += sum(step.accepted for step in out.values())
        return out

    def _draft(self, rows: list[ScheduledRequest], k: int, inputs: StepInputs) -> Tensor:
        """[B, k] drafts of the step's rows (the captured draft graph, or eagerly)."""
        if self.graphs is not None:
            return self.graphs.draft()
        return self.run_drafts(inputs, k)

    # -- the step's tensor code (captured by SpecGraphs; no host syncs) --------------------------
    def run_drafts(self, x: StepInputs, k: int) -> Tensor:
        """[B, k] drafts: each row's pending d_1, then module 1 run recursively at positions
        N .. N + k - 2 on its own previous output."""
        token, h_prev = x.first, x.h_prev  # [B], [B, 1, D]
        drafts = [token]
        for j in range(1, k):
            batch = PagedBatch(positions=x.positions[:, j - 1 : j],
                               slot_mapping=x.slot_mapping[:, j - 1],
                               block_tables=x.tables, state_slots=x.state_slots)
            h_prev = self._mtp_forward(h_prev, token[:, None], batch)  # [B, 1, D]
            token = self._mtp_logits(h_prev[:, 0]).argmax(-1)
            drafts.append(token)
        return torch.stack(drafts, dim=1)

    def verify(self, x: StepInputs, drafts: Tensor) -> tuple[Tensor, Tensor]:
        """Verify ``drafts`` [B, k], roll the M/R states back, catch module 1 up over the
        accepted positions -> (packed [B, k + 3] int64: the token after each position N ..
        N + k (the accepted drafts, then the model's own token; entries past it unread), the
        number accepted, and the next step's d_1; module 1's output [B, D] that drafted it)."""
        k = drafts.shape[1]
        ids = torch.cat([x.newest[:, None], drafts], dim=1)  # [B, k + 1]
        batch = PagedBatch(positions=x.positions, slot_mapping=x.slot_mapping.flatten(),
                           block_tables=x.tables, state_slots=x.state_slots,
                           ngram_context=x.ngram_context)
        record = _RecordStates()
        hidden = self.model.residual_paged(ids, self.cache.layers, batch, record)  # [B, k+1, D]
        targets = self.model.logits(self.model.norm(hidden)).argmax(-1)  # [B, k + 1]
        matches = (drafts == targets[:, :k]).int()
        accepted = matches.cumprod(dim=1).sum(dim=1)  # [B] leading matches
        record.restore(x.state_slots, accepted)
        bonus = targets.gather(1, accepted[:, None])  # [B, 1]
        following = torch.cat([drafts, bonus], dim=1)  # [B, k + 1]
        following.scatter_(1, accepted[:, None], bonus)
        # module 1 over positions N .. N + a; its writes past N + a go to the scratch block
        past = torch.arange(k + 1, device=ids.device)[None, :] > accepted[:, None]
        bs = self.cache.block_size
        catch_up = PagedBatch(positions=x.positions,
                              slot_mapping=x.slot_mapping.masked_fill(
                                  past, self.cache.null_block * bs).flatten(),
                              block_tables=x.tables, state_slots=x.state_slots)
        out = self._mtp_forward(hidden, following, catch_up)  # [B, k + 1, D]
        final = out[torch.arange(out.shape[0], device=out.device), accepted]  # [B, D]
        first = self._mtp_logits(final).argmax(-1)  # [B]
        packed = torch.cat([following, accepted[:, None], first[:, None]], dim=1)
        return packed.long(), final

    def _inputs(self, rows: list[ScheduledRequest], pending: list[Draft], k: int) -> StepInputs:
        """The eager step's inputs: positions N .. N + k of each row."""
        dev, bs = self.cache.device, self.cache.block_size
        starts = torch.tensor([r.start for r in rows], device=dev)
        positions = starts[:, None] + torch.arange(k + 1, device=dev)  # [B, k + 1]
        tables = self.runner._block_tables(rows, max(r.start for r in rows) + k + 1)  # [B, W]
        return StepInputs(
            newest=torch.tensor([r.token_ids[0] for r in rows], device=dev),
            first=torch.tensor([d.first for d in pending], device=dev),
            h_prev=torch.stack([d.hidden for d in pending])[:, None],
            positions=positions,
            slot_mapping=tables.gather(1, positions // bs) * bs + positions % bs,
            tables=tables,
            state_slots=torch.tensor([r.state_slot for r in rows], device=dev),
            ngram_context=self.runner._ngram_context(rows),
        )

    # -- MTP module 1 ----------------------------------------------------------------------------
    def _catch_up(self, rows: list[ScheduledRequest], hidden: Tensor, following: list[list[int]],
                  last: Tensor, done: list[bool]) -> None:
        """Module 1 over each row's positions ``start ..`` (main output ``hidden`` [B, L, D],
        the token after each position ``following``); rows that are ``done`` (their newest
        token is known) keep the draft from their position ``last`` [B]."""
        dev = self.cache.device
        L = hidden.shape[1]
        tokens = torch.tensor([(f + [0] * L)[:L] for f in following], device=dev)  # [B, L]
        batch = self._batch(rows, [r.start for r in rows], L, last=last)
        out = self._mtp_forward(hidden, tokens, batch)  # [B, L, D]
        rows_idx = torch.arange(len(rows), device=dev)
        final = out[rows_idx, last]  # [B, D]
        firsts = self._mtp_logits(final).argmax(-1).tolist()
        for i, (r, is_done) in enumerate(zip(rows, done, strict=True)):
            if is_done:
                position = r.start + int(last[i]) + 1
                self.drafts[r.request_id] = Draft(position, firsts[i], final[i])

    def _mtp_forward(self, h_prev: Tensor, tokens: Tensor, batch: PagedBatch) -> Tensor:
        """Module 1 through its paged caches: (main or previous output h_prev [B, L, D], the
        token after each position [B, L]) -> its output [B, L, D] (before its norm)."""
        batch.forget()
        m = self.mtp
        emb = self.model.embed(tokens)
        x = m.in_proj(torch.cat([m.hidden_norm(h_prev), m.embed_norm(emb)], dim=-1))
        for block, pool in zip(m.blocks, self.pools, strict=True):
            x = _few_token_layer(block, pool, x, batch)
        return x

    def _mtp_logits(self, h: Tensor) -> Tensor:
        return self.model.logits(self.mtp.norm(h))

    # -- batches ---------------------------------------------------------------------------------
    def _batch(self, rows: list[ScheduledRequest], starts: list[int], n_tokens: int,
               last: Tensor) -> PagedBatch:
        """Positions ``start .. start + n_tokens - 1`` of each row. Past ``last`` [B] (the
        catch-up's padding) entries go to the scratch block."""
        dev, bs = self.cache.device, self.cache.block_size
        positions = torch.tensor(starts, device=dev)[:, None] + torch.arange(n_tokens, device=dev)
        positions = positions.clamp(max=self.max_model_len - 1)  # padding never reaches past
        tables = self.runner._block_tables(rows, int(positions.max()) + 1)  # [B, W]
        slot_mapping = tables.gather(1, positions // bs) * bs + positions % bs  # [B, L]
        pad = torch.arange(n_tokens, device=dev)[None, :] > last[:, None]
        slot_mapping = slot_mapping.masked_fill(pad, self.cache.null_block * bs)
        return PagedBatch(
            positions=positions,
            slot_mapping=slot_mapping.flatten(),
            block_tables=tables,
            state_slots=torch.tensor([r.state_slot for r in rows], device=dev),
        )
