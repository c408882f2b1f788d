"""Parallelism applied to the plain model from outside (the model file never changes).

:func:`init_distributed` reads torchrun's environment (``RANK``, ``WORLD_SIZE``,
``LOCAL_RANK``) and starts the process group; :func:`parallelize` then applies, in order:

0. FP8 linear layers (``parallel.float8``): qualifying ``nn.Linear`` layers swapped for
   torchao's Float8Linear (:mod:`megacpp.train.float8`), before anything wraps them;
1. activation checkpointing per block letter (``parallel.activation_checkpointing = "ME"``
   recomputes every M and E block in backward and keeps the others' activations);
2. regional ``torch.compile``: each block compiled in place (parameter names unchanged);
3. data parallelism: DDP -- torch's DistributedDataParallel, or (``grad_sync = "flat"``, the
   graphed step's) the plain model with its gradients in one flat buffer that
   :class:`FlatGradReducer` sums in buckets during backward -- or FSDP2 (``fully_shard`` on every
   block, then the root).

Parameter names stay the plain model's FQNs for checkpoints (torch.distributed.checkpoint's
state-dict helpers drop the wrapper prefixes), so a checkpoint written under one strategy
loads under another.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import functools
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    CheckpointImpl,
    checkpoint_wrapper,
)
from torch.nn.parallel import DistributedDataParallel

from megacpp.errors import ConfigError
from megacpp.train.config import ParallelSection
from megacpp.train.float8 import Float8Report, apply_float8

# Prefixes wrappers add to parameter names (checkpoint_wrapper, DDP, torch.compile).
_WRAPPER_PARTS = ("_checkpoint_wrapped_module", "module", "_orig_mod")


@dataclass(frozen=True)
class DistEnv:
    """Where this process runs: its rank among ``world_size`` and its device."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    strategy: str  # single | ddp | fsdp

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


