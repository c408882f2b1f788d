"""Parameter, FLOP and cache accounting per layer.

* Parameters are counted exactly from the module tree built on the ``meta`` device (no
  memory, no init cost, so a 1B preset is described instantly). Active parameters subtract
  the routed experts a token does not visit.
* Forward FLOPs per token are analytic: each mixer's ``flops_per_token(seq_len)`` counts its
  matmul work (2*m*n*k), including attention's sequence-length term (full L x L scores),
  the scan's chunk/state terms, and only the k active experts of an MoE layer. Elementwise
  work (norms, activations, gates, softmax) is not counted -- as in the usual 6N-style
  accounting and in ``torch.utils.flop_counter.FlopCounterMode``, which the tests use to
  validate these numbers on the reference model.
* Training FLOPs = 3 x forward (backward does two matmuls per forward matmul).
* Cache bytes per token: attention's K and V per token (bf16 by default); M and R keep a
  fixed-size recurrent state instead, reported per sequence.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from megacpp.model.config import ModelConfig
from megacpp.pattern import LayerPlan


@dataclass
class LayerCost:
    index: int
    letter: str
    family: str
    variant: str
    stage: int
    params: int
    active_params: int
    fwd_flops_per_token: int
    cache_bytes_per_token: int
    state_bytes: int  # fixed recurrent state per sequence (M, R)


@dataclass
class ModelCost:
    seq_len: int
    layers: list[LayerCost]
    embedding_params: int
    head_params: int  # 0 when tied
    head_flops_per_token: int
    norm_params: int = 0  # the final RMSNorm

    @property
    def params(self) -> int:
        return (
            self.embedding_params
            + self.head_params
            + self.norm_params
            + sum(layer.params for layer in self.layers)
        )

    @property
    def active_params(self) -> int:
        return self.params - sum(layer.params - layer.active_params for layer in self.layers)

    @property
    def fwd_flops_per_token(self) -> int:
        return self.head_flops_per_token + sum(layer.fwd_flops_per_token for layer in self.layers)

    @property
    def train_flops_per_token(self) -> int:
        return 3 * self.fwd_flops_per_token

    @property
    def cache_bytes_per_token(self) -> int:
        return sum(layer.cache_bytes_per_token for layer in self.layers)

    @property
    def state_bytes(self) -> int:
        return sum(layer.state_bytes for layer in self.layers)

    def to_dict(self) -> dict:
        return {
            "seq_len": self.seq_len,
            "totals": {
                "params": self.params,
                "active_params": self.active_params,
                "embedding_params": self.embedding_params,
                "head_params": self.head_params,
                "fwd_flops_per_token": self.fwd_flops_per_token,
                "train_flops_per_token": self.train_flops_per_token,
                "cache_bytes_per_token": self.cache_bytes_per_token,
                "state_bytes_per_sequence": self.state_bytes,
            },
            "layers": [asdict(layer) for layer in self.layers],
        }


def count_model(
    cfg: ModelConfig,
    plan: LayerPlan | None = None,
    seq_len: int = 2048,
    cache_dtype: torch.dtype = torch.bfloat16,
) -> ModelCost:
    from megacpp.model.model import HybridLM  # model imports counting's siblings only

    with torch.device("meta"):
        model = HybridLM(cfg, plan)
    layers = []
    for spec, block in zip(model.plan.layers, model.blocks, strict=True):
        mixer = block.mixer
        params = sum(p.numel() for p in block.parameters())
        inactive = mixer.inactive_params() if hasattr(mixer, "inactive_params") else 0
        cache = mixer.cache_bytes_per_token(cache_dtype) if block.family == "A" else 0
        state = mixer.state_bytes(1) if hasattr(mixer, "state_bytes") else 0
        layers.append(
            LayerCost(
                index=spec.index,
                letter=block.letter,
                family=block.family,
                variant=block.variant,
                stage=spec.stage,
                params=params,
                active_params=params - inactive,
                fwd_flops_per_token=mixer.flops_per_token(seq_len),
                cache_bytes_per_token=cache,
                state_bytes=state,
            )
        )
    head_params = 0 if model.lm_head is None else model.lm_head.weight.numel()
    return ModelCost(
        seq_len=seq_len,
        layers=layers,
        embedding_params=model.embed.weight.numel(),
        head_params=head_params,
        head_flops_per_token=2 * cfg.d_model * cfg.vocab_size,
        norm_params=model.norm.weight.numel(),
    )
