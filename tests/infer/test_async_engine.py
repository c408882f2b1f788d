"""AsyncEngine over the real Engine (tiny preset): outputs equal the synchronous engine's,
groups are admitted whole, QueueFull surfaces at submit, cancelled consumers abort, shutdown
ends every stream."""

from __future__ import annotations

import asyncio

import pytest

from megacpp.errors import MegaCppError
from megacpp.infer.async_engine import AsyncEngine, EngineStopped
from megacpp.infer.engine import Engine, EngineConfig, QueueFull
from megacpp.infer.sampling import SamplingParams
from tests.infer.server_helpers import tiny_model, tiny_tokenizer

GREEDY = SamplingParams(temperature=0, max_new_tokens=10)
LONG = SamplingParams(temperature=0, max_new_tokens=400, ignore_eos=True)


pytestmark = pytest.mark.usefixtures("one_thread")


def make_engine(**config) -> Engine:
    tok = tiny_tokenizer()
    return Engine(tiny_model(tok.vocab_size), tok,
                  EngineConfig(**{"max_num_seqs": 4, "max_model_len": 512, **config}))


def run_sync(engine: Engine, prompts: list[str], params: SamplingParams) -> dict[str, list[int]]:
    tokens: dict[str, list[int]] = {}
    for i, p in enumerate(prompts):
        engine.add_request(f"s{i}", p, params)
    while engine.has_unfinished():
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
    return {rid.replace("s", "a", 1): ids for rid, ids in tokens.items()}


async def collect(stream) -> dict[str, list]:
    outs: dict[str, list] = {}
    async for out in stream:
        outs.setdefault(out.request_id, []).append(out)
    return outs


async def wait_idle(engine: AsyncEngine, timeout: float = 10.0):
    for _ in range(int(timeout / 0.01)):
        s = engine.stats
        if s.running == s.waiting == 0 and s.free_blocks == s.total_blocks and \
                s.free_slots == s.total_slots:
            return s
        await asyncio.sleep(0.01)
    raise AssertionError(f"not idle: {engine.stats}")


def test_outputs_equal_the_synchronous_engine_and_groups_are_whole():
    prompts = ["int main() {", "template <class T> struct S {", "#include <vector>\n"]
    expected = run_sync(make_engine(), prompts, GREEDY)

    async def main():
        engine = AsyncEngine(make_engine(), "t")
        engine.start()
        try:
            stream = await engine.submit([(f"a{i}", p, GREEDY) for i, p in enumerate(prompts)])
            outs = await collect(stream)
            got = {rid: [t for o in seq for t in o.new_token_ids] for rid, seq in outs.items()}
            assert got == expected
            assert all(seq[-1].finished and not any(o.finished for o in seq[:-1])
                       for seq in outs.values())
            async for out in engine.generate("single", prompts[0], GREEDY):
                assert out.request_id == "single"
            # a group with one bad request is refused whole: nothing of it stays queued
            with pytest.raises(MegaCppError, match="empty"):
                await engine.submit([("ok", "int x;", LONG), ("bad", [], GREEDY)])
            idle = await wait_idle(engine)
            assert idle.generated_tokens == sum(map(len, expected.values())) + \
                len(expected["a0"])
        finally:
            await engine.shutdown()

    asyncio.run(main())


def test_queue_full_at_submit_and_cancel_frees_the_slot():
    async def main():
        engine = AsyncEngine(make_engine(max_num_seqs=1, max_waiting=1), "t")
        engine.start()
        try:
            running = await engine.submit([("r", "int main() {", LONG)])
            outputs = aiter(running)  # kept: a dropped iterator closes (aborts) its stream
            first = await anext(outputs)
            assert first.request_id == "r"
            waiting = await engine.submit([("w", "int f() {", LONG)])
            with pytest.raises(QueueFull):
                await engine.submit([("x", "int g() {", LONG)])
            consumer = asyncio.ensure_future(collect(waiting))
            await asyncio.sleep(0.05)
            consumer.cancel()  # a cancelled consumer (a client that went away) aborts
            with pytest.raises(asyncio.CancelledError):
                await consumer
            running.close()
            idle = await wait_idle(engine)
            assert idle.generated_tokens < 2 * LONG.max_new_tokens
        finally:
            await engine.shutdown()

    asyncio.run(main())


def test_shutdown_ends_open_streams_and_refuses_new_work():
    async def main():
        engine = AsyncEngine(make_engine(), "t")
        engine.start()
        stream = await engine.submit([("r", "int main() {", LONG)])
        consumer = asyncio.ensure_future(collect(stream))
        await asyncio.sleep(0.05)
        await engine.shutdown()
        with pytest.raises(EngineStopped):
            await consumer
        assert not engine.running
        with pytest.raises(EngineStopped):
            await engine.submit([("late", "x", GREEDY)])
        s = engine.engine.stats()
        assert s.running == s.waiting == 0 and s.free_blocks == s.total_blocks

    asyncio.run(main())
