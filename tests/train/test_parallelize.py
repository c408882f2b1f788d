"""Regional compile on CPU: a compiled block against eager, forward and backward; every
block kind compiled through training and validation within Dynamo's recompile limit."""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.exc import FailOnRecompileLimitHit

from megacpp.model.config import ModelConfig, load_config
from megacpp.model.model import HybridLM
from megacpp.train.parallelize import compile_blocks


def test_compiled_mamba_block_matches_eager() -> None:
    """The M block as the trainer compiles it (``block.compile()``): its in_proj split, the
    gates' autograd.Function and the scan, traced by Dynamo; forward and backward."""
    torch.manual_seed(0)
    cfg = ModelConfig.from_dict({"model": {"pattern": "M", "vocab_size": 64, "d_model": 64},
                                 "mamba": {"d_state": 16, "headdim": 16, "chunk_size": 8}})
    block = HybridLM(cfg).blocks[0]
    x = torch.randn(2, 24, 64, requires_grad=True)
    eager = block(x)
    eager_grads = torch.autograd.grad(eager.square().sum(), [x, block.mixer.dt_bias])
    block.compile()
    out = block(x)
    grads = torch.autograd.grad(out.square().sum(), [x, block.mixer.dt_bias])
    torch.testing.assert_close(out, eager, rtol=1e-4, atol=1e-5)
    for got, want in zip(grads, eager_grads):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


def _train_validate_train(model: HybridLM) -> None:
    """What a run does to its compiled blocks: steps, a validation (eval, no_grad), steps."""
    ids = torch.randint(0, model.cfg.vocab_size, (1, 48))
    doc_ids = (torch.arange(48) >= 20).long().unsqueeze(0)  # two documents
    model(ids, doc_ids=doc_ids, labels=ids).lm_loss.backward()
    model.eval()
    with torch.no_grad():
        model(ids, doc_ids=doc_ids, labels=ids)
    model.train()
    model(ids, doc_ids=doc_ids, labels=ids).lm_loss.backward()


def test_compiled_blocks_stay_compiled_through_validation() -> None:
    """Every block kind of the tiny hybrid (A, E, M, R), trained and validated: all compiled
    variants fit under the recompile limit ``compile_blocks`` sets (Dynamo raises instead of
    falling back to eager here). Blocks compiled one by one under Dynamo's default limit of 8
    do hit it (nam56r-350m runs on an H100 warned of it in their final validation).
    Dynamo's ``eager`` backend: the guards and variants are Dynamo's, whatever the backend."""
    cfg = load_config("tiny")
    for raise_limit, fails in ((True, False), (False, True)):
        torch._dynamo.reset()
        torch.manual_seed(0)
        model = HybridLM(cfg)
        with torch._dynamo.config.patch(recompile_limit=8, fail_on_recompile_limit_hit=True):
            if raise_limit:
                compile_blocks(model, backend="eager")
                assert torch._dynamo.config.recompile_limit == 4 * (len(set(cfg.pattern)) + 1)
            else:
                for block in model.blocks:
                    block.compile(backend="eager")
            if fails:
                with pytest.raises(FailOnRecompileLimitHit):
                    _train_validate_train(model)
            else:
                _train_validate_train(model)
    torch._dynamo.reset()


def test_flat_reducer_gradients_are_views_that_accumulate_and_zero() -> None:
    """The flat buffer holds every gradient: backward accumulates into it across
    micro-batches, ``zero`` clears it without reallocating, and with one rank ``reduce``
    leaves it as it is (the sum over two ranks runs under gloo in
    tests/train/test_distributed.py)."""
    from megacpp.train.parallelize import FlatGradReducer

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    reference = [p.detach().clone().requires_grad_() for p in model.parameters()]
    reducer = FlatGradReducer(list(model.parameters()), world_size=1)
    x = torch.randn(5, 4)

    def loss(weights, inputs):
        h = inputs @ weights[0].T + weights[1]
        return (h @ weights[2].T + weights[3]).square().sum()

    for _ in range(2):  # two steps of two micro-batches
        reducer.zero()
        for chunk in x.split(3):
            model(chunk).square().sum().backward()
        reducer.reduce()
        for ref in reference:
            ref.grad = None
        for chunk in x.split(3):
            loss(reference, chunk).backward()
        for p, ref in zip(model.parameters(), reference, strict=True):
            assert p.grad.data_ptr() >= reducer.flat.data_ptr()  # a view into the buffer
            torch.testing.assert_close(p.grad, ref.grad)
    assert reducer.nbytes == 4 * sum(p.numel() for p in model.parameters())


def test_flat_reducer_needs_one_dtype() -> None:
    from megacpp.errors import ConfigError
    from megacpp.train.parallelize import FlatGradReducer

    params = [torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(2).double())]
    with pytest.raises(ConfigError, match="parameters of one dtype"):
        FlatGradReducer(params, world_size=2)


def test_flat_reducer_starts_its_buckets_during_backward_in_order(tmp_path) -> None:
    """Hooked on a process group (one gloo rank standing in for several), every bucket is
    started by the hooks while backward runs, in bucket order, and ``reduce`` only waits."""
    import torch.distributed as dist

    from megacpp.train.parallelize import FlatGradReducer

    dist.init_process_group("gloo", rank=0, world_size=1,
                            init_method=f"file://{tmp_path / 'rendezvous'}")
    try:
        torch.manual_seed(0)
        model = torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(4)])
        reducer = FlatGradReducer(list(model.parameters()), world_size=2, bucket_bytes=300)
        assert len(reducer.buckets) >= 3 and reducer.buckets[0][0] == 0
        assert reducer.buckets[-1][1] == reducer.flat.numel()
        # the last layer's gradients (computed first in backward) lead the buffer
        assert reducer.bucket_of[-1] == 0 and reducer.bucket_of[0] == len(reducer.buckets) - 1
        started = []
        original = dist.all_reduce

        def record(tensor, *args, **kwargs):
            started.append(tensor.data_ptr())
            return original(tensor, *args, **kwargs)

        dist.all_reduce = record
        try:
            reducer.zero()
            reducer.arm()
            x = torch.randn(3, 8)
            model(x).sum().backward()
            assert reducer._next == len(reducer.buckets)  # all started inside backward
            reducer.reduce()
        finally:
            dist.all_reduce = original
        offsets = [reducer.flat[start:].data_ptr() for start, _ in reducer.buckets]
        assert started == offsets
        expected = torch.autograd.grad(model(x).sum(), list(model.parameters()))
        for p, grad in zip(model.parameters(), expected, strict=True):
            torch.testing.assert_close(p.grad, grad)
    finally:
        dist.destroy_process_group()
