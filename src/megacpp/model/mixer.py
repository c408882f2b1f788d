"""The mixer contract: what every pattern letter's module implements.

A :class:`~megacpp.model.blocks.Block` is ``x + mixer(norm(x))``. The model, the serving
engine's paged step, the cost accounting (``megacpp model describe``) and the trainer reach
a mixer only through the members of :class:`Mixer`; nothing probes a mixer for attributes.

:class:`Mixer` is an abstract base class rather than a ``typing.Protocol``: a mixer inherits
it explicitly, a missing member fails when the mixer is built (not on first use), and the
members most mixers do not need (a state, a paged cache, an auxiliary loss) have one default
here. :class:`RecurrentMixer` adds the paged step of the fixed-state mixers (M, R).

Adding a mixer: one file with a ``Mixer`` subclass, one line in
:data:`megacpp.model.blocks.MIXERS` (docs/pattern.md, "Adding a mixer").
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch import Tensor, nn

from megacpp.kernels.runtime import resolve
from megacpp.model.cache import PagedView, gather_state, scatter_state

if TYPE_CHECKING:
    from megacpp.model.config import ModelConfig


class Mixer(nn.Module, ABC):
    """A sequence mixer ``[B, L, d_model] -> [B, L, d_model]`` (no pre-norm, no residual: the
    block adds those).

    Required: :meth:`from_config`, :meth:`forward`, :meth:`forward_paged`,
    :meth:`flops_per_token`. Defaults (override where they do not hold): one input copy, no
    paged cache, no recurrent state, no auxiliary loss, every parameter active, no residual
    output projection to scale at init."""

    #: How many places read the mixer's input: the block's norm hands it that many copies
    #: (``again`` holds the ones after the first), and a fused norm's backward kernel sums
    #: their gradients instead of autograd adding them in a kernel of its own.
    INPUT_FANOUT: ClassVar[int] = 1

    #: The auxiliary loss of the last training forward (MoE balance, DSA indexer KL), or None.
    aux_loss: Tensor | None = None

    @classmethod
    @abstractmethod
    def from_config(cls, cfg: ModelConfig) -> Mixer:
        """The mixer a pattern letter builds from the model config."""

    @abstractmethod
    def forward(
        self, x: Tensor, doc_ids: Tensor | None = None, again: tuple[Tensor, ...] = ()
    ) -> Tensor:
        """Whole rows from position 0 (training, the full forward): x [B, L, D] -> [B, L, D].

        ``doc_ids`` [B, L]: per-token document index of packed rows; no token sees another
        document. ``again``: ``INPUT_FANOUT - 1`` more tensors with x's values."""

    @abstractmethod
    def forward_paged(
        self, x: Tensor, cache: PagedView, again: tuple[Tensor, ...] = ()
    ) -> Tensor:
        """The serving engine's forward: rows at their own positions (``cache.batch``) through
        this layer's pool (``cache.pool``: what :meth:`paged_layout` or :meth:`init_cache`
        made; None for a mixer that keeps neither). x [B, L, D] -> [B, L, D]. Runs inside the
        compiled, CUDA-graph-captured decode step: no host syncs, no data-dependent Python."""

    @abstractmethod
    def flops_per_token(self, seq_len: int) -> int:
        """Forward matmul FLOPs per token at ``seq_len`` (2*m*n*k per matmul)."""

    def paged_layout(self) -> dict[str, tuple[int, ...]] | None:
        """Per-token entries of a paged cache (attention: name -> feature shape), or None."""
        return None

    def cache_bytes_per_token(self, dtype: torch.dtype = torch.bfloat16) -> int:
        """Bytes the paged cache holds per token in ``dtype``."""
        return 0

    def init_cache(
        self, batch_size: int, device: torch.device | str | None = None,
        dtype: torch.dtype = torch.float32,
    ) -> Any:
        """A fixed-size recurrent state for ``batch_size`` sequences (the engine's state pool
        has one row per slot), or None for a mixer without one."""
        return None

    def state_bytes(self, batch: int = 1, dtype: torch.dtype = torch.float32) -> int:
        """Bytes of :meth:`init_cache`'s state for ``batch`` sequences."""
        return 0

    def inactive_params(self) -> int:
        """Parameters a token does not visit (the MoE's unchosen experts)."""
        return 0

    def residual_projections(self) -> list[Tensor]:
        """The weights that write the mixer's output into the residual stream, initialised
        with the GPT-2 scaled std (``HybridLM._init_weights``), in init order."""
        return []

    def direct_weight_linears(self) -> tuple[str, ...]:
        """Names of child ``nn.Linear`` layers whose weight the mixer multiplies itself
        (``F.linear`` on the weight, a slice of it, or a concatenation), not by calling the
        layer: a swap of the layer for another implementation (FP8 training) would not reach
        those products, so the swap leaves these layers as they are."""
        return ()

    def row_sliced_linears(self) -> tuple[str, ...]:
        """Names of child ``nn.Linear`` layers whose product the mixer computes in row slices
        of the weight, each through
        :func:`megacpp.kernels.ops.float8_linear.torchao_float8.linear_rows` (which takes the
        layer's own GEMM for a slice: float8 for slices of 16-multiple rows once the layer is
        torchao's Float8Linear). Their whole output dim need not be a multiple of 16."""
        return ()


