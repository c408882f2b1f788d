"""The batched decode step as replayed CUDA graphs, one per (batch, width) bucket.

A decode step of ``B`` rows whose longest block table has ``W`` blocks runs the graph of the
smallest captured bucket ``(b >= B, w >= W)``: batch sizes 1, 2, 4, 8, then multiples of 8
(up to ``max_num_seqs``); widths powers of two (up to the blocks of ``max_model_len``).
Padding rows feed token 0 at position 0, write their cache entries into the scratch block
and their M/R state into the scratch slot, so they never touch a real sequence; padding
table entries point at the scratch block and sit past every query's position (masked).

A model's structure ids and n-gram context (``model/features.py``) are two more static
inputs. All inputs travel in one pinned int64 buffer and one host-to-device copy per step; the
graph reads them from fixed device addresses (:class:`StaticInputs`). Graphs are captured
lazily on first use (:meth:`DecodeGraphs.capture_all` captures every bucket up front) and
share one memory pool. :func:`capture_step` and :class:`StaticInputs` also serve the
speculative step's graphs (:mod:`megacpp.infer.spec_graphs`).
The eager path (:meth:`HybridLM.forward_paged`) is the reference the graphs are tested
against (``tests/infer/test_engine_gpu.py``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from megacpp.infer.cache_manager import CacheManager
from megacpp.model.cache import PagedBatch
from megacpp.model.model import HybridLM, paged_layer

DecodeFn = Callable[[torch.Tensor, list, PagedBatch], torch.Tensor]


def compiled_decode_fn(model: HybridLM, backend: str = "inductor") -> DecodeFn:
    """``model.forward_paged`` with every block run through one ``torch.compile``'d
    :func:`~megacpp.model.model.paged_layer`. Blocks of one family share the compiled code
    (their parameters are graph inputs), so compile time grows with the families and bucket
    shapes, not with the depth; the win is fusing the many small elementwise kernels of the
    recurrent steps, norms and RoPE. Used inside the captured graphs (``compile_decode``).

    Not ``fullgraph``: our fast kernels are opaque to dynamo (``declare.lazy``), so a block
    that calls one (the Triton RMSNorm under ``--kernels auto``) is compiled in pieces around
    it. The pieces and the kernels are captured into the same CUDA graph, so the breaks cost
    nothing at replay; with ``fullgraph=True`` such a block fails to compile."""
    config = torch._dynamo.config
    config.recompile_limit = max(config.recompile_limit, 64)  # families x variants x shapes
    layer = torch.compile(paged_layer, backend=backend)
    return functools.partial(model.forward_paged, layer_fn=layer)


def batch_buckets(max_batch: int) -> list[int]:
    """1, 2, 4, 8, 16, 24, 32, ... up to and including ``max_batch``."""
    sizes = [b for b in (1, 2, 4) if b < max_batch] + list(range(8, max_batch, 8))
    return [*sizes, max_batch]


def width_buckets(max_width: int) -> list[int]:
    """Powers of two below ``max_width``, then ``max_width``."""
    sizes, w = [], 1
    while w < max_width:
        sizes.append(w)
        w *= 2
    return [*sizes, max_width]


def bucket(sizes: list[int], n: int) -> int:
    return next(s for s in sizes if s >= n)


class DecodeGraphs:
    """Captures and replays the decode step; see the module docstring."""

    def __init__(
        self,
        model: HybridLM,
        cache: CacheManager,
        max_batch: int,
        max_width: int,
        decode_fn: DecodeFn | None = None,
        capture: bool = True,
    ) -> None:
        self.model, self.cache, self.capture = model, cache, capture
        self.decode_fn = decode_fn or model.forward_paged
        self.batches, self.widths = batch_buckets(max_batch), width_buckets(max_width)
        self.max_batch, self.max_width = max_batch, max_width
        n = max_batch
        # optional inputs of the embedding step: structure ids [n, 1], n-gram context [n, C]
        self.uses_structure = model.structure_embed is not None
        self.context_len = 0 if model.ngram_embed is None else model.ngram_embed.context_len
        sizes = {"ids": n, "positions": n, "slot_mapping": n, "state_slots": n,
                 "tables": n * max_width, "structure": n if self.uses_structure else 0,
                 "ngram": n * self.context_len}
        pads = {"ids": 0, "positions": 0,  # token 0 at position 0
                "slot_mapping": cache.null_block * cache.block_size,  # the scratch block
                "state_slots": cache.null_slot, "tables": cache.null_block,
                "structure": 0,  # structure id OTHER
                "ngram": -1}  # no previous tokens
        self.inputs = StaticInputs(sizes, pads, cache.device)
        dev = self.inputs.dev
        self.ids, self.positions = dev("ids").view(n, 1), dev("positions").view(n, 1)
        self.slot_mapping, self.state_slots = dev("slot_mapping"), dev("state_slots")
        self.tables = dev("tables").view(n, max_width)
        self.structure_ids = dev("structure").view(n, 1) if self.uses_structure else None
        self.ngram_context = dev("ngram").view(n, self.context_len) if self.context_len else None
        self.graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.buckets_used: set[tuple[int, int]] = set()
        self._pool = None

    # -- replay ----------------------------------------------------------------------------------
    def run(
        self,
        ids: list[int],
        positions: list[int],
        slot_mapping: list[int],
        state_slots: list[int],
        tables: list[list[int]],
        structure_ids: list[int] | None = None,
        ngram_context: list[list[int]] | None = None,
    ) -> torch.Tensor:
        """Next-token logits [B, V] for B rows (a view into the graph's output buffer, valid
        until the next call). ``structure_ids`` (one per row) and ``ngram_context`` (the
        row's previous tokens) are required exactly when the model reads them."""
        if (structure_ids is not None) != self.uses_structure:
            raise ValueError(f"structure ids {'missing' if self.uses_structure else 'given'} "
                             "for this model's decode graphs")
        if (ngram_context is not None) != bool(self.context_len):
            raise ValueError(f"n-gram context {'missing' if self.context_len else 'given'} "
                             "for this model's decode graphs")
        B, W = len(ids), max(len(t) for t in tables)
        if B > self.max_batch or W > self.max_width:
            raise ValueError(f"decode batch {B} x {W} blocks exceeds the captured maximum "
                             f"{self.max_batch} x {self.max_width}")
        b, w = bucket(self.batches, B), bucket(self.widths, W)
        graph, out = self._graph(b, w)  # capture first: it fills the buffers with padding
        self.buckets_used.add((b, w))
        self._stage(ids, positions, slot_mapping, state_slots, tables, structure_ids,
                    ngram_context)
        graph.replay()
        return out[:B]

    def _stage(self, ids, positions, slot_mapping, state_slots, tables, structure_ids=None,
               ngram_context=None) -> None:
        """Write the step's inputs (and padding everywhere else) to the device buffers."""
        inputs, n, B = self.inputs, self.max_batch, len(ids)
        inputs.pad()
        inputs.host("ids")[:B], inputs.host("positions")[:B] = ids, positions
        inputs.host("slot_mapping")[:B], inputs.host("state_slots")[:B] = slot_mapping, state_slots
        table_np = inputs.host("tables").reshape(n, self.max_width)
        for i, row in enumerate(tables):
            table_np[i, : len(row)] = row
        if structure_ids is not None:
            inputs.host("structure")[:B] = structure_ids
        if ngram_context is not None:
            inputs.host("ngram").reshape(n, self.context_len)[:B] = ngram_context
        inputs.upload()

    def _batch(self, b: int, w: int) -> PagedBatch:
        """The bucket's view of the static input buffers."""
        return PagedBatch(
            positions=self.positions[:b],
            slot_mapping=self.slot_mapping[:b],
            block_tables=self.tables[:b, :w],
            state_slots=self.state_slots[:b],
            structure_ids=None if self.structure_ids is None else self.structure_ids[:b],
            ngram_context=None if self.ngram_context is None else self.ngram_context[:b],
        )

    # -- capture ---------------------------------------------------------------------------------
    def capture_all(self) -> None:
        """Capture every bucket now (largest first, so smaller ones reuse its memory)."""
        for b in reversed(self.batches):
            for w in reversed(self.widths):
                self._graph(b, w)

    def _graph(self, b: int, w: int) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        if (b, w) not in self.graphs:
            self.graphs[(b, w)] = self._capture(b, w)
        return self.graphs[(b, w)]

    @torch.no_grad()
    def _capture(self, b: int, w: int) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        self.inputs.pad()  # warm-up and capture runs touch only the scratch block/slot
        self.inputs.upload(blocking=True)
        batch = self._batch(b, w)
        ids, layers = self.ids[:b], self.cache.layers
        graph, out, self._pool = capture_step(lambda: self.decode_fn(ids, layers, batch),
                                              self.cache.device, self._pool, self.capture)
        return graph, out


def capture_step(step: Callable[[], object], device: torch.device, pool, capture: bool = True
                 ) -> tuple[object, object, object]:
    """Capture ``step`` (a function of static buffers returning a tensor or a tuple of
    tensors) as a CUDA graph in memory pool ``pool`` (None: a new one) after two warm-up runs
    on a side stream -> (graph, its output, the pool). ``capture=False`` (the CPU stand-in)
    runs it once and returns an :class:`_EagerReplay` instead of a graph."""
    if not capture:
        out = step()
        return _EagerReplay(step, out), out, pool
    stream = torch.cuda.Stream(device=device)
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):  # allocator, cuBLAS and (if compiled) autotuning warm-up
            step()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        out = step()
    return graph, out, graph.pool()


