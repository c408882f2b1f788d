"""Regional compile: the Inductor options it passes, and a compiled block against eager (CPU)."""

from __future__ import annotations

import torch

from megacpp.model.config import ModelConfig
from megacpp.model.model import HybridLM
from megacpp.train.parallelize import compile_region, inductor_options


def test_inductor_options_name_a_setting_this_torch_has() -> None:
    import torch._inductor.config as inductor

    options = inductor_options()
    assert options, "neither cat-lowering setting exists in this torch: update inductor_options"
    assert all(hasattr(inductor, key) for key in options)


def test_compiled_mamba_block_matches_eager() -> None:
    """The M block (its in_proj split is the cat the options are about), forward and backward."""
    torch.manual_seed(0)
    cfg = ModelConfig.from_dict({"model": {"pattern": "M", "vocab_size": 64, "d_model": 64},
                                 "mamba": {"d_state": 16, "headdim": 16, "chunk_size": 8}})
    block = HybridLM(cfg).blocks[0]
    x = torch.randn(2, 24, 64, requires_grad=True)
    eager = block(x)
    (dx_eager,) = torch.autograd.grad(eager.square().sum(), x)
    compile_region(block)
    out = block(x)
    (dx,) = torch.autograd.grad(out.square().sum(), x)
    torch.testing.assert_close(out, eager, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(dx, dx_eager, rtol=1e-4, atol=1e-5)
