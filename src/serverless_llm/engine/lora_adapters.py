"""LoRA adapters: what a request names (`LoRARequest`), how a PEFT adapter directory is read
and checked against the model (`read_adapter`), and which adapters hold the model's slots
(`LoRAManager`).

An adapter is read once, on the host, when a request first names it, and kept in an LRU of
`max_cpu_loras` adapters. A step's adapters must sit in the model's `max_loras` slots (the
scheduler never runs more distinct adapters at once): one already in a slot stays, another is
copied into a free slot or over the least recently used adapter that this step does not use.
Every error names the adapter and, where it is about one tensor or module, that too.
"""

from __future__ import annotations

import json
import math
import os
import re
import threading
from collections import OrderedDict
from dataclasses import dataclass, field

import torch

from .errors import LoRAError

ADAPTER_PREFIX = "base_model.model."


@dataclass(frozen=True)
class LoRARequest:
    """An adapter for a request, as vLLM names it: a unique name, a positive integer id, and
    the local directory of a PEFT adapter (adapter_config.json + adapter_model.safetensors or
    .bin)."""

    lora_name: str
    lora_int_id: int
    lora_path: str
    base_model_name: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.lora_int_id, int) or self.lora_int_id < 1:
            raise LoRAError(f"adapter {self.lora_name!r}: lora_int_id must be an integer >= 1")

    @property
    def cache_salt(self) -> bytes:
        """What keys this adapter's prefix-cache blocks apart from the base model's and other
        adapters' (its path too: an id the host LRU forgot may come back naming other weights)."""
        return f"lora:{self.lora_int_id}:{self.lora_name}:{self.lora_path}".encode()


@dataclass
class LoRAAdapter:
    name: str
    int_id: int
    source: str  # the request's lora_path (a directory or a hub repo id)
    local: str  # the directory it was read from (tensor-parallel ranks read it there too)
    # internal module path -> [(part index or None for the whole output, A [r, in], B [out, r])]
    weights: dict[str, list[tuple[int | None, torch.Tensor, torch.Tensor]]] = field(
        default_factory=dict
    )

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes + b.nbytes for parts in self.weights.values() for _, a, b in parts)


def _pattern_value(patterns: dict, module: str, default):
    """PEFT's rank_pattern / alpha_pattern: the value of the first key that names `module`
    (its full name, a suffix after a dot, or a regular expression matching it whole)."""
    for key, value in patterns.items():
        if module == key or module.endswith("." + key) or re.fullmatch(key, module):
            return value
    return default


def _read_tensors(path: str, name: str) -> dict[str, torch.Tensor]:
    st = os.path.join(path, "adapter_model.safetensors")
    if os.path.isfile(st):
        from safetensors.torch import load_file

        return load_file(st)
    pt = os.path.join(path, "adapter_model.bin")
    if os.path.isfile(pt):
        return torch.load(pt, map_location="cpu", weights_only=True)
    raise LoRAError(
        f"adapter {name!r}: no adapter_model.safetensors or adapter_model.bin in {path}"
    )


