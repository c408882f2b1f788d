"""recompute_in_backward: the gradients of a plain call (under autocast too, through
torch.autograd.grad and .backward), only the inputs saved, nested recomputes run once; and
saved_tensor_bytes' counting."""

from __future__ import annotations

import torch

from megacpp.kernels.recompute import recompute_in_backward, saved_tensor_bytes


def _fn(a: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> tuple[torch.Tensor, ...]:
    h = torch.tanh(a @ w)  # under autocast: a bf16 matmul
    if bias is not None:
        h = h + bias.to(h.dtype)
    return h.float().square(), h.sum(-1)


def _leaves(seed: int = 0) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(6, 5, generator=g).requires_grad_()
    w = torch.randn(5, 7, generator=g).requires_grad_()
    bias = torch.randn(7, generator=g)  # needs no gradient
    return a, w, bias


def test_gradients_equal_a_plain_call_under_autocast() -> None:
    """The replay runs under the forward's autocast state: the same bf16 matmul, so the same
    values and gradients bit for bit."""
    results = []
    for call in (lambda *t: _fn(*t), lambda *t: recompute_in_backward(_fn, *t)):
        a, w, bias = _leaves()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            sq, total = call(a, w, bias)
        grads = torch.autograd.grad(sq.sum() + 3 * total.float().sum(), (a, w))
        results.append((sq, total, *grads))
    assert results[0][1].dtype == torch.bfloat16  # autocast reached the matmul
    for plain, recomputed in zip(*results, strict=True):
        assert torch.equal(plain, recomputed)


def test_backward_with_unused_outputs_and_none_inputs() -> None:
    a, w, _ = _leaves(1)
    sq, _total = recompute_in_backward(_fn, a, w, None)
    sq.sum().backward()  # .backward() too, and one output without a gradient
    a2, w2 = a.detach().requires_grad_(), w.detach().requires_grad_()
    _fn(a2, w2, None)[0].sum().backward()
    torch.testing.assert_close(a.grad, a2.grad, rtol=0, atol=0)
    torch.testing.assert_close(w.grad, w2.grad, rtol=0, atol=0)


def test_only_the_inputs_are_saved_and_a_plain_call_without_grad() -> None:
    a, w, bias = _leaves(2)
    with saved_tensor_bytes() as plain:
        _fn(a, w, bias)
    with saved_tensor_bytes() as recomputed:
        recompute_in_backward(_fn, a, w, bias)
    inputs = sum(t.untyped_storage().nbytes() for t in (a, w, bias))
    assert recomputed == {"bytes": inputs, "tensors": 3}
    assert plain["bytes"] > inputs  # the plain call keeps its intermediates
    with torch.no_grad(), saved_tensor_bytes() as none:
        out = recompute_in_backward(_fn, a, w, bias)
    assert none == {"bytes": 0, "tensors": 0} and out[0].grad_fn is None


def test_a_nested_recompute_runs_once_per_pass() -> None:
    """Inside the outer replay the inner call is plain: fn runs once in forward and once in
    backward, not twice there."""
    calls = []

    def inner(a, w, bias):
        calls.append("inner")
        return _fn(a, w, bias)

    def outer(a, w, bias):
        return (recompute_in_backward(inner, a, w, bias)[0] * 2,)

    a, w, bias = _leaves(3)
    (y,) = recompute_in_backward(outer, a, w, bias)
    y.sum().backward()
    assert calls == ["inner", "inner"]
    a2, w2 = a.detach().requires_grad_(), w.detach().requires_grad_()
    (_fn(a2, w2, bias)[0] * 2).sum().backward()
    torch.testing.assert_close(a.grad, a2.grad, rtol=0, atol=0)


def test_saved_tensor_bytes_counts_each_storage_once_and_skips_excluded() -> None:
    x = torch.randn(4, 8).requires_grad_()
    w = torch.randn(8, 8).requires_grad_()
    with saved_tensor_bytes(exclude=(w,)) as counted:
        h = x @ w  # saves x and w
        h[:, :4] * h[:, 4:]  # saves two views of h: one storage
    assert counted == {"bytes": x.untyped_storage().nbytes() + h.untyped_storage().nbytes(),
                       "tensors": 2}
