"""The engine with the fused Gated DeltaNet decode step (``gated_delta_step``, chosen under
``MEGACPP_KERNELS=auto``) decodes the same greedy tokens as with the reference decode path,
inside the captured decode graphs, across batch buckets (padding rows in a scratch slot)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from megacpp.model.config import load_config
from megacpp.model.model import HybridLM
from tests.infer.test_engine_gpu import tokenizer  # noqa: F401 (fixture)
from tests.infer.test_mamba3_step_engine_gpu import _decode


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_fused_decode_step_decodes_the_reference_tokens(dtype, tokenizer):  # noqa: F811
    """float64: only the two fused decode steps (mamba3_step, gated_delta_step) qualify under
    auto (the other Triton rows take no float64); float32 runs them with the other chosen
    kernels."""
    torch.manual_seed(0)
    cfg = dataclasses.replace(load_config("tiny"), vocab_size=tokenizer.vocab_size, init_std=0.3)
    model = HybridLM(cfg).to(dtype).cuda().eval()
    ref_tokens, ref_greedy, ref_chosen = _decode(model, tokenizer, "reference")
    tokens, greedy, chosen = _decode(model, tokenizer, "auto")
    assert ref_chosen.get("gated_delta_step", "reference") == "reference"
    assert chosen["gated_delta_step"] == "triton_fused"
    assert tokens == ref_tokens
    assert torch.equal(greedy, ref_greedy)