class RecurrentMixer(Mixer):
    """A mixer with a fixed-size recurrent state (M, R): one token at a time through
    :meth:`step`, longer inputs through ``forward(..., cache=state)`` continuing the state."""

    @abstractmethod
    def forward(
        self, x: Tensor, doc_ids: Tensor | None = None, again: tuple[Tensor, ...] = (),
        cache: Any = None, fresh: bool = False, last_index: Tensor | None = None,
        continues: bool = False,
    ) -> Tensor:
        """:meth:`Mixer.forward`; with ``cache`` (an :meth:`init_cache` state), continue from
        it and write the final state back (prefill). ``fresh``: start from the empty state
        whatever ``cache`` holds (only the final state is written). ``last_index`` [B]: each
        row's last real token; the tokens after it are right padding, and the state written
        back is the one after the last real token. ``continues``: read ``cache`` as the state
        to continue without checking it for zeros (no host sync)."""

    @abstractmethod
    def step(self, x: Tensor, cache: Any) -> Tensor:
        """One recurrent decode step: x [B, 1, D] -> [B, 1, D]; updates ``cache``."""

    @abstractmethod
    def init_cache(
        self, batch_size: int, device: torch.device | str | None = None,
        dtype: torch.dtype = torch.float32,
    ) -> Any: ...

    @abstractmethod
    def state_bytes(self, batch: int = 1, dtype: torch.dtype = torch.float32) -> int: ...

    #: The catalog surface of a fused decode step (None: the mixer has only its own step).
    STEP_SURFACE: ClassVar[str | None] = None

    def _chosen_step(self, x: Tensor) -> Callable[..., Tensor] | None:
        """The catalog's ``STEP_SURFACE`` backend for ``x`` where one other than the reference
        is chosen (the fused kernel on CUDA), else None. Under torch.compile the reference
        step runs, for inductor to fuse (a catalog backend is a graph break there)."""
        if self.STEP_SURFACE is None or torch.compiler.is_compiling():
            return None
        backend = resolve(self.STEP_SURFACE, x)
        return None if backend.role == "fallback" else backend.fn

    def _fused_step(self, step: Callable[..., Tensor], x: Tensor, pool: Any,
                    slots: Tensor) -> Tensor:
        """x [B, 1, D] -> [B, 1, D] through ``step`` (a ``STEP_SURFACE`` backend), advancing
        rows ``slots`` of the state ``pool`` in place."""
        raise NotImplementedError(f"{type(self).__name__} has no fused decode step")

    def forward_paged(
        self, x: Tensor, cache: PagedView, again: tuple[Tensor, ...] = ()
    ) -> Tensor:
        """The rows' slots (``cache.batch.state_slots``) gathered from the state pool, advanced
        (one token: :meth:`step`; more: the chunked forward from the state, i.e. chunked
        prefill) and scattered back. Padding before a row's tokens is a document of its own
        (``batch.doc_ids``); padding after them (``batch.last_index``) leaves the state as the
        last real token left it: padding never reaches the state. A decode step (one token
        per row, no reset) whose ``STEP_SURFACE`` backend is chosen runs it on the pool rows
        in place instead (no gather / scatter)."""
        batch = cache.batch
        slots = batch.state_slots
        decode = x.shape[1] == 1 and batch.doc_ids is None and not batch.fresh
        fused = self._chosen_step(x) if decode else None
        if fused is not None:
            return self._fused_step(fused, x, cache.pool, slots)
        state = gather_state(cache.pool, slots)
        if decode:
            out = self.step(x, state)
        else:
            out = self.forward(x, doc_ids=batch.doc_ids, again=again, cache=state,
                               fresh=batch.fresh, last_index=batch.last_index,
                               continues=batch.continues)
        scatter_state(cache.pool, slots, state)
        return out
