"""Image build step: compiles the baked model's Triton kernels for the GPU architectures named at
build time into the image's Triton cache, with no GPU (docs/engine.md, "Cold start").

The list is the worker's own warm-up list (engine/kernel_warmup.py): the model is built on the
CPU with the Triton backend, the sweep of synthetic steps runs with every launch recorded and
none run, and each recorded specialisation is compiled for each architecture with Triton's
compiler (kernels/launch_keys.compile_spec: the steps of Triton's own launch, so the cache keys
are the ones a worker asks for; tests/kernels/test_kernel_cache.py checks that for sm80 and
sm90). Split-KV choices read the GPU's SM count, so the sweep runs once per count of the common
GPUs of those architectures and the lists are joined.

    KERNEL_ARCH_LIST="8.0 9.0" TRITON_CACHE_DIR=/opt/triton-cache python builder/compile_kernels.py

Settings come from the environment as the worker reads them (MODEL_NAME, DTYPE, MAX_MODEL_LEN,
BLOCK_SIZE, MAX_NUM_SEQS, MAX_NUM_BATCHED_TOKENS, QUANTIZATION, ENABLE_LORA...): deploy with
other values and the worker compiles what differs at start (and logs how many it compiled).
"""

from __future__ import annotations

import os
import sys
import time

DEFAULT_ARCHES = "8.0 8.6 8.9 9.0 10.0"
# Streaming multiprocessors of common GPUs (L4, A10, A40/L40S, A100, H100 PCIe, H100 SXM/H200,
# B200): the split-KV heuristic's input.
SM_COUNTS = (58, 72, 84, 108, 114, 132, 148)


def arches(text: str) -> list[int]:
    """'8.0 8.6 9.0' (TORCH_CUDA_ARCH_LIST style; ';' or ',' also separate, '+PTX' ignored)
    -> [80, 86, 90]."""
    out = []
    for item in text.replace(";", " ").replace(",", " ").split():
        item = item.removesuffix("+PTX")
        major, _, minor = item.partition(".")
        out.append(int(major) * 10 + int(minor or 0))
    return out


def main() -> int:
    os.environ.pop("TRITON_INTERPRET", None)
    targets = arches(os.environ.get("KERNEL_ARCH_LIST") or DEFAULT_ARCHES)
    from serverless_llm.engine import model_builder
    from serverless_llm.engine.kernel_warmup import SweepLimits, compile_launches, list_launches
    from serverless_llm.engine.kernels import launch_keys, mla_attention, paged_attention
    from serverless_llm.engine.layers.attention import TritonAttentionBackend
    from serverless_llm.engine.llm_engine import LLMEngine
    from serverless_llm.worker.baked import apply_baked_model
    from serverless_llm.worker.settings import Settings

    apply_baked_model()
    settings = Settings.from_env()
    if settings.model_name is None:
        print("compile_kernels: no MODEL_NAME, nothing to compile")
        return 0
    config = settings.engine_config()
    config.device = "cpu"
    config.decode_capture = "off"
    config.kernel_warmup = False
    config.num_kv_blocks = config.num_kv_blocks or 64
    # A GPU worker's step budget (model_builder.step_token_budget), not the CPU's.
    config.max_num_batched_tokens = config.max_num_batched_tokens or 8192
    # The Triton backend on a machine without a GPU: the sweep records launches, runs none.
    model_builder.make_attention_backend = lambda name, device: TritonAttentionBackend()
    t0 = time.perf_counter()
    engine = LLMEngine(config)
    limits = SweepLimits(engine.max_num_batched_tokens, config.max_num_seqs, engine.max_model_len)
    specs: dict = {}
    for sms in SM_COUNTS:
        for module in (paged_attention, mla_attention):
            if hasattr(module, "num_sms"):
                module.num_sms = lambda device, sms=sms: sms
        specs.update(dict.fromkeys(list_launches(engine.runner, limits, engine.inputs.images)))
    listed = time.perf_counter() - t0
    for arch in targets:
        start = time.perf_counter()
        compile_launches(specs, launch_keys.cuda_target(arch))
        print(f"compile_kernels: sm{arch}: {len(specs)} specialisations compiled in "
              f"{time.perf_counter() - start:.1f}s", flush=True)  # fmt: skip
    print(f"compile_kernels: listed in {listed:.1f}s into {os.environ.get('TRITON_CACHE_DIR')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
