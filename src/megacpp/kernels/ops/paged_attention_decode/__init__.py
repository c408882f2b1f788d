"""Decode attention over the serving engine's paged K/V pool (one query token per row, GQA):
``reference.py`` (the plain-PyTorch form: gather the rows' blocks, mask, grouped attention),
``triton.py`` (reads K/V in place through the block table, online softmax, split over keys)
and ``spec.py`` (the catalog entry). Forward only."""

from megacpp.kernels.ops.paged_attention_decode.reference import paged_attention_decode_reference

__all__ = ["paged_attention_decode_reference"]
