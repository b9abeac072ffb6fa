"""The LoRA adapters requests may name as their `model`: LORA_MODULES read at start, and, with
ALLOW_RUNTIME_LORA_UPDATING, those loaded and unloaded while serving through vLLM's routes
(`POST /v1/load_lora_adapter` `{"lora_name", "lora_path"}` and `/v1/unload_lora_adapter`
`{"lora_name"}`; api/openai/serving.py answers them).

One `LoRAAdapters` is shared by the OpenAI and native routes, so a change is seen by both at
once. An adapter is read and checked by the engine before its name is served (the checks
LORA_MODULES get); an unloaded name is refused at once (404 `model_not_found`), while the
requests already running with it finish with it (the engine forgets its weights after them).
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable, Iterator, Mapping

from pydantic import BaseModel, ConfigDict, Field

from ..engine import EngineClient, InvalidRequestError, LoRARequest

RUNTIME_UPDATES_OFF = (
    "loading and unloading LoRA adapters at runtime is off on this worker: set "
    "ALLOW_RUNTIME_LORA_UPDATING=1 (vLLM's VLLM_ALLOW_RUNTIME_LORA_UPDATING is read too) with "
    "ENABLE_LORA=1 to turn it on"
)


class LoadLoRAAdapterRequest(BaseModel):
    """vLLM's body of POST /v1/load_lora_adapter."""

    model_config = ConfigDict(strict=True, extra="forbid")

    lora_name: str = Field(min_length=1)
    lora_path: str = Field(min_length=1)
    load_inplace: bool = False  # replace an adapter already served under that name


class UnloadLoRAAdapterRequest(BaseModel):
    """vLLM's body of POST /v1/unload_lora_adapter (`lora_int_id` is accepted and unused: the
    name says which)."""

    model_config = ConfigDict(strict=True, extra="forbid")

    lora_name: str = Field(min_length=1)
    lora_int_id: int | None = None


class LoRAUpdateError(Exception):
    """A load or unload refused: a message for the client, the field it names and the HTTP
    `status` (400, or 404 for an unknown adapter or runtime updates off). The message comes first,
    as in every request error of the package."""

    def __init__(self, message: str, param: str | None = None, status: int = 400) -> None:
        super().__init__(message)
        self.status = status
        self.param = param


class LoRAAdapters(Mapping[str, LoRARequest]):
    """Adapter name -> its request (a read-only mapping to the routes; `load` and `unload`
    change it). `runtime_updates`: whether `load` and `unload` are allowed."""

    def __init__(self, adapters: Iterable[LoRARequest] = (), runtime_updates: bool = False):
        self._by_name = {r.lora_name: r for r in adapters}
        self.runtime_updates = runtime_updates
        # Ids go on from the highest one at start and are never reused: the engine keys an
        # adapter's weights and prefix-cache blocks by id.
        self._next_id = max((r.lora_int_id for r in self._by_name.values()), default=0) + 1
        self._lock = asyncio.Lock()

    def __getitem__(self, name: str) -> LoRARequest:
        return self._by_name[name]

    def __iter__(self) -> Iterator[str]:
        return iter(list(self._by_name))

    def __len__(self) -> int:
        return len(self._by_name)

    async def load(
        self,
        engine: EngineClient,
        name: str,
        path: str,
        reserved: Iterable[str] = (),
        replace: bool = False,
    ) -> LoRARequest:
        """Reads adapter `path` (off the event loop) and serves it as `name`. `reserved`: names
        taken by the model itself. `replace` (vLLM's `load_inplace`): an adapter already served
        under `name` gives way to this one (its running requests finish with the old one)."""
        self.check_allowed()
        if name in set(reserved):
            raise LoRAUpdateError(
                f"the name {name!r} is the served model's; choose another", "lora_name"
            )
        async with self._lock:
            old = self._by_name.get(name)
            if old is not None and not replace:
                raise LoRAUpdateError(
                    f"the LoRA adapter {name!r} has already been loaded (unload it first, or "
                    'set "load_inplace": true to replace it)',
                    "lora_name",
                )
            req = LoRARequest(name, self._next_id, path)
            self._next_id += 1
            try:
                await asyncio.to_thread(engine.load_lora, req)
            except InvalidRequestError as e:  # LoRAError: the adapter cannot be served
                raise LoRAUpdateError(str(e), e.param or "lora_path") from None
            self._by_name[name] = req
            if old is not None:
                engine.remove_lora(old)
            return req

    async def unload(self, engine: EngineClient, name: str) -> LoRARequest:
        """Stops serving `name` at once; its weights go once its running requests finish."""
        self.check_allowed()
        async with self._lock:
            req = self._by_name.pop(name, None)
            if req is None:
                raise LoRAUpdateError(
                    f"the LoRA adapter {name!r} cannot be found", "lora_name", status=404
                )
            engine.remove_lora(req)
            return req

    def check_allowed(self) -> None:
        if not self.runtime_updates:
            raise LoRAUpdateError(RUNTIME_UPDATES_OFF, status=404)
