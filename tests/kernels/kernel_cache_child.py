"""A worker-like process for the kernel cache tests (test_kernel_cache.py): a tiny model on the
Triton backend with Triton's compiler for a real NVIDIA target and no GPU (a stand-in driver
names the target; nothing is launched). Run by path with TRITON_INTERPRET unset:

    python kernel_cache_child.py MODEL_DIR ARCH MODE [KERNEL ...]

MODE `aot`: prints {"keys": [...]}: the on-disk cache keys of the warm-up's listed
specialisations, computed ahead of time (launch_keys.cache_key).
MODE `runtime`: prints {"keys": [...]}: the keys Triton's own launch path (JITFunction.run, its
binder for the target) asks its cache for while the model serves requests, each launch stopped
before it compiles.
MODE `warmup`: compiles the listed specialisations (only those of the named kernels, when
given) into TRITON_CACHE_DIR and prints {"specs": n, "compiled": c, "hits": h}, counted by
Triton's compilation listener.
"""

from __future__ import annotations

import json
import os
import sys

os.environ.pop("TRITON_INTERPRET", None)  # Triton's real JIT functions, not the interpreter's
os.environ["HF_HUB_OFFLINE"] = "1"


class StandInDriver:
    """What Triton's launch path asks the driver: the target, a device, a stream."""

    def __init__(self, arch: int) -> None:
        from triton.backends.compiler import GPUTarget

        self.target = GPUTarget("cuda", arch, 32)

    def get_current_target(self):
        return self.target

    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device=None) -> int:
        return 0


class StopBeforeCompile(Exception):
    pass


def main() -> None:
    model_dir, arch, mode, *kernels = sys.argv[1:]
    arch = int(arch)
    from serverless_llm import LLM
    from serverless_llm.engine import model_builder
    from serverless_llm.engine.layers.attention import TritonAttentionBackend

    # The engine refuses the Triton backend on a CPU outside the interpreter; here nothing runs.
    model_builder.make_attention_backend = lambda name, device: TritonAttentionBackend()
    llm = LLM(model_dir, attention_backend="triton", dtype="float16", block_size=16,
              num_kv_blocks=32, max_model_len=64, max_num_batched_tokens=16, max_num_seqs=2,
              decode_capture="off")  # fmt: skip
    from triton import knobs
    from triton.runtime.driver import driver

    from serverless_llm.engine.kernel_warmup import SweepLimits, list_launches
    from serverless_llm.engine.kernels import launch_keys

    driver.set_active(StandInDriver(arch))
    e = llm.engine
    specs = list_launches(e.runner, SweepLimits(e.max_num_batched_tokens, 2, e.max_model_len))
    if kernels:  # the named kernels only (quick compiles for the shared-cache test)
        specs = [s for s in specs if s.name in kernels]
    target = launch_keys.cuda_target(arch)
    if mode == "aot":
        print(json.dumps({"keys": sorted({launch_keys.cache_key(s, target) for s in specs})}))
    elif mode == "runtime":
        print(json.dumps({"keys": sorted(runtime_keys(llm))}))
    elif mode == "warmup":
        counts = {"compiled": 0, "hits": 0}

        def listener(*, cache_hit: bool, **kwargs) -> None:
            counts["hits" if cache_hit else "compiled"] += 1

        knobs.compilation.listener = listener
        from serverless_llm.engine.kernel_warmup import compile_launches

        compile_launches(specs, target)
        print(json.dumps({"specs": len(specs), **counts}))


def runtime_keys(llm) -> set[str]:
    """The cache keys Triton's own launch path computes for the requests' launches: every
    launch goes through JITFunction.run (binder, in-memory key, compile), which is stopped as
    it asks the on-disk cache."""
    import hashlib

    from triton.compiler import compiler
    from triton.runtime.jit import JITFunction

    from serverless_llm import SamplingParams

    asked: set[str] = set()
    real_key = compiler.get_cache_key

    def get_cache_key(*args, **kwargs):
        key = real_key(*args, **kwargs)
        asked.add(hashlib.sha256(key.encode("utf-8")).hexdigest())
        raise StopBeforeCompile

    real_run = JITFunction.run

    def run(self, *args, grid, warmup, **kwargs):
        try:
            return real_run(self, *args, grid=grid, warmup=True, **kwargs)
        except StopBeforeCompile:
            return None

    compiler.get_cache_key, JITFunction.run = get_cache_key, run
    try:
        prompts = [[5 + i % 50 for i in range(n)] for n in (1, 5, 17, 40)]
        llm.generate(prompts, SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
    finally:
        compiler.get_cache_key, JITFunction.run = real_key, real_run
    return asked


if __name__ == "__main__":
    main()
