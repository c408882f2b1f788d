"""How a run's step executes, decided once per run and said with the reason for each choice.

The defaults are the fast path where it is valid and today's behaviour on CPU:

* ``kernels`` -- ``default``: the catalog's chosen backend where it qualifies (``auto``) on
  CUDA, the plain-PyTorch references on CPU. ``MEGACPP_KERNELS`` (or ``set_kernel_mode``)
  overrides the config;
* ``compile`` -- ``auto``: regional ``torch.compile`` on CUDA, off on CPU;
* ``cuda_graph`` -- ``auto``: the step captured as CUDA graphs on CUDA (one process, DDP or
  FSDP2), off on CPU or with the reference kernels (their host syncs cannot be captured).
  A capture that fails under ``auto`` leaves the run eager with the reason in the log and the
  receipt; under ``true`` it stops the run;
* ``grad_sync`` (DDP) -- ``auto``: ``flat`` (a flat gradient buffer whose buckets are
  all-reduced during backward, captured with the step) when the step is graphed, else
  ``ddp`` (torch's DistributedDataParallel: bucketed all-reduces overlapped with backward).

* ``float8`` -- ``off``: bf16 GEMMs; ``tensorwise`` / ``rowwise``: the linear layers in FP8
  (:mod:`megacpp.train.float8`); a device that cannot run the recipe stops the run here.

An explicit value that cannot hold (a graph on CPU, a graph with ``grad_sync = "ddp"``) is a
one-line :class:`ConfigError`.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from megacpp.errors import ConfigError
from megacpp.kernels.runtime import kernel_mode_setting
from megacpp.train.config import AUTO, ParallelSection
from megacpp.train.float8 import require_float8


@dataclass
class ExecutionPlan:
    """The modes of one run, each with why it was chosen."""

    kernels: str  # reference | auto | fast
    kernels_why: str
    compile: bool
    compile_why: str
    cuda_graph: bool
    cuda_graph_why: str
    graph_required: bool  # parallel.cuda_graph = true: a failed capture stops the run
    grad_sync: str | None  # flat | ddp under DDP with several ranks; None otherwise
    grad_sync_why: str
    float8: str = "off"  # off | tensorwise | rowwise (the linear layers' GEMMs)
    float8_why: str = "default: bf16 GEMMs"

    def lines(self) -> list[str]:
        """One line per mode, e.g. ``cuda_graph: on (default on CUDA)``."""
        def onoff(flag: bool) -> str:
            return "on" if flag else "off"

        lines = [f"kernels: {self.kernels} ({self.kernels_why})",
                 f"compile: {onoff(self.compile)} ({self.compile_why})",
                 f"cuda_graph: {onoff(self.cuda_graph)} ({self.cuda_graph_why})"]
        if self.grad_sync is not None:
            lines.append(f"grad_sync: {self.grad_sync} ({self.grad_sync_why})")
        lines.append(f"float8: {self.float8} ({self.float8_why})")
        return lines

    def to_dict(self) -> dict[str, object]:
        return asdict(self)

    def graph_failed(self, reason: str) -> None:
        """A capture under ``auto`` failed: the run goes on eagerly, and says why."""
        self.cuda_graph = False
        self.cuda_graph_why = f"capture failed, running eager: {reason}"


def plan_execution(cfg: ParallelSection, device: torch.device, strategy: str,
                   world_size: int) -> ExecutionPlan:
    """The modes of a run on ``device`` under ``strategy`` with ``world_size`` ranks."""
    cuda = device.type == "cuda"
    kernels, kernels_why = _kernels(cfg.kernels, cuda)
    compile_on, compile_why = _flag(cfg.compile, "compile", cuda)
    ddp = strategy == "ddp" and world_size > 1
    graph, graph_why = _cuda_graph(cfg, cuda, kernels, ddp)
    grad_sync, grad_sync_why = None, ""
    if ddp:
        if cfg.grad_sync == AUTO:
            grad_sync = "flat" if graph else "ddp"
            grad_sync_why = ("default with cuda_graph: bucketed all-reduces, captured" if graph
                             else "default without cuda_graph: DistributedDataParallel")
        else:
            grad_sync, grad_sync_why = cfg.grad_sync, f"parallel.grad_sync = \"{cfg.grad_sync}\""
    require_float8(cfg.float8, device)  # fails closed before anything is built
    float8_why = ("default: bf16 GEMMs" if cfg.float8 == "off"
                  else f"parallel.float8 = \"{cfg.float8}\": torchao float8 linear layers")
    return ExecutionPlan(kernels, kernels_why, compile_on, compile_why, graph, graph_why,
                         cfg.cuda_graph is True, grad_sync, grad_sync_why, cfg.float8,
                         float8_why)


def _kernels(configured: str, cuda: bool) -> tuple[str, str]:
    setting = kernel_mode_setting()
    if setting is not None:
        mode, source = setting
        note = (f"; parallel.kernels = \"{configured}\" is overridden"
                if configured not in ("default", mode) else "")
        return mode, f"{source}{note}"
    if configured != "default":
        return configured, f"parallel.kernels = \"{configured}\""
    if cuda:
        return "auto", "default on CUDA: the catalog's chosen backend where it qualifies"
    return "reference", "default on CPU"


def _flag(value: bool | str, name: str, cuda: bool) -> tuple[bool, str]:
    if value is True or value is False:
        return value, f"parallel.{name} = {str(value).lower()}"
    return (True, "default on CUDA") if cuda else (False, "default off on CPU")


def _cuda_graph(cfg: ParallelSection, cuda: bool, kernels: str, ddp: bool) -> tuple[bool, str]:
    value = cfg.cuda_graph
    wrapper = ddp and cfg.grad_sync == "ddp"
    if value is True:
        if wrapper:
            raise ConfigError("parallel.cuda_graph = true needs parallel.grad_sync = \"flat\" "
                              "(or \"auto\") under DDP: the DistributedDataParallel wrapper's "
                              "reducer is not captured")
        if not cuda:
            raise ConfigError("parallel.cuda_graph = true needs a CUDA device (this run is on "
                              "cpu); set it false or \"auto\"")
        return True, "parallel.cuda_graph = true"
    if value is False:
        return False, "parallel.cuda_graph = false"
    if not cuda:
        return False, "default off on CPU"
    if kernels == "reference":
        return False, ("the reference kernels sync the host, which a graph cannot capture; "
                       "parallel.kernels = \"auto\" or \"fast\" to graph")
    if wrapper:
        return False, "parallel.grad_sync = \"ddp\": the DDP wrapper's reducer is not captured"
    return True, "default on CUDA"
