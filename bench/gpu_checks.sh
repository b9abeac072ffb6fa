#!/usr/bin/env bash
# Issues 3's, 13's, 16's, 17's, 35's, 36's and 37's GPU checks in one command, for a lent GPU machine whose python3 already holds torch,
# triton, transformers and pytest (nothing else is needed: the engine imports the rest lazily):
#   bash bench/gpu_checks.sh
# runs `pytest -m gpu tests/kernels tests/engine`, `bench/kernels.py`, `bench/capture.py`
# (CUDA graphs against eager decode steps), `bench/w4a16.py` (the 4-bit GEMM against float16
# matmul), `bench/moe_kernel.py` (the fused MoE kernels against a per-expert torch loop) and
# `bench/recurrent_kernels.py` (the hybrid models' delta rule and SSD scan),
# `bench/vision_attention.py` (the vision towers' attention against SDPA), `bench/mla_decode.py`
# (MLA's decode kernel against the bandwidth its latents need), `bench/mxfp4_gemm.py` (the MXFP4
# expert GEMM against bf16 matmul), `bench/fp8_block_gemm.py` (the block-scaled FP8 GEMM against
# bf16 matmul), then
# the rest of tests/kernels compiled on the GPU (bounded by KERNEL_TESTS_TIMEOUT seconds), and
# leaves the device description,
# both logs and the benchmark's JSON under $OUT (default /tmp/gpu-checks). The figures go into
# docs/benchmarks.md by hand, with the device and the date.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gpu-checks}
mkdir -p "$OUT"
export PYTHONPATH="$PWD/src:$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
PY=${PYTHON:-python3}

{
    date -u +%FT%TZ
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv
    "$PY" -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
} 2>&1 | tee "$OUT/device.txt"

"$PY" -m pytest -q -m gpu tests/kernels tests/engine -p no:cacheprovider -rs 2>&1 | tee "$OUT/pytest-gpu.log"
tests=${PIPESTATUS[0]}
"$PY" bench/kernels.py --json "$OUT/kernels.json" 2>&1 | tee "$OUT/kernels.log"
bench=${PIPESTATUS[0]}
"$PY" bench/capture.py --device cuda --dtype bfloat16 2>&1 | tee "$OUT/capture.log"
capture=${PIPESTATUS[0]}
"$PY" bench/w4a16.py 2>&1 | tee "$OUT/w4a16.log"
w4a16=${PIPESTATUS[0]}
"$PY" bench/moe_kernel.py 2>&1 | tee "$OUT/moe_kernel.log"
moe=${PIPESTATUS[0]}
# Issue 35: the chunked gated delta rule and SSD scan at a 4k-token prefill (and a 64-request
# decode) against their references and the physical limit.
"$PY" bench/recurrent_kernels.py --json "$OUT/recurrent_kernels.json" 2>&1 | tee "$OUT/recurrent_kernels.log"
recurrent=${PIPESTATUS[0]}
# Issue 36: the vision towers' attention over packed images and Qwen2.5-VL's windows against
# torch's SDPA at the same shapes (its GPU tests are in the pytest -m gpu run above).
"$PY" bench/vision_attention.py 2>&1 | tee "$OUT/vision_attention.log"
vision=${PIPESTATUS[0]}
# Issue 37: MLA's absorbed decode kernel against the bandwidth its latents need (bar 0.70).
"$PY" bench/mla_decode.py --json "$OUT/mla_decode.json" 2>&1 | tee "$OUT/mla_decode.log"
mla=${PIPESTATUS[0]}
# Issue 37: the MXFP4 expert GEMM (gpt-oss's experts kept 4-bit) against bf16 matmul, M = 1/16/256.
"$PY" bench/mxfp4_gemm.py 2>&1 | tee "$OUT/mxfp4_gemm.log"
mxfp4=${PIPESTATUS[0]}
# Issue 37: the block-scaled FP8 GEMM (DeepSeek-style 128 x 128 block scales, kept 8-bit) against
# bf16 matmul, M = 1/16/256.
"$PY" bench/fp8_block_gemm.py 2>&1 | tee "$OUT/fp8_block_gemm.log"
fp8_block=${PIPESTATUS[0]}
# Issue 40: verification steps of hybrid models (Qwen3-Next, Jamba, LFM2), k = 3, replayed
# in CUDA graphs against eager (its correctness tests: tests/engine/test_captured_verification_gpu.py).
"$PY" bench/verification_capture.py --device cuda --dtype bfloat16 2>&1 | tee "$OUT/verification_capture.log"
verify_capture=${PIPESTATUS[0]}
# Last, every other kernel test compiled on this GPU (on CPU they run under the interpreter): the
# references at small shapes, the e4m3 byte codec, the FP8 W8A16 GEMM, LoRA and MoE kernels.
# Bounded, so the figures above always come back within a device call.
timeout "${KERNEL_TESTS_TIMEOUT:-420}" "$PY" -m pytest -q -m "not gpu" tests/kernels \
    -p no:cacheprovider 2>&1 | tee "$OUT/pytest-kernels-compiled.log"
kernel_tests=${PIPESTATUS[0]}
echo "pytest -m gpu exit $tests; bench/kernels.py exit $bench; bench/capture.py exit $capture;" \
    "bench/w4a16.py exit $w4a16; bench/moe_kernel.py exit $moe;" \
    "bench/recurrent_kernels.py exit $recurrent; bench/vision_attention.py exit $vision;" \
    "bench/mla_decode.py exit $mla; bench/mxfp4_gemm.py exit $mxfp4;" \
    "bench/fp8_block_gemm.py exit $fp8_block;" \
    "bench/verification_capture.py exit $verify_capture;" \
    "compiled kernel tests exit $kernel_tests"
exit $((tests || bench || capture || w4a16 || moe || recurrent || vision || mla || mxfp4 || fp8_block || verify_capture || kernel_tests))
