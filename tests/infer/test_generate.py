from __future__ import annotations

import pytest
import torch

from megacpp.errors import MegaCppError
from megacpp.infer.generate import CPP_BODY_STOP, FunctionBodyGenerator, TextGenerator
from megacpp.infer.sampling import SamplingParams, sample_next_token
from megacpp.model.model import HybridLM
from tests.model.conftest import small_config


@pytest.fixture(scope="module")
def generator(tokenizer) -> TextGenerator:
    torch.manual_seed(0)
    model = HybridLM(small_config("AEMR", vocab_size=tokenizer.vocab_size))
    return TextGenerator(model, tokenizer)


def test_greedy_is_argmax_and_filters_restrict_support():
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.0]])
    assert sample_next_token(logits, SamplingParams(temperature=0)).tolist() == [1]
    g = torch.Generator().manual_seed(0)
    top1 = {sample_next_token(logits, SamplingParams(top_k=1), g).item() for _ in range(50)}
    assert top1 == {1}
    # probs ~ [.03, .64, .09, .24]: top_p=0.8 keeps exactly {1, 3}
    nucleus = {sample_next_token(logits, SamplingParams(top_p=0.8), g).item() for _ in range(300)}
    assert nucleus == {1, 3}
    full = {sample_next_token(logits, SamplingParams(), g).item() for _ in range(300)}
    assert full == {0, 1, 2, 3}


@pytest.mark.parametrize("bad", [{"temperature": -1}, {"top_p": 0}, {"top_k": -2},
                                 {"max_new_tokens": 0}, {"stop": ("",)}])
def test_bad_sampling_params_are_clear_errors(bad):
    with pytest.raises(MegaCppError):
        SamplingParams(**bad)


def test_greedy_generation_equals_full_forward_argmax(generator, tokenizer):
    params = SamplingParams(temperature=0, max_new_tokens=12)
    (c,) = generator.complete("int main() {", 1, params)
    prompt = [tokenizer.bos_id, *tokenizer.encode("int main() {").tolist()]
    seq = torch.tensor([prompt + c.token_ids])
    with torch.no_grad():
        logits = generator.model(seq[:, :-1]).logits[0, len(prompt) - 1 :]
    if c.finish_reason == "length":
        assert c.token_ids == logits.argmax(-1).tolist()
    else:  # stopped at EOS: the prefix up to it still matches
        assert c.token_ids == logits.argmax(-1).tolist()[: len(c.token_ids)]


def test_seeded_sampling_is_reproducible_and_batch_rows_differ(generator):
    params = SamplingParams(temperature=1.0, max_new_tokens=16, seed=7)
    a = generator.complete("template <class T>", 4, params)
    b = generator.complete("template <class T>", 4, params)
    assert [c.token_ids for c in a] == [c.token_ids for c in b]
    assert len({tuple(c.token_ids) for c in a}) > 1


def test_stop_sequences_cut_the_text(generator, tokenizer):
    params = SamplingParams(temperature=1.0, max_new_tokens=40, seed=1)
    free = generator.complete("x", 1, params)[0].text
    assert len(free) > 2
    stop = free[1:3]  # a string the same seeded sample is known to produce
    cut = generator.complete("x", 1, SamplingParams(temperature=1.0, max_new_tokens=40, seed=1,
                                                     stop=(stop,)))[0]
    assert cut.finish_reason == "stop" and cut.stop == stop
    assert stop not in cut.text and free.startswith(cut.text)


def test_function_body_generator_puts_the_closing_brace_back(generator):
    body = FunctionBodyGenerator(generator, max_new_tokens=24)
    out = body(["int f(int x){\n"], n=3, temperature=1.0, seed=3)
    assert len(out) == 1 and len(out[0]) == 3
    completions = generator.complete("int f(int x){\n", 3, SamplingParams(
        temperature=1.0, max_new_tokens=24, seed=3, stop=(CPP_BODY_STOP,)))
    for text, c in zip(out[0], completions, strict=True):
        if c.finish_reason == "stop":  # the brace that ended the body is put back, once
            assert text == c.text + CPP_BODY_STOP + "\n" and CPP_BODY_STOP not in c.text
        else:
            assert text == c.text


def test_prompts_batched_together_equal_each_alone(tokenizer):
    """complete_all runs every prompt's samples in one engine; in float64 each completion
    equals the same prompt completed alone (sample j seeded seed + j either way)."""
    torch.manual_seed(0)
    model = HybridLM(small_config("AEMR", vocab_size=tokenizer.vocab_size)).double()
    generator = TextGenerator(model, tokenizer, max_num_seqs=4)
    prompts = ["int main() {", "template <class T>", "x"]
    for params in (SamplingParams(temperature=0, max_new_tokens=10),
                   SamplingParams(temperature=1.0, max_new_tokens=10, seed=11)):
        together = generator.complete_all(prompts, 3, params)
        alone = [generator.complete(p, 3, params) for p in prompts]
        assert together == alone
    assert [c.token_ids for c in alone[0]] != [alone[0][0].token_ids] * 3  # samples differ
