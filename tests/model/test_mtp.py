"""Multi-token prediction: targets, document boundaries, logits, loss, accounting."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from megacpp.errors import ConfigError
from megacpp.model.config import ModelConfig
from megacpp.model.counting import count_model
from megacpp.model.model import IGNORE_INDEX, HybridLM, next_token_labels
from megacpp.model.mtp import future_tokens, mtp_labels
from tests.model.conftest import small_config
from tests.pattern.unbuilt import add_unbuilt_variant

V = 97


def _cfg(depth: int = 2, pattern: str = "AEMR", mtp_pattern: str = "AE", **mtp):
    data = small_config(pattern).to_dict()
    data["mtp"] = {"depth": depth, "pattern": mtp_pattern, **mtp}
    return ModelConfig.from_dict(data)


def _model(cfg, dtype=torch.float64):
    torch.manual_seed(0)
    return HybridLM(cfg).to(dtype).eval()


def _tokens(B, L, seed=1):
    return torch.randint(0, V, (B, L), generator=torch.Generator().manual_seed(seed))


def test_depth_k_targets_are_k_tokens_further_and_never_cross_documents():
    ids = torch.tensor([[10, 11, 12, 13, 20, 21, 22, 30]])
    doc = torch.tensor([[0, 0, 0, 0, 1, 1, 1, 2]])
    labels = next_token_labels(ids, doc)
    x = IGNORE_INDEX
    assert mtp_labels(labels, 1, x).tolist() == [[12, 13, x, x, 22, x, x, x]]
    assert mtp_labels(labels, 2, x).tolist() == [[13, x, x, x, x, x, x, x]]
    assert mtp_labels(labels, 9, x).tolist() == [[x] * 8]  # deeper than the row


@pytest.mark.parametrize("depth", [1, 2, 3])
def test_every_kept_target_is_in_the_querys_document(depth):
    g = torch.Generator().manual_seed(depth)
    ids = torch.randint(0, V, (3, 40), generator=g)
    doc = (torch.rand(3, 40, generator=g) < 0.15).cumsum(-1)  # documents of random lengths
    targets = mtp_labels(next_token_labels(ids, doc), depth, IGNORE_INDEX)
    kept = (targets != IGNORE_INDEX).nonzero().tolist()
    assert kept  # the check below must not pass vacuously
    for b, i in kept:
        assert targets[b, i] == ids[b, i + depth + 1]
        assert doc[b, i] == doc[b, i + depth + 1]


def test_future_tokens_are_absent_past_the_row_and_across_documents():
    ids = torch.tensor([[5, 6, 7, 8, 9]])
    doc = torch.tensor([[0, 0, 0, 1, 1]])
    future, present = future_tokens(ids, doc, 2)
    assert future.tolist() == [[7, 8, 9, 0, 0]]
    assert present.tolist() == [[True, False, False, False, False]]
    future, present = future_tokens(ids, None, 1)
    assert present.tolist() == [[True, True, True, True, False]]


def test_outputs_shapes_and_the_loss_adds_the_weighted_mtp_loss():
    cfg = _cfg(depth=2, loss_weight=0.25)
    model = _model(cfg, torch.float32).train()
    ids = _tokens(2, 12)
    labels = next_token_labels(ids)
    out = model(ids, labels=labels)
    assert [t.shape for t in out.mtp_logits] == [(2, 12, V), (2, 12, V)]
    expected_mtp = torch.stack(
        [
            F.cross_entropy(
                logits.flatten(0, 1),
                mtp_labels(labels, k, IGNORE_INDEX).flatten(),
                ignore_index=IGNORE_INDEX,
            )
            for k, logits in enumerate(out.mtp_logits, start=1)
        ]
    ).mean()
    torch.testing.assert_close(out.mtp_loss, expected_mtp)
    torch.testing.assert_close(out.loss, out.lm_loss + out.aux_loss + 0.25 * out.mtp_loss)
    assert model(ids).mtp_logits is not None  # drafts are available without labels too


def test_every_parameter_receives_a_gradient():
    model = _model(_cfg(depth=2, mtp_pattern="A:mla E"), torch.float32).train()
    ids = _tokens(2, 16)
    model(ids, labels=next_token_labels(ids)).loss.backward()
    missing = [n for n, p in model.named_parameters() if p.grad is None or p.grad.abs().sum() == 0]
    assert not missing, missing
    assert len(model.moe_blocks()) == 1 + 2  # the MTP modules' E blocks are balanced too
    assert set(model.moe_load()) == {1, 5, 7}  # MTP blocks numbered after the 4 main ones


def test_depth_k_logits_see_tokens_up_to_i_plus_k_only():
    model = _model(_cfg(depth=2))
    ids = _tokens(1, 14)
    base = model(ids).mtp_logits
    for t in (3, 9):
        changed = ids.clone()
        changed[0, t] = (changed[0, t] + 1) % V
        out = model(changed).mtp_logits
        for depth, (a, b) in enumerate(zip(out, base, strict=True), start=1):
            torch.testing.assert_close(a[:, : t - depth], b[:, : t - depth], rtol=0, atol=1e-12)
            assert not torch.allclose(a[:, t - depth :], b[:, t - depth :])


def test_packed_documents_get_the_same_mtp_logits_as_alone():
    model = _model(_cfg(depth=2))
    lengths = [6, 4, 7]
    ids = _tokens(1, sum(lengths))
    doc = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)])[None]
    packed = model(ids, doc_ids=doc).mtp_logits
    start = 0
    for n in lengths:
        alone = model(ids[:, start : start + n]).mtp_logits
        for p, a in zip(packed, alone, strict=True):
            torch.testing.assert_close(p[:, start : start + n], a, rtol=1e-9, atol=1e-9)
        start += n


def test_rows_shorter_than_the_depth_give_a_finite_loss():
    model = _model(_cfg(depth=3), torch.float32).train()
    ids = _tokens(2, 2)  # one next-token target per row, no target for any MTP depth
    out = model(ids, labels=next_token_labels(ids))
    assert torch.isfinite(out.loss) and out.mtp_loss == 0


def test_depth_zero_is_the_plain_model():
    model = _model(_cfg(depth=0))
    assert model.mtp is None and not any(k.startswith("mtp") for k in model.state_dict())
    ids = _tokens(1, 8)
    out = model(ids, labels=next_token_labels(ids))
    assert out.mtp_logits is None and out.mtp_loss is None


def test_counting_has_one_row_per_depth_and_matches_the_real_model():
    cfg = _cfg(depth=2, mtp_pattern="A:mla E")
    cost = count_model(cfg, seq_len=32)
    rows = [layer for layer in cost.layers if layer.family == "MTP"]
    assert [r.letter for r in rows] == ["mtp1[A:mlaE]", "mtp2[A:mlaE]"]
    assert [r.index for r in rows] == [4, 5]
    assert cost.params == sum(p.numel() for p in HybridLM(cfg).parameters())
    e = cfg.moe
    assert rows[0].params - rows[0].active_params == (e.n_experts - e.top_k) * 3 * 32 * 16
    assert rows[0].fwd_flops_per_token > 2 * cfg.d_model * cfg.vocab_size  # includes the head


@pytest.mark.parametrize(
    "mtp,needle",
    [
        ({"depth": -1}, "mtp.depth = -1 is invalid; allowed: >= 0"),
        ({"loss_weight": -0.1}, "mtp.loss_weight = -0.1 is invalid"),
        ({"pattern": "AX"}, "mtp.pattern = 'AX' is invalid: unknown layer letter 'X'"),
        ({"pattern": "A|E"}, "allowed: one stage (no '|'"),
        ({"pattern": "M:later"}, "mtp.pattern = 'M:later' is invalid: layer 0 'M:later' is not"),
        ({"depth": 1.5}, "mtp.depth = 1.5: expected an integer"),
    ],
)
def test_bad_mtp_config_names_the_field(monkeypatch, mtp, needle):
    add_unbuilt_variant(monkeypatch)  # M:later parses but is not built
    with pytest.raises(ConfigError) as info:
        ModelConfig.from_dict({"mtp": mtp})
    assert needle in str(info.value)


# -- the fused linear cross-entropy path ------------------------------------------------------
def _head_loss_backend(monkeypatch, fused: bool) -> None:
    """Make ``HybridLM.lm_loss`` (the main and the MTP head loss) resolve the
    ``linear_cross_entropy`` surface to a fused-role backend (``fused``) or to the catalog's
    fallback, leaving every other surface to the real resolution. On CPU the fused role is
    played by the surface's plain-PyTorch reference: it takes hidden states, the head weight
    and labels, as the Triton kernel does."""
    import megacpp.model.model as model_module
    from megacpp.kernels.catalog import Backend, Requirements
    from megacpp.kernels.ops.linear_cross_entropy.reference import linear_cross_entropy_reference
    from megacpp.kernels.registry import default_catalog
    from megacpp.kernels.runtime import resolve

    fallback = default_catalog().of("linear_cross_entropy", "fallback")[0]
    as_fused = Backend("reference_as_fused", "linear_cross_entropy", "chosen", Requirements(),
                       linear_cross_entropy_reference)

    def pick(surface, like):
        if surface != "linear_cross_entropy":
            return resolve(surface, like)
        return as_fused if fused and like.device.type == "cpu" else (
            resolve(surface, like) if fused else fallback)

    monkeypatch.setattr(model_module, "resolve", pick)


def _labels_with_ignored_ends(ids):
    labels = next_token_labels(ids)  # the last position is ignored
    labels[:, :2] = IGNORE_INDEX  # and the first two: every depth has ignored targets at both ends
    return labels


@pytest.mark.parametrize("depth", [1, 2])
def test_fused_mtp_loss_builds_no_logits_and_matches_the_logits_path(monkeypatch, depth):
    """Loss and gradients (hidden states in, head weight, MTP and main parameters) from the
    fused path equal the logits path's in float32; the fused forward never calls the head."""
    model = _model(_cfg(depth=depth, mtp_pattern="A:mla E"), torch.float32).train()
    ids = _tokens(2, 16)
    labels = _labels_with_ignored_ends(ids)
    results = {}
    for fused in (False, True):
        _head_loss_backend(monkeypatch, fused)
        if fused:  # no [B, L, V] logits anywhere: the head's matmul is never run
            monkeypatch.setattr(HybridLM, "logits", _no_logits)
        model.zero_grad()
        x = model.residual_stream(ids).detach().requires_grad_()  # the MTP modules' input
        normed = model.mtp(x, ids, None, model.embed)
        mtp_loss, mtp_logits = model.mtp.loss(normed, labels, IGNORE_INDEX, model.lm_loss)
        assert (mtp_logits is None) == fused
        mtp_loss.backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters()
                 if n.startswith(("mtp.", "embed.")) and p.grad is not None}
        out = model(ids, labels=labels)  # the whole model's outputs on the same path
        assert (out.mtp_logits is None) == fused and (out.logits is None) == fused
        results[fused] = (mtp_loss.detach(), x.grad, grads, out.mtp_loss.detach(), out.loss)
    (loss, dx, grads, out_mtp, out_loss), (f_loss, f_dx, f_grads, f_out_mtp, f_out_loss) = (
        results[False], results[True])
    assert torch.isfinite(loss) and loss > 0
    torch.testing.assert_close(f_loss, loss)
    torch.testing.assert_close(f_out_mtp, out_mtp)
    torch.testing.assert_close(f_out_loss.detach(), out_loss.detach())
    torch.testing.assert_close(f_dx, dx)
    assert "embed.weight" in grads and any(n.startswith(f"mtp.depths.{depth - 1}.") for n in grads)
    assert f_grads.keys() == grads.keys()
    for name, grad in grads.items():
        torch.testing.assert_close(f_grads[name], grad, msg=name)


