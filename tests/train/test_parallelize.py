"""Regional compile on CPU: a compiled block against eager, forward and backward."""

from __future__ import annotations

import torch

from megacpp.model.config import ModelConfig
from megacpp.model.model import HybridLM


def test_compiled_mamba_block_matches_eager() -> None:
    """The M block as the trainer compiles it (``block.compile()``): its in_proj split, the
    gates' autograd.Function and the scan, traced by Dynamo; forward and backward."""
    torch.manual_seed(0)
    cfg = ModelConfig.from_dict({"model": {"pattern": "M", "vocab_size": 64, "d_model": 64},
                                 "mamba": {"d_state": 16, "headdim": 16, "chunk_size": 8}})
    block = HybridLM(cfg).blocks[0]
    x = torch.randn(2, 24, 64, requires_grad=True)
    eager = block(x)
    eager_grads = torch.autograd.grad(eager.square().sum(), [x, block.mixer.dt_bias])
    block.compile()
    out = block(x)
    grads = torch.autograd.grad(out.square().sum(), [x, block.mixer.dt_bias])
    torch.testing.assert_close(out, eager, rtol=1e-4, atol=1e-5)
    for got, want in zip(grads, eager_grads):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
