"""Parameter, FLOP and cache accounting per layer.

* Parameters are counted exactly from the module tree built on the ``meta`` device (no
  memory, no init cost, so a 1B preset is described instantly), with its initialisation
  skipped (:class:`_ShapesOnly`). Active parameters subtract the routed experts a token does
  not visit.
* Forward FLOPs per token are analytic: each mixer's ``flops_per_token(seq_len)`` counts its
  matmul work (2*m*n*k), including attention's sequence-length term (full L x L scores),
  the scan's chunk/state terms, and only the k active experts of an MoE layer. Elementwise
  work (norms, activations, gates, softmax) is not counted -- as in the usual 6N-style
  accounting and in ``torch.utils.flop_counter.FlopCounterMode``, which the tests use to
  validate these numbers on the reference model.
* Training FLOPs = 3 x forward (backward does two matmuls per forward matmul).
* Cache bytes per token: attention's K and V per token (bf16 by default) -- for A:mla the
  compressed latent plus the shared RoPE key, for A:dsa that plus the indexer key. Every A
  layer also reports ``gqa_cache_bytes_per_token``, what an A:gqa layer of the same config
  would cache, so latent attention's saving is visible. M and R keep a fixed-size recurrent
  state instead, reported per sequence.
* Multi-token prediction: one row per depth (family ``MTP``), counting its in_proj, its
  blocks and its pass through the shared output head. Its blocks are not cached (the MTP
  modules run only in training forwards).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

import torch
from torch.overrides import TorchFunctionMode

from megacpp.model.blocks import build_mixer
from megacpp.model.config import ModelConfig
from megacpp.pattern import LayerPlan

if TYPE_CHECKING:
    from megacpp.model.model import HybridLM


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
    gqa_cache_bytes_per_token: int = 0  # what an A:gqa layer would cache here (A layers)


@dataclass
class ModelCost:
    seq_len: int
    layers: list[LayerCost]
    embedding_params: int
    head_params: int  # 0 when tied
    head_flops_per_token: int
    norm_params: int = 0  # the final RMSNorm
    structure_params: int = 0  # the structure-id embedding ([structure] embedding)
    ngram_params: int = 0  # the hashed n-gram tables ([ngram] orders)

    @property
    def params(self) -> int:
        return (
            self.embedding_params
            + self.structure_params
            + self.ngram_params
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
    def gqa_cache_bytes_per_token(self) -> int:
        """The attention cache if every A layer were A:gqa (compare with the real one)."""
        return sum(layer.gqa_cache_bytes_per_token for layer in self.layers)

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
                "structure_params": self.structure_params,
                "ngram_params": self.ngram_params,
                "head_params": self.head_params,
                "fwd_flops_per_token": self.fwd_flops_per_token,
                "train_flops_per_token": self.train_flops_per_token,
                "cache_bytes_per_token": self.cache_bytes_per_token,
                "gqa_cache_bytes_per_token": self.gqa_cache_bytes_per_token,
                "state_bytes_per_sequence": self.state_bytes,
            },
            "layers": [asdict(layer) for layer in self.layers],
        }


# pointwise ops whose result only feeds an initial value (their operands' broadcast shape)
_POINTWISE = frozenset({
    "exp", "log", "expm1", "log1p", "neg", "abs", "sqrt", "rsqrt", "reciprocal", "sigmoid",
    "tanh", "cos", "sin", "clamp", "clamp_min", "clamp_max", "add", "sub", "mul", "div", "pow",
    "__add__", "__radd__", "__sub__", "__rsub__", "__mul__", "__rmul__", "__truediv__",
    "__rtruediv__", "__neg__", "__pow__", "__rpow__",
})


class _ShapesOnly(TorchFunctionMode):
    """Builds a module tree for its shapes, not its values: in-place initialisers
    (``normal_``, ``uniform_``, ``copy_``, ``fill_``, nn.init's) return their tensor untouched
    and pointwise math returns an empty tensor of the broadcast shape; everything else (tensor
    creation, views) runs, ``*_like`` as ``torch.empty``. On the meta device the values do not
    exist anyway, and these ops reach PyTorch's Python meta kernels, whose first calls import
    torch._dynamo and sympy (seconds): a ``megacpp model describe`` needs none of it.
    tests/model/test_counting.py checks the counts against a module tree built normally, for
    every preset and block family."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
        if tensors and name.endswith("_") and not name.startswith("_"):
            return tensors[0]  # an in-place initialiser
        if tensors and name in _POINTWISE:
            shape = _broadcast_shape([t.shape for t in tensors])
            return torch.empty(shape, dtype=tensors[0].dtype, device=tensors[0].device)
        if tensors and name.endswith("_like"):  # empty_like & co: their meta kernel is Python
            dtype = kwargs.get("dtype") or tensors[0].dtype
            return torch.empty(tensors[0].shape, dtype=dtype, device=tensors[0].device)
        return func(*args, **kwargs)


def _broadcast_shape(shapes: list[torch.Size]) -> tuple[int, ...]:
    """The broadcast of ``shapes`` (``torch.broadcast_shapes`` imports sympy: a second)."""
    ndim = max(len(shape) for shape in shapes)
    padded = [(1,) * (ndim - len(shape)) + tuple(shape) for shape in shapes]
    return tuple(max(sizes) for sizes in zip(*padded))


def count_model(
    cfg: ModelConfig,
    plan: LayerPlan | None = None,
    seq_len: int = 2048,
    cache_dtype: torch.dtype = torch.bfloat16,
) -> ModelCost:
    from megacpp.model.model import HybridLM  # model imports counting's siblings only

    with torch.device("meta"), _ShapesOnly():
        model = HybridLM(cfg, plan)
        gqa_bytes = build_mixer("A", "gqa", cfg).cache_bytes_per_token(cache_dtype)
    head_flops = 2 * cfg.d_model * cfg.vocab_size
    layers = []
    for spec, block in zip(model.plan.layers, model.blocks, strict=True):
        mixer = block.mixer
        params = sum(p.numel() for p in block.parameters())
        inactive = mixer.inactive_params()
        cache = mixer.cache_bytes_per_token(cache_dtype)
        state = mixer.state_bytes(1)
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
                gqa_cache_bytes_per_token=gqa_bytes if block.family == "A" else 0,
            )
        )
    if model.mtp is not None:
        layers += _mtp_costs(model, seq_len, head_flops)
    head_params = 0 if model.lm_head is None else model.lm_head.weight.numel()
    return ModelCost(
        seq_len=seq_len,
        layers=layers,
        embedding_params=model.embed.weight.numel(),
        head_params=head_params,
        head_flops_per_token=head_flops,
        norm_params=model.norm.weight.numel(),
        structure_params=_numel(model.structure_embed),
        ngram_params=_numel(model.ngram_embed),
    )


def _numel(module: torch.nn.Module | None) -> int:
    return 0 if module is None else sum(p.numel() for p in module.parameters())


def _mtp_costs(model: HybridLM, seq_len: int, head_flops: int) -> list[LayerCost]:
    """One row per MTP depth, numbered after the main stack, in its last stage."""
    stage = model.plan.layers[-1].stage
    label = model.mtp.plan.format()
    rows = []
    for depth, module in enumerate(model.mtp.depths, start=1):
        params = sum(p.numel() for p in module.parameters())
        rows.append(
            LayerCost(
                index=len(model.blocks) + depth - 1,
                letter=f"mtp{depth}[{label}]",
                family="MTP",
                variant=label,
                stage=stage,
                params=params,
                active_params=params - module.inactive_params(),
                fwd_flops_per_token=module.flops_per_token(seq_len) + head_flops,
                cache_bytes_per_token=0,
                state_bytes=0,
            )
        )
    return rows