def _no_logits(self, h):
    raise AssertionError("the fused loss path built logits")


def test_without_labels_the_mtp_logits_are_returned_whatever_the_loss_backend(monkeypatch):
    model = _model(_cfg(depth=2))
    ids = _tokens(1, 10)
    reference = model(ids).mtp_logits
    _head_loss_backend(monkeypatch, fused=True)
    drafts = model(ids).mtp_logits
    assert [t.shape for t in drafts] == [(1, 10, V), (1, 10, V)]
    for a, b in zip(drafts, reference, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.gpu
@pytest.mark.parametrize("depth", [1, 2])
def test_fused_mtp_loss_on_cuda_bf16_matches_the_logits_path(monkeypatch, depth):
    """The catalog's fused linear cross-entropy (Triton) for the main and the MTP losses of a
    bf16 model against the logits path, every other surface as ``auto`` chose it."""
    from megacpp.kernels.runtime import chosen_kernels, kernel_mode_override

    cfg = ModelConfig.from_dict({
        "model": {"pattern": "AE", "vocab_size": 4096, "d_model": 256},
        "attention": {"n_heads": 4, "n_kv_heads": 4, "head_dim": 64},
        "mtp": {"depth": depth, "pattern": "AE"}})
    torch.manual_seed(0)
    model = HybridLM(cfg).cuda().bfloat16().train()
    ids = torch.randint(0, 4096, (2, 256), device="cuda")
    labels = _labels_with_ignored_ends(ids)
    mtp_params = [p for n, p in model.named_parameters() if n.startswith("mtp.")]
    results = {}
    with kernel_mode_override("auto"):
        for fused in (False, True):
            _head_loss_backend(monkeypatch, fused)
            out = model(ids, labels=labels)
            assert (out.mtp_logits is None) == fused
            grads = torch.autograd.grad(out.mtp_loss, [model.embed.weight, *mtp_params])
            results[fused] = (out.mtp_loss.float(), [g.float() for g in grads])
        assert chosen_kernels()["linear_cross_entropy"] == "triton_chunked"
    (ref_loss, ref_grads), (loss, grads) = results[False], results[True]
    assert abs(loss - ref_loss) / ref_loss < 1e-2
    for g, r in zip(grads, ref_grads, strict=True):
        assert ((g - r).norm() / r.norm()).item() < 5e-2
