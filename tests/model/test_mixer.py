"""The mixer contract (model/mixer.py) and the one registry that builds mixers (MIXERS)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from megacpp.model.blocks import MIXERS, Block, build_mixer
from megacpp.model.counting import count_model
from megacpp.model.mixer import Mixer, RecurrentMixer
from megacpp.model.model import HybridLM
from megacpp.pattern import FAMILIES
from tests.model.conftest import small_config


def _implemented_layers() -> set[tuple[str, str | None]]:
    layers = set()
    for family in FAMILIES.values():
        if family.variants:
            layers |= {(family.letter, v.name) for v in family.variants if v.implemented}
        elif family.implemented:
            layers.add((family.letter, None))
    return layers


def test_the_mixer_registry_builds_every_buildable_pattern_layer():
    assert set(MIXERS) == _implemented_layers()
    cfg = small_config()
    for family, variant in MIXERS:
        mixer = build_mixer(family, variant, cfg)
        assert isinstance(mixer, Mixer), (family, variant)
        assert (family in "MR") == isinstance(mixer, RecurrentMixer)
        # attention keeps a paged cache, M and R a state, E and D neither
        assert (mixer.paged_layout() is not None) == (family == "A")
        assert (mixer.init_cache(2, "cpu") is not None) == (family in "MR")
        assert (mixer.cache_bytes_per_token() > 0) == (family == "A")
        assert (mixer.state_bytes() > 0) == (family in "MR")
        assert mixer.flops_per_token(16) > 0


def test_an_unregistered_layer_fails_closed_naming_the_registered_ones(monkeypatch):
    monkeypatch.delitem(MIXERS, ("M", "mimo"))
    with pytest.raises(AssertionError, match=r"no mixer registered for M:mimo; registered: "
                                             r"A:gqa, A:mla, A:dsa, M:siso, R, E, D"):
        build_mixer("M", "mimo", small_config())


def test_a_mixer_missing_a_required_member_cannot_be_built():
    class NoPagedForward(Mixer):
        @classmethod
        def from_config(cls, cfg):
            return cls()

        def forward(self, x, doc_ids=None, again=()):
            return x

        def flops_per_token(self, seq_len):
            return 0

    with pytest.raises(TypeError, match="forward_paged"):
        NoPagedForward.from_config(small_config())


class Scaled(Mixer):
    """A toy position-wise mixer (y = x W), built the way a new mixer file would be."""

    def __init__(self, d_model: int) -> None:
        super().__init__()
        self.out_proj = nn.Linear(d_model, d_model, bias=False)

    @classmethod
    def from_config(cls, cfg):
        return cls(cfg.d_model)

    def forward(self, x, doc_ids=None, again=()):
        return self.out_proj(x)

    def forward_paged(self, x, cache, again=()):
        return self.forward(x)

    def flops_per_token(self, seq_len):
        return 2 * self.out_proj.in_features * self.out_proj.out_features

    def residual_projections(self):
        return [self.out_proj.weight]


def test_one_registry_line_plugs_a_new_mixer_into_training_decoding_and_describe(monkeypatch):
    monkeypatch.setitem(MIXERS, ("D", None), Scaled.from_config)
    cfg = small_config("AMD")
    torch.manual_seed(0)
    model = HybridLM(cfg)
    assert isinstance(model.blocks[2].mixer, Scaled)
    ids = torch.randint(0, cfg.vocab_size, (2, 12))
    out = model(ids, labels=ids)
    out.loss.backward()
    assert model.blocks[2].mixer.out_proj.weight.grad is not None
    model.eval()
    with torch.no_grad():
        full = model(ids).logits.argmax(-1)
    greedy = model.generate_greedy(ids[:, :6], 1)  # through the paged caches
    assert torch.equal(greedy[:, -1], full[:, 5])
    d_row = count_model(cfg, seq_len=16).layers[2]
    assert d_row.fwd_flops_per_token == 2 * cfg.d_model**2
    assert (d_row.cache_bytes_per_token, d_row.state_bytes) == (0, 0)


def test_the_block_reads_its_mixers_input_fanout():
    block = Block("M", "siso", small_config())
    x = torch.randn(2, 5, 32)
    s, h, again = block.fused_pre_norm(x)
    assert torch.equal(s, x)
    assert len(again) == block.mixer.INPUT_FANOUT - 1 == 2
    assert all(torch.equal(t, h) for t in again)
