"""Parallelism applied to the plain model from outside (the model file never changes).

:func:`init_distributed` reads torchrun's environment (``RANK``, ``WORLD_SIZE``,
``LOCAL_RANK``) and starts the process group; :func:`parallelize` then applies, in order:

1. activation checkpointing per block letter (``parallel.activation_checkpointing = "ME"``
   recomputes every M and E block in backward and keeps the others' activations);
2. regional ``torch.compile``: each block compiled in place (parameter names unchanged);
3. data parallelism: DDP, or FSDP2 (``fully_shard`` on every block, then the root).

Parameter names stay the plain model's FQNs for checkpoints (torch.distributed.checkpoint's
state-dict helpers drop the wrapper prefixes), so a checkpoint written under one strategy
loads under another.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import os
from collections.abc import Iterator
from dataclasses import dataclass

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
    """Pick the device and strategy; start the process group under torchrun."""
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
            dist.init_process_group(backend, timeout=dt.timedelta(minutes=10))
    return DistEnv(rank, world_size, local_rank, torch_device, strategy)


def shutdown_distributed() -> None:
    if dist.is_available() and dist.is_initialized():
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
def parallelize(model: nn.Module, cfg: ParallelSection, env: DistEnv) -> nn.Module:
    """Activation checkpointing, compile and DDP/FSDP2 applied to a HybridLM on ``env.device``.

    Returns the module to call for training (the DDP wrapper, or ``model`` itself, sharded
    in place, for FSDP2 and single-process runs).
    """
    apply_activation_checkpointing(model, cfg.activation_checkpointing)
    if cfg.compile:
        compile_blocks(model)
    if env.strategy == "ddp" and env.distributed:
        # broadcast_buffers=False: each rank keeps its own MoE load counters until the
        # trainer all-reduces them; the expert bias stays identical because every rank
        # applies the same all-reduced update.
        device_ids = [env.device.index] if env.device.type == "cuda" else None
        return DistributedDataParallel(model, device_ids=device_ids, broadcast_buffers=False)
    if env.strategy == "fsdp":
        apply_fsdp(model, env)
    return model


# compiled variants of one block kind: grad on (training) and off (validation, no_grad), each
# with and without the previous block's pending output (the first block has none)
_VARIANTS_PER_KIND = 4


def compile_blocks(model: nn.Module, backend: str = "inductor") -> None:
    """Regional compile: each block compiled in place (``block.compile``).

    All blocks run one code object (``Block.forward``, and ``RMSNorm._norm`` under it), and
    Dynamo counts its compiled variants against ``recompile_limit`` (default 8) across every
    block: each mixer type, the first block (no pending add) and grad mode off in validation
    each make one. A hybrid of four kinds needs ~10, so the final validation of a default
    run went past the limit and ran those blocks eager, with a warning (nam56r-350m,
    benchmarks/results/train_h100_s29). The limit is raised to what the model's kinds need."""
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


def apply_fsdp(model: nn.Module, env: DistEnv) -> None:
    """FSDP2: shard each block's parameters (dim 0) across the ranks, then the root's."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(env.device.type, (env.world_size,))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)


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
