"""The training step as two CUDA graphs (``parallel.cuda_graph = true``).

An eager step of a hybrid model is host-bound: thousands of small launches per step (the
recurrent scans' chunk kernels, the MoE plan, norms, Muon's Newton-Schulz iterations per
matrix) that the CPU issues slower than the GPU runs them. Captured once and replayed, the
step costs a handful of host calls. It is split at the one place the trainer must look at
the numbers before changing the weights:

* ``accumulate`` -- forward and backward of every micro-batch of the step: the gradients (in
  the graph's memory pool, reused every replay), then the step's figures in one float64
  tensor: the summed losses, the target count and the global gradient norm;
* (eager, between the replays) the debug fault injection and the non-finite guard, which
  reads the figures on the host in one copy -- a bad step stops the run before any weight
  changes, exactly as in eager mode. (Computing the norm here, eagerly, cost ~400 per-tensor
  launches and a second host sync: the GPU sat idle ~8 ms of a nam56r-350m step on an H100,
  against ~1 ms with the norm inside the graph; 112.6 vs 108.8 ms a step);
* ``update`` -- clipping by that norm, the AdamW and Muon steps, the MoE bias update and the
  load-balance figure.

What capture needs, and what it gets here: static shapes (every micro-batch is full); static
inputs (each step's batches are copied into the graph's input buffers); no host syncs inside
either part (the catalog's fast kernels; the reference MoE loop syncs and fails to capture,
with an error saying so); a learning rate read from device memory (the optimizers' groups
hold one device tensor while capturing, :meth:`Optimizers.device_lr`); and warm-up steps
before capture (Triton compilation and autotuning, cuBLAS workspaces, optimizer state): the
first :data:`WARMUP_STEPS` steps after every start or resume run eagerly, on the side stream
the capture then uses (autograd's gradient-accumulation nodes outlive a step and keep the
stream they were made on), through the same two functions the graphs capture, so a graphed run computes what an eager
run computes (a GPU test compares the two loss curves). Gradients are never freed after
capture (the graph owns their memory): the trainer skips ``zero_grad`` in this mode, since
the first micro-batch's backward overwrites them.

Several processes capture too, each its own graphs, with their collectives inside (NCCL
>= 2.9.6 captures collectives; every rank must capture and replay the same ones in the same
order, which the identical step guarantees):

* DDP runs without the DistributedDataParallel wrapper (whose reducer does host work each
  step): the gradients are views into one flat buffer whose buckets are all-reduced as
  backward completes them (:class:`megacpp.train.parallelize.FlatGradReducer`), and
  ``accumulate`` waits for the sums before the norm;
* FSDP2 is captured as it runs: its per-block all-gathers and reduce-scatters, on its own
  streams, become branches of the graph (the root keeps its weights gathered after forward,
  which capture needs); the optimizer steps on the local shards in ``update``.

Captures of several processes use ``capture_error_mode="thread_local"``: the process group's
watchdog thread queries its events while the main thread captures. The graph is fixed at
capture: anything that changes the step's work (a new shape, another kernel choice) needs a
new run segment.

The capture does not go through :func:`megacpp.kernels.timing.capture_graph` (the benchmarks'):
that one warms up and captures a single function into a pool of its own on a stream it makes,
while the step needs two graphs sharing one pool, captured on the stream the trainer's eager
warm-up steps ran on. Both raise the same :class:`~megacpp.kernels.timing.GraphCaptureError`.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from megacpp.errors import describe_error
from megacpp.kernels.timing import GraphCaptureError
from megacpp.train.optim import Optimizers

WARMUP_STEPS = 3  # eager steps before capture (the PyTorch CUDA-graph notes use 3)
INPUT_KEYS = ("input_ids", "labels", "doc_ids", "structure_ids")  # every loader batch has all

Batch = dict[str, Tensor]


class StepGraphs:
    """The captured ``accumulate`` (micro-batches -> the step's figures, float64 [ce, aux,
    MTP, targets, gradient norm]) and ``update`` (gradient norm -> balance or None) of one
    training run."""

    def __init__(self, accumulate: Callable[[list[Batch]], Tensor],
                 update: Callable[[Tensor], Tensor | None], optimizers: Optimizers,
                 example: list[Batch], device: torch.device, stream: torch.cuda.Stream,
                 capture_error_mode: str = "global") -> None:
        self.inputs = [{key: torch.empty_like(batch[key], device=device) for key in INPUT_KEYS}
                       for batch in example]
        self.norm = torch.zeros((), device=device)
        self._copy_inputs(example)
        self.accumulate_graph = torch.cuda.CUDAGraph()
        self.update_graph = torch.cuda.CUDAGraph()
        optimizers.zero_grad()  # the capture's first backward allocates the gradients
        try:
            with optimizers.device_lr(device):
                with torch.cuda.graph(self.accumulate_graph, stream=stream,
                                      capture_error_mode=capture_error_mode):
                    self.figures = accumulate(self.inputs)
                with torch.cuda.graph(self.update_graph, pool=self.accumulate_graph.pool(),
                                      stream=stream, capture_error_mode=capture_error_mode):
                    self.balance = update(self.norm)
        except Exception as exc:  # any failure inside a capture fails the capture
            raise GraphCaptureError(
                f"parallel.cuda_graph: capturing the training step failed "
                f"({describe_error(exc)}). The step "
                "must run without host syncs: use the catalog's kernels "
                "(parallel.kernels = \"auto\" or \"fast\", or MEGACPP_KERNELS=fast; the "
                "reference MoE loop and others sync), or set parallel.cuda_graph = false"
                ) from exc

    def _copy_inputs(self, micro: list[Batch]) -> None:
        if len(micro) != len(self.inputs):
            raise ValueError(f"captured {len(self.inputs)} micro-batches, got {len(micro)}")
        for static, batch in zip(self.inputs, micro, strict=True):
            for key in INPUT_KEYS:
                if batch[key].shape != static[key].shape:
                    raise ValueError(f"{key}: captured shape {tuple(static[key].shape)}, got "
                                     f"{tuple(batch[key].shape)}")
                static[key].copy_(batch[key], non_blocking=True)

    def accumulate(self, micro: list[Batch]) -> Tensor:
        """Copy the step's micro-batches in, replay forward + backward; the step's figures
        (the graph's output tensor, float64 [ce, aux, MTP, targets, gradient norm])."""
        self._copy_inputs(micro)
        self.accumulate_graph.replay()
        return self.figures

    def update(self, grad_norm: Tensor) -> Tensor | None:
        """Replay clipping by ``grad_norm``, the optimizer steps and the MoE bias update;
        the load balance (the graph's output) or None."""
        self.norm.copy_(grad_norm)
        self.update_graph.replay()
        return self.balance

    def release(self) -> None:
        """Free both graphs, once the run is over. A graph that captured NCCL collectives
        holds a reference on the communicator that only its destruction drops, and NCCL's
        communicator teardown waits for that count to reach zero: without this, a multi-GPU
        run finished its last step and then hung in ``destroy_process_group`` (seen on H100s
        with DDP and FSDP2; pytorch/pytorch#115388)."""
        torch.cuda.synchronize()
        self.accumulate_graph.reset()
        self.update_graph.reset()
