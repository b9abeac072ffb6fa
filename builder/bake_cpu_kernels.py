"""Image build step: the baked model's native CPU kernels built and its linears' row choice
measured on the build machine's CPU, into the image's native kernel cache (docs/engine.md,
"Cold start"), so a worker started on the same kind of machine neither compiles nor measures.

The model is loaded as the worker loads it on CPU (`model_builder.load_model`: the library built
and self-checked, the linears packed and their native rows chosen by `use_native_linears`, which
writes the choice into NATIVE_KERNEL_CACHE). A choice measured while other processes kept the
cores busy is not cached (engine/layers/linear.py), so a busy build machine measures up to
ATTEMPTS times. The choice's key is the CPU's model name, flags, core counts and threads
(`linear.cpu_identity`): a worker on another CPU never reads it, it measures its own.

    NATIVE_KERNEL_CACHE=/opt/cpu-native-cache python builder/bake_cpu_kernels.py

Needs a C compiler (the image installs one with CPU_KERNELS=1); without one there is nothing to
build and the step says so.
"""

from __future__ import annotations

import os
import shutil
import sys
import time

ATTEMPTS = 3


def main() -> int:
    from serverless_llm.engine.kernels import cpu_native
    from serverless_llm.engine.layers import linear
    from serverless_llm.engine.model_builder import load_model
    from serverless_llm.worker.baked import apply_baked_model
    from serverless_llm.worker.settings import Settings

    apply_baked_model()
    settings = Settings.from_env()
    if settings.model_name is None:
        print("bake_cpu_kernels: no MODEL_NAME, nothing to bake")
        return 0
    if shutil.which(os.environ.get("CC", "").strip() or "cc") is None:
        print("bake_cpu_kernels: no C compiler, nothing to bake (the worker runs the torch path)")
        return 0
    config = settings.engine_config()
    config.device = "cpu"
    native = cpu_native.load()
    if native is None:
        print("bake_cpu_kernels: the native kernels did not build or failed their self-check")
        return 1
    for attempt in range(1, ATTEMPTS + 1):
        start = time.perf_counter()
        model = load_model(config).model
        shapes = linear.linear_shapes(model)
        if not shapes:
            print("bake_cpu_kernels: library built; the model has no native linears")
            return 0
        path = linear.choice_file(native, shapes)
        if path.exists():
            print(f"bake_cpu_kernels: library {native.path.name} and row choice {path.name} in "
                  f"{path.parent} (attempt {attempt}, {time.perf_counter() - start:.1f}s)")  # fmt: skip
            return 0
        del model
    print(f"bake_cpu_kernels: the row choice was measured under load {ATTEMPTS} times and not "
          "kept; the worker measures it at its first start")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
