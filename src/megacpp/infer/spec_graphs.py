"""The speculative decode step as replayed CUDA graphs, two per (batch, width, k) bucket.

A speculative step of ``B`` rows, each verifying ``k`` drafts, whose longest block table
(positions up to N + k) has ``W`` blocks runs the graphs of the smallest captured bucket
``(b >= B, w >= W, k)`` -- the decode graphs' batch and width buckets
(:mod:`megacpp.infer.graphs`); ``k`` is exact (a row near ``max_model_len`` verifies fewer
drafts, and its group gets a graph of its own):

* the **draft** graph: MTP module 1 run recursively for drafts 2 .. k
  (:meth:`SpeculativeDecoder.run_drafts`; none for k = 1, whose only draft is the pending
  d_1, an input);
* the **verify** graph: the main stack over ``[t_N, d_1 .. d_k]`` at positions N .. N + k,
  the acceptance, the M/R rollback and module 1's catch-up with the next d_1
  (:meth:`SpeculativeDecoder.verify`). The per-position M/R states the rollback picks from
  live in the graph's memory pool (the verify writes and reads them within one replay); the
  chosen state is written to the row's slot inside the graph.

The drafts pass from one graph to the other on the device (a copy into the verify graph's
static draft buffer), so a step costs one host-to-device copy of the inputs, two replays and
one device-to-host copy of the results ([B, k + 3] tokens and counts). Padding rows feed token
0 at position 0, write into the scratch block and scratch slot (the decode graphs' padding).
The graphs are captured lazily on first use and share one memory pool (apart from the decode
graphs'); each holds its outputs and its intermediates' share of the pool -- the verify's
per-position states are ``(k + 1) x b`` rows of each M/R layer's state.

The engine builds these graphs with the decode graphs (CUDA with ``cuda_graphs``); the eager
step serves only where there are none (the CPU, ``cuda_graphs = False``: the engine leaves
``SpeculativeDecoder.graphs`` None) and for module 1's catch-up over a prompt (once per
request, after its prefill). A step past the buffers (more rows, blocks or drafts than the
engine's limits allow) raises instead of falling back. The eager step (the same tensor code
on unpadded inputs) is the reference the graphs are
tested against (``tests/infer/test_speculative.py`` with ``capture=False`` on the CPU,
``tests/infer/test_speculative_gpu.py`` captured).
"""

from __future__ import annotations

import torch
from torch import Tensor

from megacpp.infer.graphs import StaticInputs, batch_buckets, bucket, capture_step, width_buckets
from megacpp.infer.scheduler import ScheduledRequest
from megacpp.infer.speculative import Draft, SpeculativeDecoder, StepInputs


