"""One Gated DeltaNet decode step between in_proj and o_proj, on a slot-addressed state pool:
``reference.py`` (the plain-PyTorch form: the mixer's decode path), ``triton.py`` (one fused
kernel over (head, row)) and ``spec.py`` (the catalog entry). Forward only."""

from megacpp.kernels.ops.gated_delta_step.reference import (
    L2NORM_EPS,
    decay_and_write_strength,
    gated_delta_step_reference,
    gated_rms_output,
    l2norm,
    step_split,
)

__all__ = ["L2NORM_EPS", "decay_and_write_strength", "gated_delta_step_reference",
           "gated_rms_output", "l2norm", "step_split"]
