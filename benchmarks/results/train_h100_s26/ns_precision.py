"""CPU check behind the README's Newton-Schulz precision figures: relative Frobenius error,
against the float64 quintic, of three bf16 forms of the iteration (op by op, as session 25 ran
it; both scale-and-adds as baddbmm epilogues; the kept form, a I added to the polynomial's
diagonal), and the kept form in float64. Prints one line per matrix shape.

    PYTHONPATH=src python benchmarks/results/train_h100_s26/ns_precision.py
"""

import torch

from megacpp.train.optim import NS_COEFFS, newton_schulz

A, B, C = NS_COEFFS


def normalized(g, dtype):
    x = g.to(dtype)
    wide = x.shape[-2] <= x.shape[-1]
    x = x if wide else x.mT
    return (x / (x.norm(dim=(-2, -1), keepdim=True) + 1e-7)).reshape(-1, *x.shape[-2:]), wide


def op_by_op(g, dtype):
    x, wide = normalized(g, dtype)
    for _ in range(5):
        gram = x @ x.mT
        x = A * x + (B * gram + C * (gram @ gram)) @ x
    return x if wide else x.mT


def epilogue(g, dtype):
    x, wide = normalized(g, dtype)
    for _ in range(5):
        gram = torch.bmm(x, x.mT)
        x = torch.baddbmm(x, torch.baddbmm(gram, gram, gram, beta=B, alpha=C), x, beta=A)
    return x if wide else x.mT


for shape in [(6, 96, 64), (6, 64, 96), (1, 128, 128), (8, 272, 768)]:
    g = torch.randn(shape, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    exact = op_by_op(g, torch.float64).reshape(shape)

    def rel(x, shape=shape, exact=exact):
        return ((x.double().reshape(shape) - exact).norm() / exact.norm()).item()

    print(shape, f"op-by-op bf16 {rel(op_by_op(g, torch.bfloat16)):.4f}",
          f"epilogue bf16 {rel(epilogue(g, torch.bfloat16)):.4f}",
          f"kept bf16 {rel(newton_schulz(g.float(), 5, torch.bfloat16)):.4f}",
          f"kept float64 {rel(newton_schulz(g, 5, torch.float64)):.1e}")