class SpecGraphs:
    """Captures and replays the speculative step of ``decoder``; see the module docstring."""

    def __init__(self, decoder: SpeculativeDecoder, max_batch: int, max_width: int,
                 capture: bool = True) -> None:
        self.decoder, self.capture = decoder, capture
        cache, model = decoder.cache, decoder.model
        self.device = cache.device
        self.batches, self.widths = batch_buckets(max_batch), width_buckets(max_width)
        self.max_batch, self.max_width, self.max_k = max_batch, max_width, decoder.k
        n, L = max_batch, decoder.k + 1
        self.context_len = 0 if model.ngram_embed is None else model.ngram_embed.context_len
        # positions and slot mapping hold [n, k + 1] for the step's k (the first n * (k + 1))
        sizes = {"newest": n, "first": n, "positions": n * L, "slot_mapping": n * L,
                 "tables": n * max_width, "state_slots": n, "ngram": n * self.context_len}
        pads = {"newest": 0, "first": 0, "positions": 0,  # token 0 at position 0
                "slot_mapping": cache.null_block * cache.block_size,  # the scratch block
                "tables": cache.null_block, "state_slots": cache.null_slot,
                "ngram": -1}  # no previous tokens
        self.inputs = StaticInputs(sizes, pads, self.device)
        dim = model.cfg.d_model
        dtype = next(model.parameters()).dtype
        self.h_prev = torch.zeros(n, 1, dim, dtype=dtype, device=self.device)  # [n, 1, D]
        self.drafts_in = torch.zeros(n * decoder.k, dtype=torch.int64, device=self.device)
        self.graphs: dict[tuple[int, int, int], tuple] = {}  # (b, w, k) -> (draft, verify)
        self.buckets_used: set[tuple[int, int, int]] = set()
        self._pool = None
        self._step: tuple[int, int, int, int] | None = None  # the staged step's B, b, w, k

    # -- replay ----------------------------------------------------------------------------------
    def stage(self, rows: list[ScheduledRequest], pending: list[Draft], k: int) -> StepInputs:
        """Pick the bucket of ``rows`` verifying ``k`` drafts, capture its graphs if new, and
        write the step's inputs to the static buffers -> the bucket's view of them."""
        B = len(rows)
        W = -(-(max(r.start for r in rows) + k + 1) // self.decoder.cache.block_size)
        if B > self.max_batch or W > self.max_width or not 1 <= k <= self.max_k:
            raise ValueError(f"speculative step of {B} rows x {W} blocks x {k} drafts exceeds "
                             f"the captured maximum {self.max_batch} x {self.max_width} x "
                             f"{self.max_k}")
        b, w = bucket(self.batches, B), bucket(self.widths, W)
        self._graphs(b, w, k)  # capture first: it fills the buffers with padding
        self.buckets_used.add((b, w, k))
        self._write(rows, pending, k)
        self._step = (B, b, w, k)
        return self._view(b, w, k)

    def draft(self) -> Tensor:
        """[B, k] drafts of the staged step (a view of the draft graph's output or of the
        staged d_1, valid until the next step)."""
        B, b, w, k = self._require_staged()
        draft_graph, out = self.graphs[(b, w, k)][0]
        if draft_graph is None:  # k = 1: the pending d_1 is the only draft
            return self.inputs.dev("first")[:B, None]
        draft_graph.replay()
        return out[:B]

    def verify(self, drafts: Tensor) -> tuple[Tensor, Tensor]:
        """Verify ``drafts`` [B, k] of the staged step -> (packed [B, k + 3], module 1's
        output [B, D]): views into the verify graph's outputs, valid until the next step."""
        B, b, w, k = self._require_staged()
        self._step = None
        staged = self._drafts_view(k)
        if drafts.data_ptr() != staged.data_ptr():
            staged[:B].copy_(drafts)
        verify_graph, (packed, final) = self.graphs[(b, w, k)][1]
        verify_graph.replay()
        return packed[:B], final[:B]

    def _require_staged(self) -> tuple[int, int, int, int]:
        if self._step is None:
            raise RuntimeError("SpecGraphs.draft/verify called without a staged step")
        return self._step

    def _write(self, rows: list[ScheduledRequest], pending: list[Draft], k: int) -> None:
        """The step's inputs (padding everywhere else) to the static buffers."""
        inputs, n, B, L = self.inputs, self.max_batch, len(rows), k + 1
        bs = self.decoder.cache.block_size
        inputs.pad()
        inputs.host("newest")[:B] = [r.token_ids[0] for r in rows]
        inputs.host("first")[:B] = [d.first for d in pending]
        positions = inputs.host("positions")[: n * L].reshape(n, L)
        slot_mapping = inputs.host("slot_mapping")[: n * L].reshape(n, L)
        tables = inputs.host("tables").reshape(n, self.max_width)
        for i, r in enumerate(rows):
            row_positions = range(r.start, r.start + L)
            positions[i] = row_positions
            slot_mapping[i] = [r.block_table[p // bs] * bs + p % bs for p in row_positions]
            tables[i, : len(r.block_table)] = r.block_table
        inputs.host("state_slots")[:B] = [r.state_slot for r in rows]
        if self.context_len:
            context = inputs.host("ngram").reshape(n, self.context_len)
            context[:B] = self.decoder.runner._context_lists(rows)
        inputs.upload()
        self.h_prev[B:].zero_()
        self.h_prev[:B, 0].copy_(torch.stack([d.hidden for d in pending]))

    def _drafts_view(self, k: int) -> Tensor:
        return self.drafts_in[: self.max_batch * k].view(self.max_batch, k)

    def _view(self, b: int, w: int, k: int) -> StepInputs:
        """The (b, w, k) bucket's view of the static buffers."""
        n, L, dev = self.max_batch, k + 1, self.inputs.dev
        return StepInputs(
            newest=dev("newest")[:b],
            first=dev("first")[:b],
            h_prev=self.h_prev[:b],
            positions=dev("positions")[: n * L].view(n, L)[:b],
            slot_mapping=dev("slot_mapping")[: n * L].view(n, L)[:b],
            tables=dev("tables").view(n, self.max_width)[:b, :w],
            state_slots=dev("state_slots")[:b],
            ngram_context=(dev("ngram").view(n, self.context_len)[:b]
                           if self.context_len else None),
        )

    # -- capture ---------------------------------------------------------------------------------
    def capture_all(self) -> None:
        """Capture every (batch, width) bucket for the configured k now (largest first, so
        smaller ones reuse its memory); fewer drafts (near ``max_model_len``) stay lazy."""
        for b in reversed(self.batches):
            for w in reversed(self.widths):
                self._graphs(b, w, self.max_k)

    def _graphs(self, b: int, w: int, k: int) -> tuple:
        if (b, w, k) not in self.graphs:
            self.graphs[(b, w, k)] = self._capture(b, w, k)
        return self.graphs[(b, w, k)]

    @torch.no_grad()
    def _capture(self, b: int, w: int, k: int) -> tuple:
        # warm-up and capture runs read padding only: they touch only the scratch block/slot
        self.inputs.pad()
        self.inputs.upload(blocking=True)
        self.h_prev.zero_()
        self.drafts_in.zero_()
        x, decoder = self._view(b, w, k), self.decoder
        draft = (None, None)
        if k > 1:
            graph, out, self._pool = capture_step(lambda: decoder.run_drafts(x, k),
                                                  self.device, self._pool, self.capture)
            draft = (graph, out)
        drafts = self._drafts_view(k)[:b]
        graph, out, self._pool = capture_step(lambda: decoder.verify(x, drafts), self.device,
                                              self._pool, self.capture)
        return draft, (graph, out)

