"""One Mamba-3 SISO decode step between in_proj and out_proj, on a slot-addressed state pool:
``reference.py`` (the plain-PyTorch form: the mixer's decode path), ``triton.py`` (one fused
kernel over (head, row)) and ``spec.py`` (the catalog entry). Forward only."""

from megacpp.kernels.ops.mamba3_step.reference import mamba3_step_reference, step_split

__all__ = ["mamba3_step_reference", "step_split"]
