"""The Responses API's state (api/openai/response_store.py and the /v1/responses routes): the
in-process store's count and byte limits (oldest out first), Redis (a real redis-server) with
its TTL, `previous_response_id` continuing a stored response exactly as if its history had been
sent, GET / DELETE / input_items, `store: false`, and a store that cannot be reached."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import redis

from serverless_llm.api.batching import BatchSizes
from serverless_llm.api.openai.response_store import (
    REDIS_KEY_PREFIX,
    MemoryResponseStore,
    RedisResponseStore,
    ResponseStoreError,
    check_url,
    encode,
    redacted,
)
from serverless_llm.worker.job_input import JobError, OpenAIJob, parse_job
from tests.api.conftest import collect
from tests.redis_server import _free_port, redis_url  # noqa: F401 (the fixture)

ROUTE = "/v1/responses"
BASE = {"model": "tiny-llama", "max_output_tokens": 4, "temperature": 0}


def record(n: int, pad: int = 0) -> dict[str, Any]:
    return {"response": {"id": f"resp_{n}", "output": [], "pad": "x" * pad}, "input": []}


def run(coro: Any) -> Any:
    return asyncio.run(coro)


# -- the stores on their own ----------------------------------------------------------------


def test_memory_store_drops_the_oldest_past_its_count():
    store = MemoryResponseStore(max_count=2, max_bytes=10**6)

    async def go():
        for n in range(3):
            await store.put(f"resp_{n}", record(n))
        return [await store.get(f"resp_{n}") for n in range(3)]

    first, second, third = run(go())
    assert first is None
    assert second == record(1) and third == record(2)
    assert len(store) == 2


def test_memory_store_drops_the_oldest_past_its_bytes():
    size = len(encode(record(0, pad=100)))
    store = MemoryResponseStore(max_count=100, max_bytes=2 * size + size // 2)

    async def go():
        for n in range(3):
            await store.put(f"resp_{n}", record(n, pad=100))
        kept = [f"resp_{n}" in store for n in range(3)]
        # One record larger than the whole store is not kept, and evicts nothing.
        await store.put("resp_big", record(9, pad=3 * size))
        return kept, "resp_big" in store, len(store), store.bytes

    kept, big, count, used = run(go())
    assert kept == [False, True, True]
    assert not big and count == 2 and used == 2 * size


def test_memory_store_delete_and_replace():
    store = MemoryResponseStore(max_count=10, max_bytes=10**6)

    async def go():
        await store.put("resp_a", record(1))
        await store.put("resp_a", record(2, pad=10))  # replaced, counted once
        assert len(store) == 1 and store.bytes == len(encode(record(2, pad=10)))
        assert await store.delete("resp_a") is True
        assert await store.delete("resp_a") is False
        return await store.get("resp_a"), store.bytes

    assert run(go()) == (None, 0)


def test_redis_store_round_trip_with_its_ttl(redis_url):  # noqa: F811
    store = RedisResponseStore(redis_url, ttl_s=1000)
    direct = redis.Redis.from_url(redis_url)

    async def go():
        await store.put("resp_r", record(7))
        got = await store.get("resp_r")
        ttl = direct.ttl(REDIS_KEY_PREFIX + "resp_r")
        deleted = await store.delete("resp_r"), await store.delete("resp_r")
        gone = await store.get("resp_r")
        await store.aclose()
        return got, ttl, deleted, gone

    got, ttl, deleted, gone = run(go())
    assert got == record(7)
    assert 0 < ttl <= 1000
    assert deleted == (True, False) and gone is None
    forever = RedisResponseStore(redis_url, ttl_s=0)

    async def keep():
        await forever.put("resp_f", record(8))
        await forever.aclose()

    run(keep())
    assert direct.ttl(REDIS_KEY_PREFIX + "resp_f") == -1  # no expiry
    direct.close()


def test_unreachable_redis_is_a_store_error_without_credentials():
    store = RedisResponseStore(f"redis://:hunter2@127.0.0.1:{_free_port()}/0")

    async def go():
        try:
            await store.get("resp_x")
        finally:
            await store.aclose()

    with pytest.raises(ResponseStoreError) as info:
        run(go())
    assert "could not be read" in str(info.value) and "hunter2" not in str(info.value)


@pytest.mark.parametrize("url", ["http://h:6379", "redis://", "redis://h:port", "h:6379"])
def test_bad_store_urls_are_refused(url):
    with pytest.raises(ValueError):
        check_url(url)


def test_redacted_urls_keep_no_password():
    assert redacted("redis://user:pw@example.com:6380/2") == "redis://example.com:6380/2"
    assert redacted("unix:///run/redis.sock") == "unix:///run/redis.sock"


def test_openai_method_in_jobs():
    job = {"input": {"openai_route": "/v1/responses/resp_1", "openai_method": "DELETE"}}
    parsed = parse_job(job, defaults=BatchSizes())
    assert isinstance(parsed, OpenAIJob) and parsed.method == "DELETE"
    for bad in ({"openai_route": "/v1/responses/x", "openai_method": "PATCH"}, {"prompt": "x"}):
        if "prompt" in bad:
            bad = {**bad, "openai_method": "GET"}
        with pytest.raises(JobError) as info:
            parse_job({"input": bad}, defaults=BatchSizes())
        assert "openai_method" in str(info.value)


# -- through the route ------------------------------------------------------------------------


def _text(response: dict[str, Any]) -> str:
    return "".join(
        part["text"]
        for item in response["output"]
        if item["type"] == "message"
        for part in item["content"]
    )


def test_previous_response_id_continues_as_if_the_history_were_sent(serve):
    async def go(s):
        (first,) = await collect(
            s, ROUTE, {**BASE, "instructions": "Be brief.", "input": "Hello there"}
        )
        (follow,) = await collect(
            s, ROUTE, {**BASE, "input": "And then?", "previous_response_id": first["id"]}
        )
        # The same conversation sent whole (instructions do not carry over, as on OpenAI).
        history = [{"role": "user", "content": "Hello there"}, *first["output"]]
        (whole,) = await collect(
            s, ROUTE, {**BASE, "input": [*history, {"role": "user", "content": "And then?"}]}
        )
        (alone,) = await collect(s, ROUTE, {**BASE, "input": "And then?"})
        # A chain of three: the third sees both earlier turns.
        (third,) = await collect(
            s, ROUTE, {**BASE, "input": "More?", "previous_response_id": follow["id"]}
        )
        return first, follow, whole, alone, third

    first, follow, whole, alone, third = serve(go)
    assert first["store"] is True and first["previous_response_id"] is None
    assert follow["previous_response_id"] == first["id"] and follow["store"] is True
    assert follow["instructions"] is None
    assert follow["usage"]["input_tokens"] == whole["usage"]["input_tokens"]
    assert _text(follow) == _text(whole)
    assert follow["usage"]["input_tokens"] > alone["usage"]["input_tokens"]
    assert third["usage"]["input_tokens"] > follow["usage"]["input_tokens"]


def test_get_delete_and_input_items(serve):
    async def go(s):
        (made,) = await collect(s, ROUTE, {**BASE, "input": "Hi"})
        rid = made["id"]
        (follow,) = await collect(s, ROUTE, {**BASE, "input": "Again", "previous_response_id": rid})
        (got,) = await collect(s, f"/v1/responses/{rid}", None)
        (items,) = await collect(s, f"/v1/responses/{follow['id']}/input_items?order=asc", None)
        (page,) = await collect(s, f"/v1/responses/{follow['id']}/input_items?limit=1", None)
        (after,) = await collect(
            s,
            f"/v1/responses/{follow['id']}/input_items?limit=1&after={page['last_id']}",
            None,
        )
        (bad,) = await collect(s, f"/v1/responses/{rid}/input_items?limit=0", None)
        deleted = [item async for item in s.handle(f"/v1/responses/{rid}", None, None, "DELETE")]
        (gone,) = await collect(s, f"/v1/responses/{rid}", None)
        again = [item async for item in s.handle(f"/v1/responses/{rid}", None, None, "DELETE")]
        (cont,) = await collect(s, ROUTE, {**BASE, "input": "x", "previous_response_id": rid})
        wrong = [item async for item in s.handle(f"/v1/responses/{rid}", None, None, "POST")]
        return made, got, items, page, after, bad, deleted, gone, again, cont, wrong

    made, got, items, page, after, bad, deleted, gone, again, cont, wrong = serve(go)
    assert got == made
    # The follow-up's input items: the first request's message, its output, then "Again".
    data = items["data"]
    assert [i["type"] for i in data] == ["message", "message", "message"]
    assert data[0]["content"] == [{"type": "input_text", "text": "Hi"}]
    assert data[1]["id"] == made["output"][0]["id"] and data[1]["role"] == "assistant"
    assert data[2]["content"][0]["text"] == "Again"
    assert items["first_id"] == data[0]["id"] and items["has_more"] is False
    assert page["data"] == [data[2]] and page["has_more"] is True  # newest first by default
    assert after["data"] == [data[1]] and after["has_more"] is True
    assert bad["error"]["param"] == "limit" and bad.status == 400
    assert deleted == [{"id": made["id"], "object": "response", "deleted": True}]
    for missing in (gone, again[0]):
        assert missing.status == 404 and missing["error"]["type"] == "not_found_error"
        assert made["id"] in missing["error"]["message"]
    assert cont.status == 404
    assert cont["error"]["param"] == "previous_response_id"
    assert cont["error"]["code"] == "previous_response_not_found"
    assert wrong[0]["error"]["param"] == "openai_method"


def test_store_false_keeps_nothing_and_streams_are_kept(serve):
    store = MemoryResponseStore()

    async def go(s):
        (unstored,) = await collect(s, ROUTE, {**BASE, "input": "Hi", "store": False})
        (missing,) = await collect(s, f"/v1/responses/{unstored['id']}", None)
        s.raw_output = False
        batches = await collect(s, ROUTE, {**BASE, "input": "Hi", "stream": True})
        final = batches[-1][-1]["response"]
        (got,) = await collect(s, f"/v1/responses/{final['id']}", None)
        return unstored, missing, final, got

    unstored, missing, final, got = serve(go, response_store=store)
    assert unstored["store"] is False
    assert missing.status == 404
    assert len(store) == 1
    assert got == final and got["status"] in ("completed", "incomplete")


def test_evicted_responses_are_404(serve):
    async def go(s):
        made = []
        for text in ("one", "two", "three"):
            (r,) = await collect(s, ROUTE, {**BASE, "input": text})
            made.append(r)
        found = []
        for r in made:
            (got,) = await collect(s, f"/v1/responses/{r['id']}", None)
            found.append(got)
        (cont,) = await collect(
            s, ROUTE, {**BASE, "input": "x", "previous_response_id": made[0]["id"]}
        )
        return made, found, cont

    made, found, cont = serve(go, response_store=MemoryResponseStore(max_count=2))
    assert found[0].status == 404 and found[1:] == made[1:]
    assert cont.status == 404 and cont["error"]["param"] == "previous_response_id"

    store = MemoryResponseStore()

    async def by_bytes(s):
        (first,) = await collect(s, ROUTE, {**BASE, "input": "one"})
        store.max_bytes = store.bytes * 5 // 2  # room for two responses of this size
        made = [first]
        for text in ("two", "six"):
            (r,) = await collect(s, ROUTE, {**BASE, "input": text})
            made.append(r)
        found = []
        for r in made:
            (got,) = await collect(s, f"/v1/responses/{r['id']}", None)
            found.append(got)
        store.max_bytes = 200  # a response larger than the whole store is not kept at all
        (big,) = await collect(s, ROUTE, {**BASE, "input": "Hi"})
        (missing,) = await collect(s, f"/v1/responses/{big['id']}", None)
        return made, found, missing

    made, found, missing = serve(by_bytes, response_store=store)
    assert found[0].status == 404 and found[1:] == made[1:]
    assert missing.status == 404 and len(store) == 2


def test_an_unreachable_store_is_a_503_and_the_worker_keeps_serving(serve):
    down = RedisResponseStore(f"redis://127.0.0.1:{_free_port()}/0")

    async def go(s):
        (made,) = await collect(s, ROUTE, {**BASE, "input": "Hi"})
        (cont,) = await collect(s, ROUTE, {**BASE, "input": "x", "previous_response_id": "resp_1"})
        s.raw_output = False
        batches = await collect(s, ROUTE, {**BASE, "input": "Hi", "stream": True})
        (unstored,) = await collect(s, ROUTE, {**BASE, "input": "Hi", "store": False})
        await down.aclose()
        return made, cont, [e for b in batches for e in b], unstored

    made, cont, events, unstored = serve(go, response_store=down)
    for err in (made, cont):
        assert err.status == 503 and "response store" in err["error"]["message"]
    types = [e["type"] for e in events]
    assert types[-2:] == ["error", "response.failed"]
    assert "response.completed" not in types and "response.incomplete" not in types
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert "could not be stored" in events[-1]["response"]["error"]["message"]
    assert unstored["status"] in ("completed", "incomplete")
