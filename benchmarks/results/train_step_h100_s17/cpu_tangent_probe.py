"""CPU, Triton interpreter: which tangent copies does a compiled GroupedQueryAttention's
backward make around the (eager, fused) QK-norm? Prints the backward's copy / clone ops.
    TRITON_INTERPRET=1 PYTHONPATH=<triton>:src:. python benchmarks/results/train_step_h100_s17/cpu_tangent_probe.py
"""
import types

import torch

from tests.kernels.interpreter import patch_scalar_index

patch_scalar_index()
import megacpp.model.norm as norm_mod
from megacpp.kernels.ops.rmsnorm.triton import rmsnorm_triton
from megacpp.model.attention import GroupedQueryAttention

fast = types.SimpleNamespace(role="chosen", fn=torch.compiler.disable(rmsnorm_triton))
norm_mod.resolve = lambda surface, like: fast
torch.manual_seed(0)
B, L, D = 2, 32, 128
attn = GroupedQueryAttention(D, n_heads=4, n_kv_heads=2, head_dim=32)
step = torch.compile(lambda x: attn(x))
x = torch.randn(B, L, D, requires_grad=True)
for i in range(2):
    y = step(x)
    if i == 1:
        with torch.profiler.profile(record_shapes=True) as p:
            y.backward(torch.randn_like(y))
    else:
        y.backward(torch.randn_like(y))
for e in p.key_averages(group_by_input_shape=True):
    if any(s in e.key for s in ("copy", "clone", "contiguous", "cpp_fused", "Compiled", "Backward")):
        print(e.count, e.key, e.input_shapes)
