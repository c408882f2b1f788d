"""Block: the pre-norm hands a mixer with INPUT_FANOUT n the normed input n times (attention
2, the MoE 2, Mamba-3 3): ``again`` holds the copies after the first, each a tensor of its own
whose gradient the norm's backward sums; the block computes what it computes with one copy."""

from __future__ import annotations

import pytest
import torch

from megacpp.model.blocks import Block
from tests.model.conftest import small_config


@pytest.mark.parametrize(("family", "variant", "fanout"),
                         [("A", "gqa", 2), ("E", None, 2), ("M", "siso", 3)])
def test_block_hands_the_mixer_its_input_fanout(family, variant, fanout):
    torch.manual_seed(0)
    block = Block(family, variant, small_config()).double()
    assert block.mixer.INPUT_FANOUT == fanout
    seen = []
    block.mixer.register_forward_pre_hook(
        lambda m, args, kwargs: seen.append(kwargs.get("again")), with_kwargs=True)
    x = torch.randn(2, 10, 32, dtype=torch.float64, requires_grad=True)
    out = block(x)
    (dx,) = torch.autograd.grad(out.sum(), [x])
    assert len(seen[0]) == fanout - 1
    assert all(torch.equal(t, block.norm(x)) for t in seen[0])
    block.mixer.INPUT_FANOUT = 1  # one copy: same values, same gradient
    ref = x.detach().clone().requires_grad_()
    want = block(ref)
    (d_ref,) = torch.autograd.grad(want.sum(), [ref])
    assert seen[1] == ()
    torch.testing.assert_close(out, want, rtol=0, atol=0)
    torch.testing.assert_close(dx, d_ref, rtol=1e-12, atol=1e-12)
