from __future__ import annotations

import torch
import torch.nn.functional as F

from megacpp.kernels.ops.moe_experts.reference import moe_experts_reference
from megacpp.model.moe import MoE


def _dense_loop(x, idx, w, w_in, w_out):
    """The most literal definition: for each token, for each choice, run that expert."""
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(idx.shape[1]):
            e = idx[t, j]
            gate, up = (w_in[e] @ x[t]).chunk(2)
            out[t] += w[t, j] * (w_out[e] @ (F.silu(gate) * up))
    return out


def test_reference_dispatch_matches_per_token_definition():
    g = torch.Generator().manual_seed(0)
    T, D, F_, E, k = 37, 16, 24, 6, 2
    x = torch.randn(T, D, generator=g, dtype=torch.float64)
    idx = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
    w = torch.rand(T, k, generator=g, dtype=torch.float64)
    w_in = torch.randn(E, 2 * F_, D, generator=g, dtype=torch.float64)
    w_out = torch.randn(E, D, F_, generator=g, dtype=torch.float64)
    got = moe_experts_reference(x, idx, w, w_in, w_out)
    torch.testing.assert_close(got, _dense_loop(x, idx, w, w_in, w_out), rtol=1e-12, atol=1e-12)


def test_moe_weights_normalized_and_gradients_flow():
    torch.manual_seed(0)
    moe = MoE(
        d_model=32, n_experts=8, top_k=2, expert_ffn=16, n_shared_experts=1, seq_aux_loss_coef=0.01
    )
    moe.train()
    x = torch.randn(2, 10, 32, requires_grad=True)
    y = moe(x)
    assert y.shape == x.shape
    assert moe.aux_loss is not None and moe.aux_loss.item() > 0
    (y.square().mean() + moe.aux_loss).backward()
    for name, p in moe.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, name
    assert moe.last_load.sum().item() == 2 * 10 * 2  # dropless: every token reaches k experts
    # the per-expert load is the chosen experts' histogram (experts chosen by no token: 0)
    _, idx, _ = moe.route(x.detach().reshape(-1, 32))
    torch.testing.assert_close(moe.last_load, torch.bincount(idx.reshape(-1), minlength=8).float(),
                               rtol=0, atol=0)
    assert moe._load(torch.tensor([[7, 7], [7, 0]])).tolist() == [1, 0, 0, 0, 0, 0, 0, 3]
    # summed over 64 row chunks (T * k a multiple of 64), else in one
    for tokens, k in ((4096, 2), (21, 3), (1, 1)):
        ids = torch.randint(0, 8, (tokens, k))
        want = torch.bincount(ids.reshape(-1), minlength=8).float()
        torch.testing.assert_close(moe._load(ids), want, rtol=0, atol=0)


def test_forward_is_router_plus_experts_plus_shared_swiglu_with_its_gradients():
    """The one GEMM over the stacked router / shared in_proj weights is the two modules run
    apart (the definition): same output, same gradient for every parameter and the input."""
    torch.manual_seed(0)
    moe = MoE(d_model=24, n_experts=6, top_k=2, expert_ffn=8, n_shared_experts=2).double()
    moe.eval()  # no load statistics
    x = torch.randn(3, 7, 24, dtype=torch.float64, requires_grad=True)
    (moe(x) * torch.linspace(-1, 1, 24, dtype=torch.float64)).sum().backward()
    got = [x.grad] + [p.grad for p in moe.parameters()]

    x.grad = None
    moe.zero_grad(set_to_none=True)
    tokens = x.reshape(-1, 24)
    logits = moe.router(tokens)  # the router and the shared SwiGLU as separate modules
    _, idx, w = moe.choose(logits)
    want_y = moe_experts_reference(tokens, idx, w, moe.w_in, moe.out_proj) + moe.shared(tokens)
    (want_y.view(3, 7, 24) * torch.linspace(-1, 1, 24, dtype=torch.float64)).sum().backward()
    want = [x.grad] + [p.grad for p in moe.parameters()]
    assert moe.shared.in_proj.weight.grad.abs().sum() > 0 and moe.router.weight.grad.abs().sum() > 0
    for (name, _), a, b in zip([("x", None), *moe.named_parameters()], got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12, msg=name)


def test_bias_balancing_moves_skewed_load_toward_uniform():
    """A router skewed toward expert 0..1 becomes balanced by the selection bias alone."""
    torch.manual_seed(0)
    E, k = 8, 2
    moe = MoE(
        d_model=16, n_experts=E, top_k=k, expert_ffn=8, n_shared_experts=0, bias_update_rate=0.005
    )
    with torch.no_grad():
        moe.router.weight.normal_(std=0.1)
        moe.router.weight[:2] += 0.3  # skew: experts 0, 1 score higher for positive inputs
    moe.train()
    x = torch.randn(4, 64, 16).abs()  # positive inputs so the skew is consistent

    def imbalance() -> float:  # max/mean of per-expert token counts
        with torch.no_grad():
            moe(x)
        return moe.load_balance()

    before = imbalance()
    recent = []
    for _ in range(300):
        recent.append(imbalance())
        moe.update_bias()
    after = sum(recent[-50:]) / 50  # sign updates oscillate around balance: average them
    assert before > 3.0  # nearly all tokens on two of eight experts (max/mean = 4)
    assert after < 1.5, (before, after)
    # the bias is selection-only: it never enters the combine weights
    assert moe.expert_bias[:2].max() < 0 < moe.expert_bias[2:].max()


def test_router_picks_topk_and_breaks_ties_toward_the_lower_expert():
    """route(): the k largest of scores + bias in descending order (as topk without ties); tied
    values go to the lower expert index, whatever the number of tokens routed together."""
    torch.manual_seed(0)
    moe = MoE(d_model=16, n_experts=8, top_k=3, expert_ffn=8)
    tokens = torch.randn(50, 16)
    scores, idx, weights = moe.route(tokens)
    want = torch.topk(scores + moe.expert_bias, 3, dim=-1)
    assert torch.equal(idx, want.indices)
    assert torch.allclose(weights.sum(-1), torch.ones(50))
    with torch.no_grad():
        moe.router.weight.zero_()  # every score is sigmoid(0): all experts tie ...
        moe.expert_bias.copy_(torch.tensor([0.0, 0.2, 0.0, 0.1, 0.0, 0.2, 0.0, 0.0]))
    for n in (1, 7, 300):  # ... except through the bias
        _, idx, _ = moe.route(torch.randn(n, 16))
        assert idx.tolist() == [[1, 5, 3]] * n
