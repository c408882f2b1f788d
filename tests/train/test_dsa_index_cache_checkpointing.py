"""Activation checkpointing over DSA layers that share indices: the reusing layer's recompute
in backward finds the source's selection of the same step (no miss), and the gradients equal
those without checkpointing."""

from __future__ import annotations

import torch

from megacpp.model.model import HybridLM, next_token_labels
from megacpp.train.parallelize import apply_activation_checkpointing
from tests.model.test_dsa_index_cache import CUT13_DSA, _cut13


def _grads(checkpointed: bool) -> tuple[dict[str, torch.Tensor], list[int]]:
    torch.manual_seed(0)
    model = HybridLM(_cut13([-1, 3, 3])).double().train()
    if checkpointed:
        apply_activation_checkpointing(model, "AEMR")
    doc_ids = torch.tensor([[0] * 9 + [1] * 7, [0] * 16])
    for seed in (1, 2):  # two micro-batches: the second forward replaces the first's entries
        ids = torch.randint(0, 97, (2, 16), generator=torch.Generator().manual_seed(seed))
        model(ids, doc_ids=doc_ids, labels=next_token_labels(ids, doc_ids)).loss.backward()
    mixers = [getattr(b, "_checkpoint_wrapped_module", b).mixer for b in model.blocks]
    grads = {n.replace("_checkpoint_wrapped_module.", ""): p.grad
             for n, p in model.named_parameters()}
    return grads, [mixers[i].index_cache_misses for i in CUT13_DSA]


def test_checkpointed_reuse_recomputes_over_the_same_selection():
    plain, plain_misses = _grads(checkpointed=False)
    ckpt, ckpt_misses = _grads(checkpointed=True)
    assert plain_misses == ckpt_misses == [0, 0, 0]
    assert plain.keys() == ckpt.keys()
    for name, grad in plain.items():
        torch.testing.assert_close(ckpt[name], grad, rtol=1e-10, atol=1e-12, msg=name)


def test_compiled_blocks_share_indices_like_eager_blocks():
    """Regional compile (dynamo, eager backend): the cache writes and lookups inside the
    compiled DSA blocks run as in eager mode -- same loss and gradients, no miss."""
    from megacpp.train.parallelize import compile_blocks

    losses, grads = [], []
    for compiled in (False, True):
        torch.manual_seed(0)
        model = HybridLM(_cut13([-1, 3, 3])).train()
        if compiled:
            compile_blocks(model, backend="eager")
        ids = torch.randint(0, 97, (2, 16), generator=torch.Generator().manual_seed(1))
        loss = model(ids, labels=next_token_labels(ids)).loss
        loss.backward()
        losses.append(loss.detach())
        grads.append([p.grad for p in model.parameters()])
        mixers = [getattr(b, "_orig_mod", b).mixer for b in model.blocks]
        assert [mixers[i].index_cache_misses for i in CUT13_DSA] == [0, 0, 0]
    torch.testing.assert_close(losses[1], losses[0])
    for ours, ref in zip(*grads, strict=True):
        torch.testing.assert_close(ours, ref)
