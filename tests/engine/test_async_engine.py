"""AsyncEngine: concurrent streams on one stepping loop, aborts on disconnect, failures contained."""

from __future__ import annotations

import asyncio

import pytest

from serverless_llm import LLM, SamplingParams
from serverless_llm.engine.async_engine import AsyncEngine, EngineDeadError
from serverless_llm.engine.llm_engine import InvalidRequestError
from tests.engine.test_engine_core import GREEDY, random_prompts


@pytest.fixture()
def setup(tiny_llama):
    llm = LLM(tiny_llama, num_kv_blocks=64, block_size=8, max_model_len=256)
    return llm, AsyncEngine(llm.engine)


async def collect(engine: AsyncEngine, prompt, params):
    ids, text, outs = [], "", []
    async for out in engine.generate(prompt, params):
        ids += out.new_token_ids
        text += out.new_text
        outs.append(out)
    return ids, text, outs


def test_concurrent_streams_equal_offline(setup):
    llm, aengine = setup
    prompts = random_prompts(12, llm.engine.vocab_size, seed=11)
    params = SamplingParams(max_tokens=20, **GREEDY)
    expected = [o.outputs[0] for o in llm.generate(prompts, params)]

    async def main():
        try:
            return await asyncio.gather(*(collect(aengine, p, params) for p in prompts))
        finally:
            await aengine.shutdown()

    results = asyncio.run(main())
    for (ids, text, outs), exp in zip(results, expected):
        assert ids == exp.token_ids and text == exp.text
        assert outs[-1].finished and outs[-1].finish_reason == "length"
        assert not any(o.finished for o in outs[:-1])
        assert outs[-1].num_output_tokens == 20
    assert llm.engine.block_pool.num_free == 64


def test_consumer_that_stops_listening_aborts(setup):
    llm, aengine = setup
    prompt = random_prompts(1, llm.engine.vocab_size, seed=12)[0]

    async def whole_again():
        # The abort lands at the next step boundary; then the pool is whole again (the
        # deadline only guards against a hang).
        deadline = asyncio.get_running_loop().time() + 30
        while llm.engine.block_pool.num_free != 64 or llm.engine.requests:
            if asyncio.get_running_loop().time() > deadline:
                break
            await asyncio.sleep(0.01)

    async def main():
        gen = aengine.generate(prompt, SamplingParams(max_tokens=200, **GREEDY))
        async for _ in gen:
            break
        await gen.aclose()
        await whole_again()
        # A cancelled task aborts too: cancelled once it has its first token (not after a
        # sleep, which a fast machine could spend finishing all 200).
        started = asyncio.Event()

        async def consume():
            async for _ in aengine.generate(prompt, SamplingParams(max_tokens=200, **GREEDY)):
                started.set()

        task = asyncio.ensure_future(consume())
        await started.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await whole_again()
        await aengine.shutdown()

    asyncio.run(main())
    assert llm.engine.block_pool.num_free == 64 and not llm.engine.requests


def test_invalid_request_raises_and_engine_keeps_serving(setup):
    llm, aengine = setup

    async def main():
        with pytest.raises(InvalidRequestError):
            await collect(aengine, [], SamplingParams())
        with pytest.raises(InvalidRequestError):
            await collect(aengine, [5] * 250, SamplingParams(max_tokens=10))
        ids, _, _ = await collect(aengine, [5, 6, 7], SamplingParams(max_tokens=5, **GREEDY))
        await aengine.shutdown()
        return ids

    assert len(asyncio.run(main())) == 5


def test_failed_step_fails_its_requests_only(setup, monkeypatch):
    llm, aengine = setup
    real_execute = llm.engine.runner.execute
    calls = {"n": 0}

    def flaky(batch):
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("boom")
        return real_execute(batch)

    monkeypatch.setattr(llm.engine.runner, "execute", flaky)

    async def main():
        with pytest.raises(EngineDeadError, match="boom"):
            await collect(aengine, [5, 6, 7], SamplingParams(max_tokens=10, **GREEDY))
        ids, _, _ = await collect(aengine, [5, 6, 7], SamplingParams(max_tokens=10, **GREEDY))
        await aengine.shutdown()
        return ids

    assert len(asyncio.run(main())) == 10
    assert llm.engine.block_pool.num_free == 64


