"""The scheduler / model-runner seam: what ``Scheduler.schedule()`` hands the runner (tokens,
positions, block tables, state slots, where to sample), what ``ModelRunner.execute()`` gives
back, and how ``Engine.update_from_output`` applies it."""

from __future__ import annotations

from megacpp.infer.model_runner import ModelRunnerOutput
from megacpp.infer.scheduler import SchedulerOutput
from tests.infer.test_engine import GREEDY, _engine, _prompts, tiny_model  # noqa: F401


def test_one_round_through_the_seam(tiny_model, tokenizer):  # noqa: F811
    engine = _engine(tiny_model, tokenizer, prefill_chunk=8)  # block_size 4
    a, b = _prompts(tiny_model.cfg.vocab_size, (5, 11))
    engine.add_request("a", a, GREEDY)
    engine.add_request("b", b, GREEDY)

    first = engine.scheduler.schedule()
    assert isinstance(first, SchedulerOutput) and not first.decodes and not first.preempted
    pa, pb = first.prefills
    assert (pa.request_id, pa.token_ids, pa.start, pa.end, pa.sample) == ("a", a, 0, 5, True)
    assert (pb.request_id, pb.token_ids, pb.start, pb.sample) == ("b", b[:3], 0, False)
    assert pa.block_table == engine.cache.tables["a"] and len(pa.block_table) == 2
    assert len(pb.block_table) == 1 and pa.state_slot != pb.state_slot
    assert pa.state_slot == engine.cache.slot_of["a"]

    result = engine.runner.execute(first)
    assert isinstance(result, ModelRunnerOutput)
    assert result.request_ids == ["a"]  # b's prompt is not finished: nothing sampled for it
    outputs = engine.update_from_output(first, result)
    assert [(o.request_id, o.new_token_ids) for o in outputs] == [("a", result.sampled_token_ids)]
    seqs = engine.sequences
    assert (seqs["a"].num_computed, seqs["b"].num_computed) == (5, 3)
    assert seqs["a"].token_ids == [*a, *result.sampled_token_ids]

    second = engine.scheduler.schedule()
    (da,) = second.decodes
    assert (da.token_ids, da.start, da.end, da.sample) == (result.sampled_token_ids, 5, 6, True)
    (pb,) = second.prefills
    assert (pb.token_ids, pb.start, pb.end, pb.sample) == (b[3:], 3, 11, True)
    assert len(pb.block_table) == 3
    result = engine.runner.execute(second)
    assert result.request_ids == ["b", "a"]  # prefills sample first, then the decodes
    engine.update_from_output(second, result)
    assert (seqs["a"].num_computed, seqs["b"].num_computed) == (6, 11)


def test_preempted_ids_are_reported_and_leave_the_round(tiny_model, tokenizer):  # noqa: F811
    engine = _engine(tiny_model, tokenizer, num_blocks=6, max_model_len=24, prefill_chunk=16)
    for i, prompt in enumerate(_prompts(tiny_model.cfg.vocab_size, (9, 7, 5))):
        engine.add_request(str(i), prompt, GREEDY)
    preempted = []
    while engine.has_unfinished():
        scheduled = engine.scheduler.schedule()
        ran = {r.request_id for r in (*scheduled.prefills, *scheduled.decodes)}
        assert not ran & set(scheduled.preempted)
        waiting = {s.request_id for s in engine.scheduler.waiting}
        for rid in scheduled.preempted:
            assert rid in waiting and rid not in engine.cache.tables
            assert engine.sequences[rid].num_computed == 0
        preempted += scheduled.preempted
        engine.update_from_output(scheduled, engine.runner.execute(scheduled))
    assert preempted and engine.stats().preemptions == len(preempted)