def init_distributed(cfg: ParallelSection, device: str = "auto") -> DistEnv:
    """Pick the device and strategy; start the process group under torchrun (a collective
    that waits longer than ``parallel.timeout_s`` fails instead of hanging)."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    use_cuda = _use_cuda(device)
    torch_device = torch.device("cuda", local_rank) if use_cuda else torch.device("cpu")
    strategy = _strategy(cfg.strategy, world_size)
    if world_size > 1:
        backend = ("nccl" if use_cuda else "gloo") if cfg.backend == "auto" else cfg.backend
        if backend == "nccl" and not use_cuda:
            raise ConfigError("parallel.backend = \"nccl\" needs CUDA devices; use gloo on CPU")
        if use_cuda:
            torch.cuda.set_device(torch_device)
        if not dist.is_initialized():
            dist.init_process_group(backend, timeout=dt.timedelta(seconds=cfg.timeout_s))
    return DistEnv(rank, world_size, local_rank, torch_device, strategy)


def shutdown_distributed() -> None:
    """Leave the process group together: a rank that tears its connections down while a peer
    is still in its last collective made that peer abort at exit (gloo: "terminate called
    without an active exception", seen in the two-process FSDP2 tests)."""
    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def _use_cuda(device: str) -> bool:
    if device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("run.device = \"cuda\" but no CUDA device is available "
                          "(use \"cpu\" or \"auto\")")
    return device == "cuda" or (device == "auto" and torch.cuda.is_available())


def _strategy(strategy: str, world_size: int) -> str:
    if strategy == "auto":
        return "ddp" if world_size > 1 else "single"
    if strategy == "single" and world_size > 1:
        raise ConfigError(f"parallel.strategy = \"single\" but {world_size} processes were "
                          "launched; use ddp or fsdp (or launch one process)")
    return strategy


# -- applying parallelism ----------------------------------------------------------------------
def parallelize(model: nn.Module, cfg: ParallelSection, env: DistEnv, *, compile: bool,
                grad_sync: str | None,
                on_float8: Callable[[Float8Report], None] | None = None) -> nn.Module:
    """FP8 layers, activation checkpointing, compile and DDP/FSDP2 applied to a HybridLM on
    ``env.device``.

    ``compile`` and ``grad_sync`` come from the run's :class:`~megacpp.train.modes.ExecutionPlan`
    (``grad_sync``: "ddp" wraps the model in DistributedDataParallel; "flat" leaves it plain
    for :class:`FlatGradReducer`, after making every rank's weights rank 0's, as DDP does).
    ``on_float8`` receives the FP8 lane's report (which layers converted, which stayed bf16
    and why) when ``parallel.float8`` is on. Returns the module to call for training (the DDP
    wrapper, or ``model`` itself, sharded in place, for FSDP2 and single-process runs).
    """
    if cfg.float8 != "off":
        report = apply_float8(model, cfg.float8, min_dim=cfg.float8_min_dim,
                              fsdp_float8_all_gather=cfg.float8_fsdp_all_gather)
        if on_float8 is not None:
            on_float8(report)
    apply_activation_checkpointing(model, cfg.activation_checkpointing)
    if compile:
        compile_blocks(model)
    if env.strategy == "ddp" and env.distributed:
        if grad_sync == "flat":
            broadcast_module_state(model)
            return model
        # broadcast_buffers=False: each rank keeps its own MoE load counters until the
        # trainer all-reduces them; the expert bias stays identical because every rank
        # applies the same all-reduced update.
        device_ids = [env.device.index] if env.device.type == "cuda" else None
        hook_state = None
        ddp = DistributedDataParallel(model, device_ids=device_ids, broadcast_buffers=False,
                                      bucket_cap_mb=cfg.bucket_mb)
        if cfg.reduce_dtype == "bf16":
            from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import (
                bf16_compress_hook,
            )

            ddp.register_comm_hook(hook_state, bf16_compress_hook)
        return ddp
    if env.strategy == "fsdp":
        apply_fsdp(model, env, reshard_after_forward=cfg.reshard_after_forward,
                   reduce_dtype=cfg.reduce_dtype)
    return model


def broadcast_module_state(model: nn.Module) -> None:
    """Every rank's parameters and buffers become rank 0's (what DDP does at construction)."""
    if not (dist.is_available() and dist.is_initialized()):
        return
    with torch.no_grad():
        for tensor in [*model.parameters(), *model.buffers()]:
            dist.broadcast(tensor.data, src=0)


# compiled variants of one block kind: grad on (training) and off (validation, no_grad), each
# with and without the previous block's pending output (the first block has none)
_VARIANTS_PER_KIND = 4


def compile_blocks(model: nn.Module, backend: str = "inductor") -> None:
    """Regional compile: each block compiled in place (``block.compile``).

    All blocks run one code object (``Block.forward``, and ``RMSNorm._norm`` under it), and
    Dynamo counts its compiled variants against ``recompile_limit`` (default 8) across every
    block: each mixer type, the first block (no pending add) and grad mode off in validation
    each make one. A hybrid of four kinds needs ~10, so the final validation of a default
    run went past the limit and ran those blocks eager, with a warning (nam56r-350m on an
    H100). The limit is raised to what the model's kinds need."""
    kinds = {(type(block.mixer), block.letter) for block in _unwrapped_blocks(model)}
    config = torch._dynamo.config
    config.recompile_limit = max(config.recompile_limit, _VARIANTS_PER_KIND * (len(kinds) + 1))
    for block in model.blocks:
        block.compile(backend=backend)


def _unwrapped_blocks(model: nn.Module) -> Iterator[nn.Module]:
    for block in model.blocks:
        yield getattr(block, "_checkpoint_wrapped_module", block)


def apply_activation_checkpointing(model: nn.Module, letters: str) -> None:
    """Wrap every block whose family letter is in ``letters`` for recompute-in-backward."""
    for i, block in enumerate(model.blocks):
        if block.family in letters:
            model.blocks[i] = checkpoint_wrapper(block, checkpoint_impl=CheckpointImpl.NO_REENTRANT)


def apply_fsdp(model: nn.Module, env: DistEnv, reshard_after_forward: bool = True,
               reduce_dtype: str = "fp32") -> None:
    """FSDP2: shard each block's parameters (dim 0) across the ranks, then the root's.

    ``reshard_after_forward`` frees a block's gathered weights after its forward (gathered
    again in backward); the root keeps its own (FSDP2 never reshards the root after forward).
    ``reduce_dtype = "bf16"`` reduce-scatters gradients in bfloat16 (fp32 by default)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = init_device_mesh(env.device.type, (env.world_size,))
    policy = MixedPrecisionPolicy(reduce_dtype=torch.bfloat16 if reduce_dtype == "bf16" else None)
    for block in model.blocks:
        fully_shard(block, mesh=mesh, reshard_after_forward=reshard_after_forward,
                    mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)


def base_model(model: nn.Module) -> nn.Module:
    """The HybridLM under a DDP wrapper (FSDP2 and single runs return ``model``)."""
    return model.module if isinstance(model, DistributedDataParallel) else model


@contextlib.contextmanager
def gradient_sync(model: nn.Module, enabled: bool) -> Iterator[None]:
    """Skip the gradient all-reduce/reduce-scatter on non-final micro-steps."""
    if enabled:
        yield
    elif isinstance(model, DistributedDataParallel):
        with model.no_sync():
            yield
    elif hasattr(model, "set_requires_gradient_sync"):  # FSDP2
        model.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            model.set_requires_gradient_sync(True)
    else:
        yield


class FlatGradReducer:
    """The gradients of a replicated model as views into one flat buffer, summed across the
    ranks in buckets that start while backward still runs (DDP's overlap, without DDP).

    Written for the graphed DDP step. The views are bound once and stay: a CUDA graph's
    backward accumulates into them and its collectives read the buffer. The buffer is laid
    out in reverse model order (roughly the order backward finishes gradients) and cut into
    buckets of ``bucket_bytes``; in the step's last backward, each parameter's
    post-accumulate hook counts down its bucket, and a bucket whose gradients are all in is
    all-reduced (asynchronously) as soon as every bucket before it was -- the same order on
    every rank, so a graph captures the same collectives everywhere. :meth:`reduce` starts
    what is left and waits for all. The gradients are *summed*: the trainer's objective is
    scaled for a sum (no 1/N pass over the buffer). ``reduce_dtype`` bf16 sums a bfloat16 copy
    of each bucket (half the bytes, coarser sums); float32 by default.

    Hand-written rather than DistributedDataParallel because DDP's reducer does host work every
    step (bucket rebuilds, sampled timing with events) that a capture cannot contain."""

    def __init__(self, params: list[nn.Parameter], world_size: int, reduce_dtype: str = "fp32",
                 bucket_bytes: int = 25 << 20) -> None:
        self.params = [p for p in params if p.requires_grad]
        dtypes = {p.dtype for p in self.params}
        if len(dtypes) != 1:
            raise ConfigError(f"parallel.grad_sync = \"flat\" needs parameters of one dtype, got "
                              f"{sorted(str(d) for d in dtypes)}")
        numel = sum(p.numel() for p in self.params)
        self.flat = torch.zeros(numel, dtype=self.params[0].dtype, device=self.params[0].device)
        self.views: list[torch.Tensor] = [torch.empty(0)] * len(self.params)
        self.bucket_of = [0] * len(self.params)
        self.buckets: list[tuple[int, int]] = []  # [start, end) of the buffer
        offset, start = 0, 0
        for index in reversed(range(len(self.params))):  # backward order, roughly
            p = self.params[index]
            self.views[index] = self.flat[offset: offset + p.numel()].view_as(p)
            self.bucket_of[index] = len(self.buckets)
            offset += p.numel()
            if (offset - start) * self.flat.element_size() >= bucket_bytes or index == 0:
                self.buckets.append((start, offset))
                start = offset
        self.counts = [self.bucket_of.count(b) for b in range(len(self.buckets))]
        self.world_size = world_size
        self.reduce_dtype = torch.bfloat16 if reduce_dtype == "bf16" else None
        self._armed = False
        self._pending: list[int] = []
        self._next = 0
        self._works: list[tuple[Any, torch.Tensor | None, torch.Tensor]] = []
        if world_size > 1:
            for index, p in enumerate(self.params):
                p.register_post_accumulate_grad_hook(functools.partial(self._ready, index))

    @property
    def nbytes(self) -> int:
        return self.flat.numel() * self.flat.element_size()

    def zero(self) -> None:
        """Before a step's first backward: every gradient a zeroed view of the buffer, so
        backward accumulates into it (one fill, no allocation)."""
        for p, view in zip(self.params, self.views, strict=True):
            if p.grad is not view:
                p.grad = view
        self.flat.zero_()
        self._armed = False

    def arm(self) -> None:
        """Before the step's last backward: buckets start as their gradients complete."""
        self._pending, self._next, self._works = list(self.counts), 0, []
        self._armed = self.world_size > 1

    def _ready(self, index: int, param: torch.Tensor) -> None:
        if not self._armed:
            return
        self._pending[self.bucket_of[index]] -= 1
        self._launch(finished=False)

    def _launch(self, finished: bool) -> None:
        """Start the buckets in order, each once all of its gradients are in (``finished``:
        backward is over, start every one left)."""
        while self._next < len(self.buckets) and (finished or not self._pending[self._next]):
            start, end = self.buckets[self._next]
            chunk = self.flat[start:end]
            low = chunk.to(self.reduce_dtype) if self.reduce_dtype is not None else None
            work = dist.all_reduce(chunk if low is None else low, async_op=True)
            self._works.append((work, low, chunk))
            self._next += 1

    def reduce(self) -> None:
        """After the step's last backward: start the buckets not started yet (their
        gradients never came: the parameter had none) and wait for every sum. No host syncs
        on CUDA (a graph captures it)."""
        if self.world_size == 1:
            return
        if not self._armed:
            self.arm()
        self._launch(finished=True)
        for work, low, chunk in self._works:
            work.wait()
            if low is not None:
                chunk.copy_(low)
        self._works, self._armed = [], False


def clean_name(name: str) -> str:
    """A parameter name without wrapper prefixes: the plain model's FQN."""
    return ".".join(part for part in name.split(".") if part not in _WRAPPER_PARTS)


# -- collectives (no-ops in one process) ---------------------------------------------------------
def all_reduce_(tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
    """In-place all-reduce across ranks (``sum``, ``min`` or ``max``)."""
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(tensor, op={"sum": dist.ReduceOp.SUM, "min": dist.ReduceOp.MIN,
                                    "max": dist.ReduceOp.MAX}[op])
    return tensor


def broadcast_object(obj: object, src: int = 0) -> object:
    """``obj`` from rank ``src`` on every rank."""
    if not (dist.is_available() and dist.is_initialized()):
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def barrier() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier()