def read_adapter(
    req: LoRARequest, path: str, model, max_rank: int, dtype: torch.dtype
) -> LoRAAdapter:
    """The adapter of `req`, read from directory `path`, for `model` (a DecoderModel with LoRA
    enabled), B scaled by alpha / r (alpha / sqrt(r) with rsLoRA), in `dtype`; LoRAError for
    anything the engine cannot apply exactly."""
    name = req.lora_name
    cfg_path = os.path.join(path, "adapter_config.json")
    if not os.path.isfile(cfg_path):
        raise LoRAError(f"adapter {name!r}: {path} has no adapter_config.json")
    try:
        with open(cfg_path) as f:
            cfg = json.load(f)
    except (OSError, ValueError) as e:
        raise LoRAError(f"adapter {name!r}: cannot read adapter_config.json: {e}") from e
    if cfg.get("peft_type", "LORA") != "LORA":
        raise LoRAError(f"adapter {name!r}: peft_type {cfg.get('peft_type')!r} is not LORA")
    unsupported = {
        "use_dora": "DoRA",
        "modules_to_save": "modules_to_save (fully trained copies of base modules)",
        "fan_in_fan_out": "fan_in_fan_out (Conv1D layouts)",
        "layer_replication": "layer_replication",
        "trainable_token_indices": "trainable_token_indices",
    }
    for key, what in unsupported.items():
        if cfg.get(key):
            raise LoRAError(f"adapter {name!r}: {what} is not supported")
    if cfg.get("bias", "none") != "none" or cfg.get("lora_bias"):
        raise LoRAError(f"adapter {name!r}: adapters with trained biases are not supported")
    r_default, alpha_default = int(cfg.get("r", 8)), float(cfg.get("lora_alpha", 8))
    rslora = bool(cfg.get("use_rslora", False))
    tensors = _read_tensors(path, name)
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        plain = key[len(ADAPTER_PREFIX) :] if key.startswith(ADAPTER_PREFIX) else key
        match = re.fullmatch(r"(.+)\.(lora_A|lora_B)(?:\.[^.]+)?\.weight", plain)
        if match is None:
            raise LoRAError(
                f"adapter {name!r}: tensor {key!r} is not a LoRA A or B weight (embedding and "
                "LM-head adapters, and extra trained modules, are not supported)"
            )
        pairs.setdefault(match.group(1), {})[match.group(2)] = tensor
    if not pairs:
        raise LoRAError(f"adapter {name!r}: no LoRA weights in {path}")
    adapter = LoRAAdapter(name, req.lora_int_id, req.lora_path, path)
    for module, ab in sorted(pairs.items()):
        if set(ab) != {"lora_A", "lora_B"}:
            raise LoRAError(f"adapter {name!r}: module {module!r} lacks its lora_A or lora_B")
        a, b = ab["lora_A"], ab["lora_B"]
        try:
            internal, part, in_features, out_rows = model.lora_target(module)
        except KeyError as e:
            raise LoRAError(f"adapter {name!r}: module {module!r}: {e.args[0]}") from None
        r = a.shape[0]
        if a.dim() != 2 or b.dim() != 2 or b.shape[1] != r:
            raise LoRAError(
                f"adapter {name!r}: module {module!r}: lora_A {tuple(a.shape)} and lora_B "
                f"{tuple(b.shape)} are not [r, in] and [out, r]"
            )
        if r > max_rank:
            raise LoRAError(
                f"adapter {name!r}: module {module!r} has rank {r}, above max_lora_rank {max_rank}"
            )
        if a.shape[1] != in_features or b.shape[0] != out_rows:
            raise LoRAError(
                f"adapter {name!r}: module {module!r}: lora_A {tuple(a.shape)} and lora_B "
                f"{tuple(b.shape)} do not fit the base layer ({in_features} in, {out_rows} out)"
            )
        rank = int(_pattern_value(cfg.get("rank_pattern") or {}, module, r_default))
        alpha = float(_pattern_value(cfg.get("alpha_pattern") or {}, module, alpha_default))
        scale = alpha / (math.sqrt(rank) if rslora else rank)
        sharder = getattr(model, "sharder", None)
        if sharder is not None:  # tensor parallel: this rank's share (checked whole above)
            a, b = sharder.lora_slice(internal, part, a, b)
        adapter.weights.setdefault(internal, []).append(
            (part, a.to(dtype), (b.float() * scale).to(dtype))
        )
    return adapter


def adapter_dir(req: LoRARequest, cache_dir: str | None, token: str | None) -> str:
    """The local directory of `req`'s adapter: its path when that is a directory, else the
    snapshot of the hub repo it names (from the cache, downloaded when the hub is reachable)."""
    path = os.path.expanduser(req.lora_path)
    if os.path.isdir(path):
        return path
    from .loader import ModelLoadError
    from .loader.hub import adapter_snapshot, looks_like_hub_id

    if not looks_like_hub_id(req.lora_path):
        raise LoRAError(f"adapter {req.lora_name!r}: {req.lora_path} is not a directory")
    try:
        return adapter_snapshot(req.lora_path, cache_dir=cache_dir, token=token)
    except ModelLoadError as e:
        raise LoRAError(f"adapter {req.lora_name!r}: {e}") from e


