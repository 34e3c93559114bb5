"""AsyncEngine: concurrent streams equal the offline engine; abort, overload, cancellation."""

import asyncio

import pytest
import torch

import qinfer
from qinfer.core.errors import EngineOverloadedError, RequestError
from qinfer.request.sampling import SamplingParams

GREEDY = SamplingParams(temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def model(qwen3_chat_folder):
    return qinfer.load_model(qwen3_chat_folder, dtype=torch.float32, device="cpu")


@pytest.fixture
def engine(model, qwen3_chat_folder):
    """An AsyncEngine that must end each test with every KV block free."""
    engine = qinfer.AsyncEngine(model, qwen3_chat_folder, block_size=4, max_num_seqs=4)
    yield engine
    engine.shutdown()
    stats = engine.engine.stats()
    assert stats.kv_blocks_used == 0 and stats.num_running == stats.num_waiting == 0, stats


async def collect(engine, prompt, params, request_id=None):
    return [out async for out in engine.generate(prompt, params, request_id)]


def test_concurrent_streams_equal_the_offline_engine(engine, model, qwen3_chat_folder):
    prompts = ["hello", [1, 2, 3, 4, 5, 6], [{"role": "user", "content": "hi"}]]
    params = [GREEDY.replace(max_tokens=n) for n in (5, 8, 6)]

    async def main():
        return await asyncio.gather(
            *(collect(engine, p, sp) for p, sp in zip(prompts, params, strict=True))
        )

    streams = asyncio.run(main())
    offline = qinfer.LLM(model, qwen3_chat_folder).generate(prompts, params, use_tqdm=False)
    for stream, want in zip(streams, offline, strict=True):
        assert [out.finished for out in stream] == [False] * (len(stream) - 1) + [True]
        assert sum((out.delta_token_ids for out in stream), []) == want.token_ids
        assert "".join(out.delta_text for out in stream) == want.text
        assert stream[-1].text == want.text and stream[-1].finish_reason == "length"


def test_abort_ends_the_stream_with_reason_abort(engine):
    async def main():
        outputs = []
        async for out in engine.generate([1, 2, 3], GREEDY.replace(max_tokens=200), "r1"):
            outputs.append(out)
            if len(outputs) == 2:
                engine.abort("r1")
        return outputs

    outputs = asyncio.run(main())
    assert outputs[-1].finished and outputs[-1].finish_reason == "abort"
    assert outputs[-1].num_generated_tokens < 200


def test_leaving_the_stream_early_aborts_the_request(engine):
    async def main():
        async for _ in engine.generate([1, 2, 3], GREEDY.replace(max_tokens=200), "r2"):
            break
        for _ in range(200):  # the step thread applies the abort asynchronously
            if engine.stats().requests_aborted_total == 1:
                return
            await asyncio.sleep(0.01)

    asyncio.run(main())
    assert engine.stats().requests_aborted_total == 1


def test_full_waiting_queue_refuses_with_overloaded(model):
    engine = qinfer.AsyncEngine(
        model, max_num_seqs=1, max_num_batched_tokens=8, max_waiting_requests=1
    )

    async def main():
        engine.add_request([1, 2, 3], GREEDY.replace(max_tokens=400), "running")
        while engine.stats().num_running == 0:
            await asyncio.sleep(0.01)
        engine.add_request([1, 2, 3], GREEDY.replace(max_tokens=2), "waiting")
        with pytest.raises(EngineOverloadedError, match="overloaded"):
            engine.add_request([1, 2, 3], GREEDY.replace(max_tokens=2), "refused")
        engine.abort("running")
        engine.abort("waiting")

    asyncio.run(main())
    engine.shutdown()
    assert engine.engine.stats().kv_blocks_used == 0


def test_bad_requests_raise_before_streaming(engine):
    async def main():
        with pytest.raises(RequestError, match="empty"):
            await collect(engine, "", GREEDY)
        await collect(engine, [1, 2], GREEDY.replace(max_tokens=2), "dup")
        (out,) = [o async for o in engine.generate([1], GREEDY.replace(max_tokens=1), "dup")]
        return out

    assert asyncio.run(main()).finished  # a finished id may be reused


def test_shutdown_ends_open_streams_with_abort(engine):
    async def main():
        stream = engine.generate([1, 2, 3], GREEDY.replace(max_tokens=400))
        first = await stream.__anext__()
        engine.shutdown()
        rest = [out async for out in stream]
        return first, rest

    first, rest = asyncio.run(main())
    assert not first.finished
    assert rest[-1].finished and rest[-1].finish_reason == "abort"


def test_a_grammar_compiles_off_the_event_loop(engine, monkeypatch):
    """Compiling a large schema takes up to seconds: it runs in a worker thread, so the
    loop keeps relaying other streams meanwhile."""
    import threading

    from qinfer.request.grammar import GrammarProcessor

    compiled_on = []
    create = GrammarProcessor.create.__func__

    def spy(cls, *args, **kwargs):
        compiled_on.append(threading.current_thread())
        return create(cls, *args, **kwargs)

    monkeypatch.setattr(GrammarProcessor, "create", classmethod(spy))

    async def main():
        params = GREEDY.replace(max_tokens=3, ignore_eos=False, regex="[a-z]{3}")
        return threading.current_thread(), await collect(engine, "hello", params)

    loop_thread, outputs = asyncio.run(main())
    assert len(compiled_on) == 1 and compiled_on[0] is not loop_thread
    assert outputs[-1].finished and len(outputs[-1].text) == 3
