"""The whole-model decoding cache: one object per layer, each with an explicit layout.

* A:gqa: :class:`~megacpp.model.attention.KVCache` -- keys/values [B, Hkv, capacity, hd].
* A:mla / A:dsa: :class:`~megacpp.model.mla.MLACache` (compressed latent + shared RoPE key;
  DSA also caches its indexer keys) -- see ``model/mla.py`` and ``model/dsa.py``.
* M (Mamba-3) and R (gated delta rule): the mixer's own fixed-size recurrent state.
* E and D: stateless (``None``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class ModelCache:
    layers: list[Any]  # per-layer cache objects, None for stateless sublayers
    capacity: int  # max tokens per row (bounds the attention caches)
    length: int = 0  # tokens already consumed per row
    families: list[str] = field(default_factory=list)

    def nbytes(self) -> int:
        return sum(c.nbytes() for c in self.layers if c is not None)

    def bytes_by_family(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for fam, c in zip(self.families, self.layers, strict=True):
            if c is not None:
                out[fam] = out.get(fam, 0) + c.nbytes()
        return out
