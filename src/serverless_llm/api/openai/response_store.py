"""Where the Responses API keeps responses (`store`, `previous_response_id`, GET and DELETE
/v1/responses/{id}).

A stored record is one JSON object: the Response as it was returned (`response`) and the input
items it answered (`input`: the history it continued, then its own request's items, each with an
`id`). A follow-up's history is the record's `input` followed by its response's `output`, so a
record is self-contained: evicting an older response of the same conversation breaks nothing.

Two stores:

- `MemoryResponseStore`: in this process, bounded by a number of records and by their encoded
  bytes (RESPONSES_STORE_MAX_COUNT, RESPONSES_STORE_MAX_BYTES); the oldest records leave first.
  A serverless worker's memory is neither shared with the endpoint's other workers nor kept
  across scale-downs, so this alone serves conversations that stay on one worker.
- `RedisResponseStore` (RESPONSES_STORE_URL=redis://...): one Redis for the whole endpoint, so a
  follow-up finds its history on any worker; records expire after RESPONSES_STORE_TTL_SECONDS.
  Redis is then the only store (a delete on one worker is seen by all).

A store that cannot be reached raises `ResponseStoreError` (the request's 503), never hangs a
request past its socket timeouts.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from typing import Any, Protocol
from urllib.parse import urlsplit

DEFAULT_MAX_COUNT = 10_000
DEFAULT_MAX_BYTES = 256 * 1024 * 1024
DEFAULT_TTL_SECONDS = 30 * 24 * 3600  # OpenAI keeps responses for 30 days
REDIS_KEY_PREFIX = "serverless_llm:response:"
REDIS_SOCKET_TIMEOUT_S = 10.0


class ResponseStoreError(Exception):
    """The store could not be read or written (Redis down, refused, timed out)."""


class ResponseStore(Protocol):
    """What the Responses route needs from a store; records are JSON-able dicts."""

    async def get(self, response_id: str) -> dict[str, Any] | None: ...

    async def put(self, response_id: str, record: dict[str, Any]) -> None: ...

    async def delete(self, response_id: str) -> bool: ...


def encode(record: dict[str, Any]) -> bytes:
    return json.dumps(record, ensure_ascii=False, separators=(",", ":")).encode()


class MemoryResponseStore:
    """Records in this process, oldest out first once there are more than `max_count` or their
    encoded size passes `max_bytes`. A record larger than `max_bytes` on its own is not kept."""

    def __init__(
        self, max_count: int = DEFAULT_MAX_COUNT, max_bytes: int = DEFAULT_MAX_BYTES
    ) -> None:
        if max_count < 0 or max_bytes < 0:
            raise ValueError("the store's limits must be >= 0")
        self.max_count = max_count
        self.max_bytes = max_bytes
        self._records: OrderedDict[str, bytes] = OrderedDict()
        self.bytes = 0

    def __len__(self) -> int:
        return len(self._records)

    def __contains__(self, response_id: object) -> bool:
        return response_id in self._records

    async def get(self, response_id: str) -> dict[str, Any] | None:
        data = self._records.get(response_id)
        return None if data is None else json.loads(data)

    async def put(self, response_id: str, record: dict[str, Any]) -> None:
        data = encode(record)
        self._drop(response_id)
        if len(data) > self.max_bytes or self.max_count == 0:
            return
        self._records[response_id] = data
        self.bytes += len(data)
        while len(self._records) > self.max_count or self.bytes > self.max_bytes:
            _, oldest = self._records.popitem(last=False)
            self.bytes -= len(oldest)

    async def delete(self, response_id: str) -> bool:
        return self._drop(response_id)

    def _drop(self, response_id: str) -> bool:
        data = self._records.pop(response_id, None)
        if data is None:
            return False
        self.bytes -= len(data)
        return True


def redacted(url: str) -> str:
    """The URL without its credentials, for messages and logs."""
    parts = urlsplit(url)
    host = parts.hostname or ""
    port = f":{parts.port}" if parts.port else ""
    path = parts.path if parts.scheme == "unix" else (parts.path or "")
    return f"{parts.scheme}://{host}{port}{path}"


def check_url(url: str) -> None:
    """ValueError unless `url` is a Redis URL the client takes."""
    parts = urlsplit(url)
    if parts.scheme not in ("redis", "rediss", "unix"):
        raise ValueError("not a redis://, rediss:// or unix:// URL")
    if parts.scheme != "unix" and not parts.hostname:
        raise ValueError("the URL names no host")
    try:
        parts.port  # noqa: B018 (raises on a bad port)
    except ValueError as e:
        raise ValueError(f"bad port ({e})") from None


class RedisResponseStore:
    """Records in Redis under `serverless_llm:response:{id}`, expiring after `ttl_s` (0: never).
    The client connects at first use, on the event loop that uses it."""

    def __init__(self, url: str, ttl_s: int = DEFAULT_TTL_SECONDS) -> None:
        check_url(url)
        self.url = url
        self.ttl_s = ttl_s
        self.where = redacted(url)
        self._client: Any = None

    def _redis(self) -> Any:
        if self._client is None:
            import redis.asyncio as aioredis

            self._client = aioredis.from_url(
                self.url,
                socket_timeout=REDIS_SOCKET_TIMEOUT_S,
                socket_connect_timeout=REDIS_SOCKET_TIMEOUT_S,
            )
        return self._client

    async def _call(self, what: str, method: str, *args: Any, **kwargs: Any) -> Any:
        import redis.exceptions

        try:
            return await getattr(self._redis(), method)(*args, **kwargs)
        except (redis.exceptions.RedisError, OSError) as e:
            raise ResponseStoreError(
                f"the response store ({self.where}) could not {what}: {type(e).__name__}: {e}"
            ) from e

    async def get(self, response_id: str) -> dict[str, Any] | None:
        data = await self._call("be read", "get", REDIS_KEY_PREFIX + response_id)
        return None if data is None else json.loads(data)

    async def put(self, response_id: str, record: dict[str, Any]) -> None:
        await self._call(
            "be written",
            "set",
            REDIS_KEY_PREFIX + response_id,
            encode(record),
            ex=self.ttl_s or None,
        )

    async def delete(self, response_id: str) -> bool:
        return bool(await self._call("be written", "delete", REDIS_KEY_PREFIX + response_id))

    async def aclose(self) -> None:
        if self._client is not None:
            client, self._client = self._client, None
            await client.aclose()
