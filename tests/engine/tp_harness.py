"""Tensor-parallel shards run in threads of one process: every rank's model loaded as the
engine loads it (`load_model` with its rank) and stepped through the real runner and gloo
collectives, without the cost of spawning a process per rank. The engine's own process layout
is tested in test_tensor_parallel.py; this is for checking many model layouts cheaply."""

from __future__ import annotations

import os
import tempfile
import threading

import torch

from serverless_llm.engine.config import EngineConfig
from serverless_llm.engine.model_builder import load_model, prepare_model
from serverless_llm.engine.model_runner import HostBatch, ModelRunner, PromptLogprobWork
from serverless_llm.engine.parallel.group import TensorParallel

BLOCK = 8


def prompt_batch(ids: list[int]) -> HostBatch:
    """One prefill of `ids`, every position's logits asked for."""
    n = len(ids)
    blocks = -(-n // BLOCK)
    return HostBatch(
        input_ids=list(ids),
        positions=list(range(n)),
        slots=[list(range(n))],
        query_lens=[n],
        seq_lens=[n],
        block_tables=[torch.arange(blocks, dtype=torch.int32).unsqueeze(0)],
        num_decodes=0,
        sample_reqs=[],
        sample_idx=list(range(n)),
        prompt_work=PromptLogprobWork(),
    )


def sharded_logits(path: str, ids: list[int], size: int = 2, **config) -> dict:
    """Rank 0's logits [len(ids), vocab] for one prefill, and each rank's loaded bytes."""
    cfg = EngineConfig(
        model=path, dtype="float32", show_progress=False, tensor_parallel_size=size, **config
    )
    prepared = prepare_model(cfg)
    out: dict = {"bytes": [0] * size}
    errors: list[BaseException] = []
    init = os.path.join(tempfile.mkdtemp(prefix="tp-test-"), "rendezvous")

    def rank(r: int) -> None:
        try:
            tp = TensorParallel.join(r, size, init, "gloo", 60.0)
            loaded = load_model(cfg, tp, prepared)
            m = loaded.model
            caches = loaded.allocate_kv_cache(-(-len(ids) // BLOCK), BLOCK)
            runner = ModelRunner(
                m, caches, loaded.backend, BLOCK, loaded.device, loaded.cache_layout()
            )
            with torch.inference_mode():
                logits, _ = runner.run(prompt_batch(ids))
            out["bytes"][r] = loaded.param_bytes
            if r == 0:
                out["logits"] = logits
            else:
                assert logits is None
        except BaseException as e:  # noqa: BLE001 - reported by the caller
            errors.append(e)

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    if errors:
        raise errors[0]
    return out
