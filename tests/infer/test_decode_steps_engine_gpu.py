"""The engine with the fused decode steps of its recurrent layers (``mamba3_step`` and
``gated_delta_step``, chosen under ``MEGACPP_KERNELS=auto``) decodes the same greedy tokens as
with the reference decode paths, inside the captured decode graphs, across batch buckets
(padding rows in a scratch slot)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from megacpp.infer.sampling import SamplingParams
from megacpp.model.config import load_config
from megacpp.model.model import HybridLM
from tests.infer.test_engine import _prompts, _run
from tests.infer.test_engine_gpu import LENGTHS, _engine, tokenizer  # noqa: F401 (fixture)


def _decode(model, tokenizer, mode: str, max_new_tokens: int = 20):  # noqa: F811 (not the fixture)
    from megacpp.kernels.runtime import chosen_kernels, clear_resolutions, kernel_mode_override

    params = SamplingParams(temperature=0, max_new_tokens=max_new_tokens, ignore_eos=True)
    requests = {str(i): (p, params)
                for i, p in enumerate(_prompts(model.cfg.vocab_size, LENGTHS))}
    clear_resolutions()
    with kernel_mode_override(mode):
        engine = _engine(model, tokenizer)
        tokens = _run(engine, requests)
        prompt = torch.tensor([requests["2"][0]], device="cuda")
        greedy = model.generate_greedy(prompt, max_new_tokens)  # the lockstep cache's path
        assert engine.graphs is not None and len(engine.graphs.graphs) > 1
        return tokens, greedy, chosen_kernels()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_fused_decode_step_decodes_the_reference_tokens(dtype, tokenizer):  # noqa: F811
    """float64: only the fused decode steps (mamba3_step, gated_delta_step) qualify under
    auto (the other Triton rows take no float64); float32 runs them with the other chosen
    kernels."""
    torch.manual_seed(0)
    cfg = dataclasses.replace(load_config("tiny"), vocab_size=tokenizer.vocab_size, init_std=0.3)
    model = HybridLM(cfg).to(dtype).cuda().eval()
    ref_tokens, ref_greedy, ref_chosen = _decode(model, tokenizer, "reference")
    tokens, greedy, chosen = _decode(model, tokenizer, "auto")
    for surface in ("mamba3_step", "gated_delta_step"):
        assert ref_chosen.get(surface, "reference") == "reference"
        assert chosen[surface] == "triton_fused"
    assert tokens == ref_tokens
    assert torch.equal(greedy, ref_greedy)