class LoRAManager:
    """The model's adapter slots and the host's LRU of read adapters (see the module
    docstring). `slot_loads` and `adapter_reads` count copies into slots and reads from disk.
    `get` may run on any thread (a request's adapter is read before it is queued); `prepare`
    runs on the step's."""

    def __init__(
        self,
        model,
        max_loras: int,
        max_rank: int,
        max_cpu_loras: int,
        dtype,
        cache_dir: str | None = None,
        token: str | None = None,
    ):
        self.model = model
        self.cache_dir = cache_dir
        self.token = token
        self._lock = threading.Lock()
        self.max_loras = max_loras
        self.max_rank = max_rank
        self.max_cpu_loras = max(max_cpu_loras, max_loras)
        self.dtype = dtype
        self.step, self.layers = model.enable_lora(max_loras, max_rank, dtype)
        self.host: OrderedDict[int, LoRAAdapter] = OrderedDict()
        self.names: dict[str, int] = {}  # adapter name -> int id, while it is known
        self.slot_of: OrderedDict[int, int] = OrderedDict()  # int id -> slot, LRU first
        self.slot_loads = 0
        self.adapter_reads = 0
        # Slot loads since the last step went to the other tensor-parallel ranks (rank 0 only):
        # (slot, request, local directory), each rank reading its own share of the adapter.
        self.loads_for_peers: list[tuple[int, LoRARequest, str]] | None = None

    def get(self, req: LoRARequest) -> LoRAAdapter:
        """The adapter, read from disk unless the host LRU holds it. A request keeps the
        adapter it got, so an adapter the LRU drops stays alive while requests use it."""
        with self._lock:
            known = self.host.get(req.lora_int_id)
            if known is not None:
                if known.name != req.lora_name or known.source != req.lora_path:
                    raise LoRAError(
                        f"lora_int_id {req.lora_int_id} is adapter {known.name!r} "
                        f"({known.source}); {req.lora_name!r} cannot reuse it"
                    )
                self.host.move_to_end(req.lora_int_id)
                return known
            local = adapter_dir(req, self.cache_dir, self.token)
            adapter = read_adapter(req, local, self.model, self.max_rank, self.dtype)
            self.adapter_reads += 1
            self.host[req.lora_int_id] = adapter
            while len(self.host) > self.max_cpu_loras:
                self.host.popitem(last=False)
            return adapter

    def prepare(self, adapters: list[LoRAAdapter]) -> dict[int, int]:
        """Slots for this step's distinct adapters (at most max_loras): int id -> slot."""
        wanted = list(dict.fromkeys(a.int_id for a in adapters))
        if len(wanted) > self.max_loras:
            raise RuntimeError(f"{len(wanted)} adapters in one step; max_loras={self.max_loras}")
        by_id = {a.int_id: a for a in adapters}
        for lid in wanted:
            if lid in self.slot_of:
                self.slot_of.move_to_end(lid)
                continue
            used = set(self.slot_of.values())
            free = [s for s in range(self.max_loras) if s not in used]
            if free:
                slot = free[0]
            else:  # evict the least recently used adapter this step does not need
                victim = next(v for v in self.slot_of if v not in wanted)
                slot = self.slot_of.pop(victim)
            self._load(slot, by_id[lid])
            self.slot_of[lid] = slot
        return {lid: self.slot_of[lid] for lid in wanted}

    def remove(self, lora_int_id: int) -> None:
        """Forgets an adapter: its host copy and its slot (which the next adapter loaded there
        overwrites). Runs on the step's thread, once no request uses it (LLMEngine.remove_lora):
        a request keeps the weights it was given, so one still in flight would load it again."""
        with self._lock:
            self.host.pop(lora_int_id, None)
        self.slot_of.pop(lora_int_id, None)

    def load_for_peer(self, slot: int, req: LoRARequest, local: str) -> None:
        """On a tensor-parallel rank other than 0: the adapter rank 0 put in `slot`, read from
        the same directory (this rank's share of it)."""
        self._load(slot, read_adapter(req, local, self.model, self.max_rank, self.dtype))

    def _load(self, slot: int, adapter: LoRAAdapter) -> None:
        if self.loads_for_peers is not None:
            req = LoRARequest(adapter.name, adapter.int_id, adapter.source)
            self.loads_for_peers.append((slot, req, adapter.local))
        for layer in self.layers.values():
            layer.clear_slot(slot)
        for internal, parts in adapter.weights.items():
            layer = self.layers[internal]
            for part, a, b in parts:
                layer.set_part(slot, part, a.to(layer.lora_a.device), b.to(layer.lora_b.device))
        for layer in self.layers.values():
            layer.repack()
        self.slot_loads += 1