def test_a_request_whose_output_processing_fails_fails_alone(setup, monkeypatch):
    """Issue 14: detokenizing (here, a fault injected there) raises for one request in its third
    step; that request gets the error, the other five in the same steps finish with the tokens
    they have alone, nothing leaks, and the engine serves on. Offline, LLM.generate raises."""
    from serverless_llm.engine import llm_engine
    from serverless_llm.engine.async_engine import RequestFailedError

    llm, aengine = setup
    prompts = random_prompts(6, llm.engine.vocab_size, seed=31)
    params = SamplingParams(max_tokens=12, **GREEDY)
    expected = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    real = llm_engine.process_token
    bad = {"id": None}

    def faulty(req, tok, lp, eos):
        if req.request_id == bad["id"] and len(req.output_token_ids) == 2:
            raise ValueError("injected detokenizer fault")
        return real(req, tok, lp, eos)

    monkeypatch.setattr(llm_engine, "process_token", faulty)

    async def one(i):
        rid = f"req-{i}"
        if i == 2:
            bad["id"] = rid
        ids = []
        async for out in aengine.generate(prompts[i], params, request_id=rid):
            ids += out.new_token_ids
        return ids

    async def main():
        results = await asyncio.gather(*(one(i) for i in range(6)), return_exceptions=True)
        again = await one(0)
        await aengine.shutdown()
        return results, again

    results, again = asyncio.run(main())
    assert isinstance(results[2], RequestFailedError) and "injected" in str(results[2])
    assert [r for i, r in enumerate(results) if i != 2] == expected[:2] + expected[3:]
    assert again == expected[0]
    assert llm.engine.block_pool.num_free == 64 and not llm.engine.requests
    assert not llm.engine.failed

    bad["id"] = "llm-99"  # the offline call's request id
    llm._counter = 99
    with pytest.raises(RuntimeError, match="injected"):
        llm.generate(prompts[:3], params)
    assert llm.engine.block_pool.num_free == 64 and not llm.engine.failed


def test_engine_is_built_and_stepped_on_one_thread(tiny_llama, monkeypatch):
    """All torch work of a served engine happens on its step thread: a second thread running
    OpenMP regions (here, the model load) gives libgomp a second worker pool, and on a small
    machine every parallel region of every step then pays a wake-up (measured: decode ~60%
    slower on 2 cores)."""
    import threading

    from serverless_llm.engine.config import EngineConfig
    from serverless_llm.engine.llm_engine import LLMEngine

    seen: dict[str, set[int]] = {"init": set(), "step": set()}
    real_init, real_step = LLMEngine.__init__, LLMEngine.step

    def init(self, *a, **kw):
        seen["init"].add(threading.get_ident())
        real_init(self, *a, **kw)

    def step(self):
        seen["step"].add(threading.get_ident())
        return real_step(self)

    monkeypatch.setattr(LLMEngine, "__init__", init)
    monkeypatch.setattr(LLMEngine, "step", step)
    aengine = AsyncEngine.from_config(
        EngineConfig(model=tiny_llama, num_kv_blocks=64, block_size=8, max_model_len=256)
    )

    async def main():
        try:
            return await collect(aengine, [5, 6, 7], SamplingParams(max_tokens=6, **GREEDY))
        finally:
            await aengine.shutdown()

    ids, _, _ = asyncio.run(main())
    assert len(ids) == 6
    assert len(seen["init"]) == 1 and seen["step"] == seen["init"]
    assert seen["init"] != {threading.get_ident()}


def test_a_request_that_cannot_be_queued_fails_alone(setup, monkeypatch):
    """An add that raises between steps fails its own request; the loop and the others go on
    (it used to end the stepping loop, leaving every request in flight waiting)."""
    from serverless_llm.engine.async_engine import RequestFailedError

    llm, aengine = setup
    prompts = random_prompts(3, llm.engine.vocab_size, seed=41)
    params = SamplingParams(max_tokens=8, **GREEDY)
    expected = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    real_add = llm.engine.add

    def add(req):
        if req.request_id == "bad":
            raise RuntimeError("injected add fault")
        real_add(req)

    monkeypatch.setattr(llm.engine, "add", add)

    async def one(i, rid=None):
        return [
            t
            async for o in aengine.generate(prompts[i], params, request_id=rid)
            for t in o.new_token_ids
        ]

    async def main():
        try:
            return await asyncio.gather(one(0), one(1, "bad"), one(2), return_exceptions=True)
        finally:
            await aengine.shutdown()

    good0, bad, good2 = asyncio.run(main())
    assert isinstance(bad, RequestFailedError) and "injected" in str(bad)
    assert [good0, good2] == [expected[0], expected[2]]
    assert llm.engine.block_pool.num_free == 64 and not llm.engine.requests