class StaticInputs:
    """Named int64 inputs of captured graphs: one pinned host buffer, written field by field
    (numpy views), and its device copy, sent in one host-to-device copy per step; the graphs
    read fixed device addresses (:meth:`dev`). ``pads`` gives each field's padding value."""

    def __init__(self, sizes: dict[str, int], pads: dict[str, int], device: torch.device):
        self.offsets, start = {}, 0
        for name, size in sizes.items():
            self.offsets[name] = (start, start + size)
            start += size
        self.pads = pads
        self._host = torch.empty(start, dtype=torch.int64, pin_memory=device.type == "cuda")
        self._host_np = self._host.numpy()
        self._dev = torch.zeros(start, dtype=torch.int64, device=device)
        # the last host-to-device copy: a step whose replay samples nothing syncs nothing, so
        # the next staging waits for the copy before it overwrites the pinned buffer
        self._copied = torch.cuda.Event() if device.type == "cuda" else None

    def host(self, name: str):
        """The field's host view (numpy, 1-D)."""
        a, b = self.offsets[name]
        return self._host_np[a:b]

    def dev(self, name: str) -> torch.Tensor:
        """The field's device view (1-D)."""
        a, b = self.offsets[name]
        return self._dev[a:b]

    def pad(self) -> None:
        """Every host field to its padding value (after the last upload has read them)."""
        if self._copied is not None:
            self._copied.synchronize()
        for name, value in self.pads.items():
            self.host(name)[:] = value

    def upload(self, blocking: bool = False) -> None:
        self._dev.copy_(self._host, non_blocking=not blocking)
        if self._copied is not None:
            self._copied.record()


class _EagerReplay:
    """A stand-in for a captured graph (``capture=False``, e.g. on the CPU): ``replay()``
    reruns the step on the static buffers into the same output tensor(s), so the tests
    exercise the real runner's buffer handling and call order without CUDA."""

    def __init__(self, step: Callable[[], object], out: object) -> None:
        self.step, self.out = step, out

    def replay(self) -> None:
        new = self.step()
        if isinstance(self.out, torch.Tensor):
            self.out.copy_(new)
        else:
            for old, fresh in zip(self.out, new, strict=True):
                old.copy_(fresh)
