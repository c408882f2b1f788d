"""AdamW plus Muon, and which parameter gets which.

Grouping (:func:`group_parameters`):

* **Muon** -- the hidden weight matrices: the weight of every ``nn.Linear`` inside the blocks
  (attention q/kv/out, Mamba/gated-delta in/out projections, SwiGLU and shared-expert
  projections) except the MoE router and modules marked ``_no_muon`` (LoRA adapters), plus the
  MoE's 3-D expert weights ``w_in`` [E, 2F, D] and ``out_proj`` [E, D, F], orthogonalized per
  expert (batched).
* **AdamW with weight decay** -- the embeddings (token, structure-id, hashed n-gram) / LM
  head, the MoE router, other >= 2-D weights (the gated-delta short-conv kernel, LoRA
  adapters).
* **AdamW without weight decay** -- norms, biases (including Mamba's ``B_bias``/``C_bias``
  and ``dt_bias``), and parameters the mixers mark ``_no_weight_decay`` (``A_log``, ``D``...).

Muon (Jordan et al., 2024): momentum on the gradient, then the update is replaced by its
orthogonalization ``U V^T`` (approximated by 5 quintic Newton-Schulz iterations).

lr scaling: the orthogonalized update has RMS ~ 1/sqrt(max(rows, cols)); it is multiplied by
``0.2 * sqrt(max(rows, cols))`` so its RMS matches a typical AdamW update (~0.2), as in
Moonlight (Liu et al., 2025). Muon therefore shares AdamW's lr, schedule and decoupled
weight decay (``p *= 1 - lr * wd``): ``optim.lr`` is the one knob.

Sharded parameters (FSDP2 DTensors): the momentum lives on the local shard; the updates of
all matrices of one shape are all-gathered in one collective (each rank's rows padded to the
shard size), orthogonalized in full and batched on every rank (the same inputs give the same
result everywhere), and each rank keeps its own rows. 3-D expert weights sharded on the
expert dimension hold whole experts, so they are orthogonalized locally.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from megacpp.kernels.ops.muon_apply.reference import muon_apply_reference
from megacpp.kernels.ops.muon_momentum.reference import muon_momentum_reference
from megacpp.kernels.ops.muon_polynomial.reference import NS_COEFFS
from megacpp.kernels.runtime import resolve
from megacpp.model.moe import MoE
from megacpp.train.config import OptimSection

MUON_RMS = 0.2


def newton_schulz(update: torch.Tensor, steps: int = 5, dtype: torch.dtype = torch.float32,
                  eps: float = 1e-7) -> torch.Tensor:
    """Approximate ``U V^T`` of each matrix in ``update`` [..., m, n] (batched over leading
    dims), computed in ``dtype``; returns a tensor of ``update``'s dtype.

    Each iteration is ``A = X X^T; P = a I + b A + c A A; X = P X``. The two outer products
    are batched cuBLAS GEMMs. P comes from the catalog's ``muon_polynomial`` surface:
    * the reference is cuBLAS's ``baddbmm``, with ``b A`` in the GEMM's epilogue, then ``a``
      added to the diagonal;
    * on an H100 the Triton backend computes only P's tiles on and above the diagonal (P is
      symmetric) in one launch.
    X's normalization is folded into the first P (from the trace of X X^T), so no
    elementwise pass runs over X. Op by op (``a * X + (b * A + c * (A @ A)) @ X``) those
    passes had cost about as much as the products at the trainer's sizes; with ``a X`` as the
    last GEMM's epilogue too, torch first copies X into the output
    In bfloat16 the error against the float64 iteration
    is that of the op-by-op form (~3% on the CPU)."""
    if steps < 1:
        raise ValueError(f"newton_schulz: steps must be >= 1, got {steps}")
    a, b, c = NS_COEFFS
    x = update.to(dtype)
    transposed = x.shape[-2] > x.shape[-1]
    if transposed:
        x = x.mT  # iterate on the wide orientation: X X^T is the smaller Gram matrix
    shape = x.shape
    x = x.reshape(-1, *shape[-2:])  # [batch, m, n]: the batched GEMMs take exactly 3-D
    polynomial = resolve("muon_polynomial", x).fn
    for i in range(steps):
        # the first step normalizes X (spectral norm <= Frobenius <= 1) inside P, from the
        # Gram matrix's trace: P = s p(s^2 X X^T) with s = 1 / (||X||_F + eps)
        poly = polynomial(torch.bmm(x, x.mT), a, b, c, eps if i == 0 else None)
        if transposed and i == steps - 1:
            # the last product in the input's orientation: (P X)^T = X^T P (P is symmetric),
            # so the result comes out contiguous, as the fused update pass reads it
            return torch.bmm(x.mT, poly).reshape(shape[:-2] + shape[-2:][::-1]).to(update.dtype)
        x = torch.bmm(poly, x)
    x = x.reshape(shape)
    if transposed:
        x = x.mT
    return x.to(update.dtype)


def muon_scale(shape: torch.Size) -> float:
    """Update multiplier that matches AdamW's update RMS (see the module docstring)."""
    return MUON_RMS * math.sqrt(max(shape[-2], shape[-1]))


class Muon(torch.optim.Optimizer):
    """Momentum + Newton-Schulz orthogonalization for 2-D (and batched 3-D) weights.

    Per param group: ``lr``, ``weight_decay`` (decoupled), ``momentum``, ``nesterov``,
    ``ns_steps``, ``ns_dtype`` (a torch dtype name: "bfloat16" on GPU is the usual choice,
    "float32" on CPU; a string, so the group stays plain data in checkpoints).
    """

    def __init__(self, params: Iterable[nn.Parameter] | Iterable[dict], lr: float = 0.02,
                 weight_decay: float = 0.0, momentum: float = 0.95, nesterov: bool = True,
                 ns_steps: int = 5, ns_dtype: str = "float32") -> None:
        defaults = {"lr": lr, "weight_decay": weight_decay, "momentum": momentum,
                    "nesterov": nesterov, "ns_steps": ns_steps, "ns_dtype": ns_dtype}
        super().__init__(params, defaults)
        # pinned address tables of the fused passes, per batch (a CUDA graph that captured
        # their copies reads them again at every replay)
        self.tables: dict[int, list[torch.Tensor]] = {}
        for group in self.param_groups:
            for p in group["params"]:
                if p.ndim not in (2, 3):
                    raise ValueError(f"Muon takes 2-D or 3-D weights, got shape {tuple(p.shape)}")

    @torch.no_grad()
    def step(self, closure=None, grad_scale: torch.Tensor | None = None):
        """One step. ``grad_scale`` (one float32 element on the parameters' device, e.g. the
        clipping coefficient): the gradients are taken times it, by the momentum pass, and
        are not rewritten; local (non-DTensor) parameters only."""
        if grad_scale is not None and not self.takes_grad_scale:
            raise ValueError("Muon.step: grad_scale is taken for local parameters only; scale "
                             "a sharded model's gradients first")
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            live = [p for p in group["params"] if p.grad is not None]
            rows_sharded = [p for p in live if _row_sharded(p)]
            for batch in _same_shape_batches(rows_sharded):  # FSDP2 matrices: one gather each
                self._update_sharded_batch(batch, group)
            for p in live:
                if isinstance(p, DTensor) and not _row_sharded(p):  # e.g. experts: whole ones
                    self._update(p, group)
            for batch in _same_shape_batches([p for p in live if not isinstance(p, DTensor)]):
                self._update_batch(batch, group, grad_scale)
        return loss

    @property
    def takes_grad_scale(self) -> bool:
        """Whether :meth:`step` takes a ``grad_scale``: no parameter is sharded (DTensor)."""
        return not any(isinstance(p, DTensor) for group in self.param_groups
                       for p in group["params"])

    def _bufs(self, params: list[torch.Tensor]) -> list[torch.Tensor]:
        """The momentum buffers of ``params`` (zeros, made on first use)."""
        bufs = []
        for p in params:
            state = self.state[p]
            if "momentum_buffer" not in state:
                state["momentum_buffer"] = torch.zeros_like(p)
            bufs.append(state["momentum_buffer"])
        return bufs

    def _update(self, p: torch.Tensor, group: dict) -> None:
        if isinstance(p, DTensor) and p.ndim == 3 and tuple(p.placements) == (Shard(0),):
            # experts sharded whole (FSDP2, dim 0): every step on the local experts
            (buf,) = self._bufs([p])
            (update,) = muon_momentum_reference([buf.to_local()], [p.grad.to_local()],
                                                group["momentum"], group["nesterov"])
            ortho = newton_schulz(update, group["ns_steps"], getattr(torch, group["ns_dtype"]))
            muon_apply_reference([p.to_local()], [ortho], group["lr"], group["weight_decay"],
                                 muon_scale(p.shape))
            return
        (update,) = muon_momentum_reference(self._bufs([p]), [p.grad], group["momentum"],
                                            group["nesterov"])
        ortho = _orthogonalize(update, group["ns_steps"], getattr(torch, group["ns_dtype"]))
        muon_apply_reference([p], [ortho], group["lr"], group["weight_decay"],
                             muon_scale(p.shape))

    def _update_sharded_batch(self, params: list[DTensor], group: dict) -> None:
        """Row-sharded matrices of one shape (FSDP2's dim-0 shards): momentum on the local rows,
        the updates all-gathered in one collective, one batched Newton-Schulz over the full
        matrices, and each rank applies its own rows -- what :meth:`_update_batch` computes
        for the unsharded matrices, with one gather instead of one per matrix."""
        mesh = params[0].device_mesh
        world, rank = mesh.size(), mesh.get_local_rank()
        rows, cols = params[0].shape
        chunk = -(-rows // world)  # torch.chunk's shard rows (the last ranks may hold fewer)
        start = min(rank * chunk, rows)
        local_rows = min(chunk, rows - start)
        dtype = getattr(torch, group["ns_dtype"])
        grads = [p.grad.to_local() for p in params]
        bufs = [b.to_local() for b in self._bufs(params)]
        if any(g.shape != (local_rows, cols) for g in grads):  # not torch.chunk's layout
            for p in params:
                self._update(p, group)
            return
        updates = muon_momentum_reference(bufs, grads, group["momentum"], group["nesterov"])
        padded = grads[0].new_zeros((len(params), chunk, cols), dtype=dtype)  # [k, chunk, n]
        for i, update in enumerate(updates):
            padded[i, :local_rows].copy_(update)
        gathered = padded.new_empty((world * len(params), chunk, cols))  # ranks' blocks
        dist.all_gather_into_tensor(gathered, padded, group=mesh.get_group())
        full = (gathered.view(world, len(params), chunk, cols).transpose(0, 1)
                .reshape(len(params), world * chunk, cols)[:, :rows])  # [k, rows, n]
        ortho = newton_schulz(full, group["ns_steps"], dtype)  # [k, rows, n]
        if local_rows:
            mine = ortho[:, start: start + local_rows]
            muon_apply_reference([p.to_local() for p in params], mine, group["lr"],
                                 group["weight_decay"], muon_scale(params[0].shape))

    def _update_batch(self, params: list[torch.Tensor], group: dict,
                      grad_scale: torch.Tensor | None = None) -> None:
        """Parameters of one matrix shape: one batched Newton-Schulz over all their matrices
        (each normalized and iterated on its own, as :func:`newton_schulz` does per matrix)
        instead of one small launch sequence per parameter. The momentum pass writes the
        updates stacked, straight into the iteration's dtype; the weight update reads the
        stacked result (the catalog's ``muon_momentum`` / ``muon_apply`` backends: the
        foreach reference, or one fused launch each)."""
        rows, cols = params[0].shape[-2:]
        dtype = getattr(torch, group["ns_dtype"])
        stacked = params[0].new_empty((sum(p.numel() for p in params) // (rows * cols), rows,
                                       cols), dtype=dtype)
        grads = [p.grad for p in params]
        momentum, apply = resolve("muon_momentum", grads[0]), resolve("muon_apply", params[0])
        keep = self.tables.setdefault(id(params[0]), [])  # a captured graph re-reads them
        if not (params[0].is_cuda and torch.cuda.is_current_stream_capturing()):
            # (not inside a capture: freeing pinned memory there records the host allocator's
            # events on the capturing stream, and its next allocation or .item() then fails
            # with "invalid argument" on an H100)
            keep.clear()
        momentum.fn(self._bufs(params), grads, group["momentum"], group["nesterov"], stacked,
                    keep, grad_scale)
        ortho = newton_schulz(stacked, group["ns_steps"], dtype)
        apply.fn(params, ortho, group["lr"], group["weight_decay"], muon_scale(params[0].shape),
                 keep)


MUON_BATCH_ELEMENTS = 1 << 27  # at most this many elements per batched Newton-Schulz


def _same_shape_batches(params: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    """``params`` grouped by (matrix shape, dtype, device), in first-seen order, each group cut
    into batches of at most :data:`MUON_BATCH_ELEMENTS` elements (a larger parameter alone)."""
    groups: dict[tuple, list[torch.Tensor]] = {}
    for p in params:
        groups.setdefault((tuple(p.shape[-2:]), p.dtype, p.device), []).append(p)
    batches = []
    for group in groups.values():
        batch, size = [], 0
        for p in group:
            if batch and size + p.numel() > MUON_BATCH_ELEMENTS:
                batches.append(batch)
                batch, size = [], 0
            batch.append(p)
            size += p.numel()
        batches.append(batch)
    return batches


def _row_sharded(p: torch.Tensor) -> bool:
    """A matrix sharded by rows over a 1-D mesh (FSDP2's layout of a 2-D weight)."""
    return (isinstance(p, DTensor) and p.ndim == 2 and p.device_mesh.ndim == 1
            and tuple(p.placements) == (Shard(0),))


def _orthogonalize(update: torch.Tensor, steps: int, dtype: torch.dtype) -> torch.Tensor:
    if not isinstance(update, DTensor):
        return newton_schulz(update, steps, dtype)
    if update.ndim == 3 and tuple(update.placements) == (Shard(0),):
        local = newton_schulz(update.to_local(), steps, dtype)  # whole experts per shard
        return DTensor.from_local(local, update.device_mesh, update.placements,
                                  shape=update.shape, stride=update.stride())
    full = newton_schulz(update.full_tensor(), steps, dtype)
    return distribute_tensor(full, update.device_mesh, update.placements, src_data_rank=None)


# -- grouping -------------------------------------------------------------------------------------
@dataclass
class ParamGroups:
    """Names and parameters of each optimizer group (names are the model's FQNs)."""

    muon: list[tuple[str, nn.Parameter]]
    adamw_decay: list[tuple[str, nn.Parameter]]
    adamw_no_decay: list[tuple[str, nn.Parameter]]


def group_parameters(model: nn.Module, use_muon: bool = True) -> ParamGroups:
    """Assign every trainable parameter of ``model`` (a HybridLM, possibly wrapped) to one group."""
    muon_ids = _muon_param_ids(model) if use_muon else set()
    groups = ParamGroups([], [], [])
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        if id(p) in muon_ids:
            groups.muon.append((name, p))
        elif _no_weight_decay(name, p):
            groups.adamw_no_decay.append((name, p))
        else:
            groups.adamw_decay.append((name, p))
    return groups


def _muon_param_ids(model: nn.Module) -> set[int]:
    blocks = getattr(model, "blocks", None)
    if blocks is None:
        raise ValueError("group_parameters expects a HybridLM (a module with .blocks)")
    routers = {id(m.router) for m in blocks.modules() if isinstance(m, MoE)}
    ids = set()
    for module in blocks.modules():
        if (isinstance(module, nn.Linear) and id(module) not in routers
                and not getattr(module, "_no_muon", False)):
            ids.add(id(module.weight))
        if isinstance(module, MoE):
            ids.update((id(module.w_in), id(module.out_proj)))
    return ids


def _no_weight_decay(name: str, p: nn.Parameter) -> bool:
    leaf = name.rsplit(".", 1)[-1]
    return getattr(p, "_no_weight_decay", False) or p.ndim < 2 or leaf.endswith("bias")


# -- the pair of optimizers -----------------------------------------------------------------------
class Optimizers:
    """AdamW (+ Muon): one ``step``/``zero_grad``/``set_lr`` for both.

    ``capturable``: AdamW keeps its step count on the device, so its step can be captured in
    a CUDA graph (:mod:`megacpp.train.graphs`)."""

    def __init__(self, model: nn.Module, cfg: OptimSection, device: torch.device,
                 capturable: bool = False) -> None:
        self.groups = group_parameters(model, cfg.muon)
        self.lr_tensor: torch.Tensor | None = None  # what a captured step reads (device_lr)
        g = self.groups
        adamw_groups = [
            {"params": [p for _, p in g.adamw_decay], "weight_decay": cfg.weight_decay},
            {"params": [p for _, p in g.adamw_no_decay], "weight_decay": 0.0},
        ]
        adamw_groups = [group for group in adamw_groups if group["params"]]
        self.adamw = torch.optim.AdamW(
            adamw_groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps,
            fused=device.type == "cuda", capturable=capturable,
        ) if adamw_groups else None  # None: every trainable parameter is Muon's (fine-tuning)
        self.muon = Muon(
            [p for _, p in g.muon], lr=cfg.lr, weight_decay=cfg.weight_decay,
            momentum=cfg.muon_momentum, nesterov=cfg.muon_nesterov, ns_steps=cfg.muon_ns_steps,
            ns_dtype="bfloat16" if device.type == "cuda" else "float32",
        ) if g.muon else None

    def __iter__(self) -> Iterator[torch.optim.Optimizer]:
        if self.adamw is not None:
            yield self.adamw
        if self.muon is not None:
            yield self.muon

    def set_lr(self, lr: float) -> None:
        for opt in self:
            for group in opt.param_groups:
                group["lr"] = lr
        if self.lr_tensor is not None:
            self.lr_tensor.fill_(lr)

    @contextlib.contextmanager
    def device_lr(self, device: torch.device) -> Iterator[None]:
        """Within: every group's lr is one device tensor (``lr_tensor``, created on first use
        and kept current by :meth:`set_lr` from then on), so a step captured in a CUDA graph
        reads the learning rate from device memory instead of baking in the current value.
        After: the groups hold Python floats again, as checkpoints store them."""
        floats = [[group["lr"] for group in opt.param_groups] for opt in self]
        if self.lr_tensor is None:
            self.lr_tensor = torch.tensor(float(floats[0][0]), device=device)
        try:
            for opt in self:
                for group in opt.param_groups:
                    group["lr"] = self.lr_tensor
            yield
        finally:
            for opt, values in zip(self, floats, strict=True):
                for group, value in zip(opt.param_groups, values, strict=True):
                    group["lr"] = value

    @property
    def muon_takes_grad_scale(self) -> bool:
        """Whether :meth:`step` can hand Muon a gradient multiplier (there are Muon parameters
        and none is sharded)."""
        return self.muon is not None and self.muon.takes_grad_scale

    def step(self, muon_grad_scale: torch.Tensor | None = None) -> None:
        """Step both; ``muon_grad_scale``: Muon takes its gradients times it (see
        :meth:`Muon.step`; only where :attr:`muon_takes_grad_scale`)."""
        if self.adamw is not None:
            self.adamw.step()
        if self.muon is not None:
            self.muon.step(grad_scale=muon_grad_scale)
        elif muon_grad_scale is not None:
            raise ValueError("Optimizers.step: a Muon gradient scale without Muon parameters")

    def zero_grad(self) -> None:
        for opt in self:
            opt.zero_grad(set_to_none=True)

    def summary(self) -> dict[str, int]:
        """Parameter counts per group (for the run log and receipt)."""
        g = self.groups
        return {
            "muon_params": sum(p.numel() for _, p in g.muon),
            "adamw_decay_params": sum(p.numel() for _, p in g.adamw_decay),
            "adamw_no_decay_params": sum(p.numel() for _, p in g.adamw_no_decay),
        }
