"""Compiles every kernel for real NVIDIA targets (sm80, sm90) with Triton's own compiler, no GPU
needed: the interpreter accepts code the GPU compiler refuses (non-constexpr globals, dot shapes,
layouts), so this is the CPU machines' check that the kernels still build for the device. Also
reads the register/stack use of the main bf16 attention configs from the cubin and reports any
spill (a large slowdown). Run as a script with TRITON_INTERPRET unset:

    .venv/bin/python -m tests.kernels.gpu_compile [--quick]

prints one line per kernel and `FAILED <n>` at the end (exit status 1 if n > 0)."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from serverless_llm.engine.kernels import (
    activation,
    causal_conv1d,
    fp8_block,
    fused_moe,
    fused_moe_mxfp4,
    fused_moe_w4a16,
    gated_delta,
    kv_write,
    layer_norm,
    mla_attention,
    rms_norm,
    rotary,
    selective_scan,
    ssd,
    triton_common,
    vision_attention,
    w4a16,
)
from serverless_llm.engine.kernels import fp8 as fp8_weights
from serverless_llm.engine.kernels import paged_attention as pa
from serverless_llm.engine.kernels.triton_lazy import LazyKernel

# The most shared memory one block may use on sm86 and sm89 GPUs (RTX 30xx/40xx, A40, L4, L40S):
# 99 KiB; A100 allows 163 KiB and H100 227 KiB, but a kernel must run on all of them.
SHARED_LIMIT = 101376

# Pointer arguments whose element type is not the data dtype.
POINTER_TYPES = {
    "part_acc_ptr": "*fp32",
    "part_ml_ptr": "*fp32",
    "block_tables_ptr": "*i32",
    "seq_lens_ptr": "*i32",
    "query_start_loc_ptr": "*i32",
    "tile_req_ptr": "*i32",
    "tile_q0_ptr": "*i32",
    "slot_ptr": "*i64",
    "pos_ptr": "*i64",
    "cache_ptr": "*fp32",
    "alibi_ptr": "*fp32",
    "cu_seqlens_ptr": "*i32",
    "key_limit_ptr": "*i32",
}
FLOAT_ARGS = {"scale_log2e", "softcap_log2e", "eps", "k_scale", "v_scale", "fp8_max", "q_scale"}
FLOAT_ARGS |= {"dt_min", "dt_max"}  # kernels/ssd.py
FLOAT_ARGS |= {"alpha", "limit"}  # the clamped SwiGLU (kernels/activation.py)
# Integer arguments that are multiples of 16 at real shapes (Triton specialises on that).
# (split, window, soft-cap and ALiBi) of the attention kernel: plain, split with a window, and
# with a window, soft-cap and ALiBi (Gemma 2, BLOOM).
OPTION_SETS = ((False, False, False), (True, True, False), (False, True, True))
ALIGNED = re.compile(r"^stride_(q|o|k|v|c)|^num_heads$")


def compile_kernel(
    kernel, dtype: str, constexprs: dict, arch: int, warps: int, stages: int, pointers=None
):
    # A kernel not launched yet is still the module's LazyKernel: its JIT function is `.jit`.
    fn = kernel.jit if isinstance(kernel, LazyKernel) else kernel
    signature: dict[str, str] = {}
    attrs = {}
    types = {**POINTER_TYPES, **(pointers or {})}
    for i, name in enumerate(fn.arg_names):
        if name in constexprs:
            signature[name] = "constexpr"
        elif name.endswith("_ptr"):
            signature[name] = types.get(name, f"*{dtype}")
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif name in FLOAT_ARGS:
            signature[name] = "fp32"
        else:
            signature[name] = "i32"
            if ALIGNED.match(name):
                attrs[(i,)] = [["tt.divisibility", 16]]
    src = ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs)
    options = {"num_warps": warps, "num_stages": stages}
    return triton.compile(src, target=GPUTarget("cuda", arch, 32), options=options)


def stack_bytes(kernel) -> int | None:
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    if not os.path.exists(tool):
        return None
    path = f"/tmp/gpu_compile_{os.getpid()}.cubin"
    with open(path, "wb") as f:
        f.write(kernel.asm["cubin"])
    try:
        out = subprocess.run([tool, "-res-usage", path], capture_output=True, text=True).stdout
    finally:
        os.remove(path)
    m = re.search(r"STACK:(\d+)", out)
    return int(m.group(1)) if m else None


def attention_constexprs(group: int, cfg: pa.TileConfig, head_dim: int, dtype: str, **flags):
    g_pad = triton.next_power_of_2(group)
    block_m = max(cfg.block_m, g_pad)
    return dict(
        GROUP=group,
        G_PAD=g_pad,
        BLOCK_Q=block_m // g_pad,
        BLOCK_M=block_m,
        BLOCK_N=cfg.block_n,
        HEAD_DIM=head_dim,
        D_PAD=triton.next_power_of_2(head_dim),
        CACHE_BLOCK=16,
        HAS_WINDOW=flags.get("window", False),
        HAS_SOFTCAP=flags.get("softcap", False),
        HAS_ALIBI=flags.get("alibi", False),
        SPLIT=flags.get("split", False),
        IEEE=dtype == "fp32",
        KV_FP8=flags.get("kv_fp8", False),
        KV_E4M3_BYTES=flags.get("e4m3_bytes", False),
        HAS_LIMITS=flags.get("limits", False),
        HAS_CHUNK=flags.get("chunk", False),
        HAS_SINKS=flags.get("sinks", False),
        # the encoders' flags (constexprs with defaults in the kernel: not named here, they
        # would be compiled as runtime ints and keep both branches)
        DENSE_KV=flags.get("dense", False),
        BIDIRECTIONAL=flags.get("dense", False),
    )


def main(quick: bool = False) -> int:
    """All arches, dtypes and head groups; `quick` (the pytest run): sm90, bf16 and fp32, two
    head groups, and sm80 for the kernels that read e4m3 as bytes."""
    failed = 0
    arches = (90,) if quick else (90, 80)
    dtypes = ("bf16", "fp32") if quick else ("bf16", "fp16", "fp32")
    shapes = ((4, 128), (1, 64), (2, 256))
    if not quick:
        shapes += ((8, 128), (32, 128))
    torch_dtypes = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}

    def attempt(
        label: str, jit_fn, dtype, constexprs, arch, warps, stages, no_spill=False, pointers=None
    ):
        nonlocal failed
        try:
            kernel = compile_kernel(jit_fn, dtype, constexprs, arch, warps, stages, pointers)
        except Exception as e:  # noqa: BLE001 - report every failure, keep going
            failed += 1
            print(f"FAIL sm{arch} {label}: {type(e).__name__}: {str(e)[:1500]}", flush=True)
            return
        if kernel.metadata.shared > SHARED_LIMIT:
            failed += 1
            print(f"FAIL sm{arch} {label}: {kernel.metadata.shared} bytes of shared memory, "
                  f"over the {SHARED_LIMIT} a block may use on sm86/sm89", flush=True)  # fmt: skip
            return
        stack = stack_bytes(kernel) if no_spill else None
        if stack:
            failed += 1
            print(f"FAIL sm{arch} {label}: spills ({stack} bytes of stack)", flush=True)
            return
        print(f"ok   sm{arch} {label} shared={kernel.metadata.shared}", flush=True)

    for arch in arches:
        for dtype in dtypes:
            tdt = torch_dtypes[dtype]
            for group, d in shapes:
                for kind in ("decode", "prefill"):
                    cfg = (
                        pa.decode_tiles(group, d, tdt)
                        if kind == "decode"
                        else pa.prefill_tiles(group, d, 2048, tdt)
                    )
                    for split, window, opts in OPTION_SETS:
                        ce = attention_constexprs(
                            group,
                            cfg,
                            d,
                            dtype,
                            split=split,
                            window=window,
                            softcap=opts,
                            alibi=opts,
                        )
                        label = (
                            f"attention {dtype} {kind} g{group} d{d} split={split} "
                            f"window={window} softcap_alibi={opts}"
                        )
                        no_spill = arch == 90 and dtype == "bf16" and group in (2, 4) and not split
                        attempt(
                            label,
                            pa._paged_attention_kernel,
                            dtype,
                            ce,
                            arch,
                            cfg.num_warps,
                            cfg.num_stages,
                            no_spill,
                        )
            # Bidirectional spans (Gemma 3's image tokens): per-token key limits in prefill.
            cfg = pa.prefill_tiles(2, 256, 2048, tdt)
            ce = attention_constexprs(2, cfg, 256, dtype, window=True, softcap=True, limits=True)
            attempt(f"attention {dtype} prefill g2 d256 key limits", pa._paged_attention_kernel,
                    dtype, ce, arch, cfg.num_warps, cfg.num_stages)  # fmt: skip
            # Encoders (BERT's 12 heads of 64; ModernBERT's local layers: a two-sided window):
            # K/V read from the step's rows, no causal mask.
            cfg = pa.prefill_tiles(1, 64, 512, tdt)
            for window in (False, True):
                ce = attention_constexprs(1, cfg, 64, dtype, dense=True, window=window)
                attempt(f"attention {dtype} encoder g1 d64 window={window}",
                        pa._paged_attention_kernel, dtype, ce, arch, cfg.num_warps,
                        cfg.num_stages)  # fmt: skip
            # Chunked local attention (Llama 4's layers), decode and prefill, split and not.
            for kind, split in (("decode", True), ("prefill", False)):
                cfg = pa.decode_tiles(5, 128, tdt) if kind == "decode" else pa.prefill_tiles(
                    5, 128, 2048, tdt)  # fmt: skip
                ce = attention_constexprs(5, cfg, 128, dtype, split=split, chunk=True)
                attempt(f"attention {dtype} {kind} g5 d128 chunked split={split}",
                        pa._paged_attention_kernel, dtype, ce, arch, cfg.num_warps,
                        cfg.num_stages)  # fmt: skip
            # Sinks (gpt-oss: 8 query heads a KV head of 64) with its window, split and not.
            for kind, split in (("decode", True), ("prefill", False)):
                cfg = pa.decode_tiles(8, 64, tdt) if kind == "decode" else pa.prefill_tiles(
                    8, 64, 2048, tdt)  # fmt: skip
                ce = attention_constexprs(8, cfg, 64, dtype, split=split, window=True, sinks=True)
                attempt(f"attention {dtype} {kind} g8 d64 sinks split={split}",
                        pa._paged_attention_kernel, dtype, ce, arch, cfg.num_warps,
                        cfg.num_stages)  # fmt: skip
            ce = dict(HEAD_DIM=128, D_PAD=128, S_PAD=32, HEADS=1)
            attempt(f"reduce {dtype}", pa._reduce_splits_kernel, dtype, ce, arch, 4, 1)
            # The vision towers' attention over packed images (kernels/vision_attention.py):
            # CLIP/Pixtral's head_dim 64, Qwen2.5-VL's 80 (padded to 128) over whole images and
            # over its 64-patch windows, and 256.
            for d, longest in ((64, 1024), (80, 1024), (80, 64), (256, 1024)):
                cfg = vision_attention.vision_tiles(d, longest, tdt)
                ce = dict(HEAD_DIM=d, D_PAD=triton.next_power_of_2(d), BLOCK_M=cfg.block_m,
                          BLOCK_N=cfg.block_n, IEEE=dtype == "fp32")  # fmt: skip
                attempt(f"vision attention {dtype} d{d} longest={longest}",
                        vision_attention._vision_attention_kernel, dtype, ce, arch,
                        cfg.num_warps, cfg.num_stages, no_spill=arch == 90 and dtype == "bf16")  # fmt: skip
            ce = dict(
                QUANT=False, E4M3_BYTES=False, CACHE_BLOCK=16, TOKENS=4, D_PAD=128, ROW_PAD=1024
            )
            attempt(f"kv_write {dtype}", kv_write._kv_write_kernel, dtype, ce, arch, 4, 1)
            # The 8-bit float KV cache (KV_CACHE_DTYPE fp8): written, and read by attention.
            # Before sm89 Triton refuses its e4m3 type: the launchers pass such a cache as bytes
            # (kernels/e4m3.py's codec), as here.
            for fp8 in ("fp8e4nv", "fp8e5"):
                as_bytes = fp8 == "fp8e4nv" and arch < 89
                ptr = "*u8" if as_bytes else f"*{fp8}"
                caches = {"k_cache_ptr": ptr, "v_cache_ptr": ptr}
                ce = dict(
                    QUANT=True,
                    E4M3_BYTES=as_bytes,
                    CACHE_BLOCK=16,
                    TOKENS=4,
                    D_PAD=128,
                    ROW_PAD=1024,
                )
                kernel = kv_write._kv_write_kernel
                label = f"{fp8}{' as bytes' if as_bytes else ''}"
                attempt(f"kv_write {dtype} {label}", kernel, dtype, ce, arch, 4, 1, pointers=caches)
                for kind in ("decode", "prefill"):
                    cfg = (
                        pa.decode_tiles(4, 128, tdt)
                        if kind == "decode"
                        else pa.prefill_tiles(4, 128, 2048, tdt)
                    )
                    ce = attention_constexprs(4, cfg, 128, dtype, kv_fp8=True, e4m3_bytes=as_bytes)
                    attempt(
                        f"attention {dtype} {kind} {label} cache",
                        pa._paged_attention_kernel,
                        dtype,
                        ce,
                        arch,
                        cfg.num_warps,
                        cfg.num_stages,
                        pointers=caches,
                    )
            # The GPTQ/AWQ GEMM, at decode and prefill row counts, 4 and 8 bits.
            if dtype != "fp32":
                w4 = {"qw_ptr": "*i32", "g_ptr": "*i32", "out_ptr": "*fp32"}
                for bits in (4, 8):
                    for m in (1, 256):
                        bm, bn, bk, _ = w4a16._gemm_blocks(m, 4096, 4096)
                        ce = dict(BITS=bits, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk)
                        attempt(
                            f"w4a16 {dtype} bits={bits} m={m}",
                            w4a16._w4a16_kernel,
                            dtype,
                            ce,
                            arch,
                            4,
                            1,
                            pointers=w4,
                        )
            # FP8 weights on GPUs without FP8 arithmetic (sm80 is the case that matters): the
            # W8A16 GEMM, its bytes decoded with integer operations.
            if dtype != "fp32":
                f8 = {"w_ptr": "*u8", "s_ptr": "*fp32", "out_ptr": "*fp32"}
                for m in (1, 256):
                    bm, bn, bk, _ = w4a16._gemm_blocks(m, 4096, 4096)
                    ce = dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk)
                    attempt(
                        f"fp8 w8a16 {dtype} m={m}",
                        fp8_weights._fp8_w8a16_kernel,
                        dtype,
                        ce,
                        arch,
                        4,
                        1,
                        pointers=f8,
                    )
            # Block-scaled FP8 weights (DeepSeek's 128 x 128 blocks): the W8A16 GEMM reading the
            # weight with Triton's e4m3 type (sm89+) or as bytes (sm80), at decode and prefill.
            if dtype != "fp32" or arch >= 89:
                for m in (1, 16, 256):
                    bm, bn, bk, _ = w4a16._gemm_blocks(m, 7168, 2048)
                    as_bytes = arch < 89
                    ptrs = {"w_ptr": "*u8" if as_bytes else "*fp8e4nv", "s_ptr": "*fp32",
                            "srow_ptr": "*i32", "out_ptr": "*fp32"}  # fmt: skip
                    ce = dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, SCALE_K=128,
                              E4M3_BYTES=as_bytes)  # fmt: skip
                    attempt(f"fp8 block {dtype} m={m}{' as bytes' if as_bytes else ''}",
                            fp8_block._fp8_block_kernel, dtype, ce, arch, 4, 1,
                            pointers=ptrs)  # fmt: skip
            # The fused MoE grouped GEMM: decode and prefill tiles, gate/up and down (weighted).
            moe_ptrs = {
                "rows_ptr": "*i32",
                "block_expert_ptr": "*i32",
                "weight_ptr": "*fp32",
                "wscale_ptr": "*fp32",
                "srow_ptr": "*i32",
            }
            for rows in (2, 4096):
                bm, bn, bk, warps = fused_moe.moe_tiles(rows, 8, tdt)
                # gate/up; down with the router weight; LoRA's expand (adds into the output);
                # FP8 experts (e4m3 bytes), gate/up and down; block-FP8 experts (DeepSeek's,
                # scale_k 128), gate/up and down
                # expert biases (gpt-oss), gate/up and down
                for a_div, weighted, acc, fp8, bias, scale_k in (
                    (2, False, False, False, False, 0),
                    (1, True, False, False, False, 0),
                    (1, False, True, False, False, 0),
                    (2, False, False, True, False, 0),
                    (1, True, False, True, False, 0),
                    (2, False, False, True, False, 128),
                    (1, True, False, True, False, 128),
                    (2, False, False, False, True, 0),
                    (1, True, False, False, True, 0),
                ):
                    if fp8 and dtype == "fp32":
                        continue
                    ce = dict(
                        A_DIV=a_div,
                        MUL_WEIGHT=weighted,
                        ACCUMULATE=acc,
                        W_E4M3=fp8,
                        SCALE_K=scale_k,
                        HAS_BIAS=bias,
                        BLOCK_M=bm,
                        BLOCK_N=bn,
                        BLOCK_K=bk,
                    )
                    ptrs = {**moe_ptrs, "w_ptr": "*u8"} if fp8 else moe_ptrs
                    attempt(
                        f"grouped gemm {dtype} rows={rows} weighted={weighted} accumulate={acc}"
                        f" fp8={fp8} bias={bias} scale_k={scale_k}",
                        fused_moe._moe_gemm_kernel,
                        dtype,
                        ce,
                        arch,
                        warps,
                        1,
                        pointers=ptrs,
                    )
            # The packed-expert MoE GEMM (GPTQ/AWQ experts kept at their bit width).
            if dtype != "fp32":
                ptrs = {**moe_ptrs, "qw_ptr": "*i32", "g_ptr": "*i32", "perm_ptr": "*i64"}
                for rows, bits, perm in ((2, 4, True), (4096, 4, False), (2, 8, False)):
                    bm, bn, bk, warps = fused_moe.moe_tiles(rows, 8, tdt)
                    ce = dict(
                        BITS=bits,
                        HAS_PERM=perm,
                        A_DIV=2,
                        MUL_WEIGHT=rows > 2,
                        BLOCK_M=bm,
                        BLOCK_N=bn,
                        BLOCK_K=bk,
                    )
                    attempt(
                        f"moe w4a16 {dtype} rows={rows} bits={bits} perm={perm}",
                        fused_moe_w4a16._moe_w4a16_kernel,
                        dtype,
                        ce,
                        arch,
                        warps,
                        1,
                        pointers=ptrs,
                    )
            # The MXFP4 MoE GEMM (gpt-oss's experts kept 4-bit), gate/up with biases and down.
            ptrs = {**moe_ptrs, "b_ptr": "*u8", "s_ptr": "*u8"}
            for rows, weighted in ((2, False), (4096, True)):
                bm, bn, bk, warps = fused_moe.moe_tiles(rows, 32, tdt)
                ce = dict(A_DIV=1 if weighted else 4, MUL_WEIGHT=weighted, HAS_BIAS=True,
                          BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk)  # fmt: skip
                attempt(f"moe mxfp4 {dtype} rows={rows}", fused_moe_mxfp4._moe_mxfp4_kernel,
                        dtype, ce, arch, warps, 1, pointers=ptrs)  # fmt: skip
            for res in (False, True):
                block, warps = triton_common.row_launch_shape(4096)
                ce = dict(HAS_RESIDUAL=res, BLOCK=block)
                attempt(
                    f"rms_norm {dtype} res={res}",
                    rms_norm._rms_norm_kernel,
                    dtype,
                    ce,
                    arch,
                    warps,
                    1,
                )
            for res, affine in ((False, False), (True, True)):
                block, warps = triton_common.row_launch_shape(4096)
                ce = dict(HAS_RESIDUAL=res, HAS_WEIGHT=affine, HAS_BIAS=affine, BLOCK=block)
                attempt(
                    f"layer_norm {dtype} res={res} affine={affine}",
                    layer_norm._layer_norm_kernel,
                    dtype,
                    ce,
                    arch,
                    warps,
                    1,
                )
            # Mamba-2's SSD scan (kernels/ssd.py): the decode step and the chunked prompt scan at
            # P = 64 with N = 128 (Mamba2, Nemotron-H) and N = 256 (Bamba, Granite 4.0-H defaults),
            # with D, dt bias and softplus and without.
            ssd_ptrs = {"A_ptr": "*fp32", "state_ptr": "*fp32", "state_slots_ptr": "*i32",
                        "has_init_ptr": "*i1"}  # fmt: skip
            for n_state, opts in ((128, True), (256, False)):
                block_p, block_n, chunk, warps, decode_p = ssd.tile_sizes(64, n_state, tdt)
                flags = dict(HAS_D=opts, HAS_BIAS=opts, SOFTPLUS=opts)
                ce = dict(**flags, BLOCK_P=decode_p, BLOCK_N=block_n)
                attempt(f"ssd decode {dtype} N={n_state} D_bias_softplus={opts}",
                        ssd._ssd_decode_kernel, dtype, ce, arch, 4, 1, pointers=ssd_ptrs)  # fmt: skip
                ce = dict(**flags, IEEE=dtype == "fp32", CHUNK=chunk, BLOCK_P=block_p,
                          BLOCK_N=block_n)  # fmt: skip
                attempt(f"ssd chunk scan {dtype} N={n_state} D_bias_softplus={opts}",
                        ssd._ssd_chunk_scan_kernel, dtype, ce, arch, warps, 1,
                        no_spill=dtype != "fp32", pointers=ssd_ptrs)  # fmt: skip
            for act in ("silu", "gelu", "gelu_new", "relu", "relu2"):
                ce = dict(ACT=activation.ACT_CODES[act], BLOCK=activation.ACT_BLOCK)
                kernel = activation._act_and_mul_kernel
                attempt(f"act_and_mul {act} {dtype}", kernel, dtype, ce, arch, 4, 1)
                kernel = activation._activation_kernel
                attempt(f"activation {act} {dtype}", kernel, dtype, ce, arch, 4, 1)
            ce = dict(ACT=activation.CLAMPED_SWIGLU_CODE, BLOCK=activation.ACT_BLOCK)
            attempt(f"act_and_mul clamped swiglu {dtype}", activation._act_and_mul_kernel, dtype,
                    ce, arch, 4, 1)  # fmt: skip
            # Mamba-1's selective scan (Jamba, Mamba, FalconMamba): D and z and the dt bias with
            # softplus, and none of them.
            scan_ptrs = {
                "A_ptr": "*fp32",
                "D_ptr": "*fp32",
                "delta_bias_ptr": "*fp32",
                "state_ptr": "*fp32",
                "state_slots_ptr": "*i32",
                "has_initial_state_ptr": "*i1",
            }
            for opts in (True, False):
                ce = dict(HAS_D=opts, HAS_Z=opts, HAS_DELTA_BIAS=opts, DELTA_SOFTPLUS=opts,
                          BLOCK_D=selective_scan.scan_block_d(8192, 16), N_PAD=16)  # fmt: skip
                kernel = selective_scan._selective_scan_kernel
                label = f"selective_scan {dtype} D_z_bias_softplus={opts}"
                attempt(label, kernel, dtype, ce, arch, 4, 1, pointers=scan_ptrs)
            for neox in (True, False):
                ce = dict(IS_NEOX=neox, QH_PAD=32, KH_PAD=8, HALF_PAD=64)
                attempt(f"rotary {dtype} neox={neox}", rotary._rotary_kernel, dtype, ce, arch, 8, 1)
            # The recurrent layers' short convolution (decode and prefill tiles, K = 4 and 3)
            # and their gated RMSNorm (per head; one group over a Mamba-2 row).
            conv_ptrs = {"slots_ptr": "*i32", "init_ptr": "*i1"}
            for kw, silu, block_t, block_c, warps in ((4, True, 1, 256, 2), (3, False, 16, 128, 4)):
                ce = dict(KW=kw, HAS_BIAS=silu, SILU=silu, BLOCK_T=block_t, BLOCK_C=block_c,
                          STATE_PAD=triton.next_power_of_2(kw - 1))  # fmt: skip
                kernel = causal_conv1d._causal_conv1d_kernel
                label = f"causal_conv1d {dtype} K={kw} block_t={block_t}"
                attempt(label, kernel, dtype, ce, arch, warps, 1, pointers=conv_ptrs)
            for before, group in ((True, 128), (False, 4096)):
                block, warps = triton_common.row_launch_shape(group)
                ce = dict(NORM_BEFORE_GATE=before, ROUND_WEIGHTED=True, BLOCK=block)
                kernel = causal_conv1d._gated_rms_norm_kernel
                label = f"gated_rms_norm {dtype} norm_before_gate={before} group={group}"
                attempt(label, kernel, dtype, ce, arch, warps, 1)
            # The gated delta rule (Qwen3-Next's per-head decay, Kimi's per-channel one) at Dk = Dv
            # = 128: the recurrent decode kernel and the two chunked prefill kernels.
            delta_ptrs = {"g_ptr": "*fp32", "state_ptr": "*fp32", "slots_ptr": "*i32",
                          "init_ptr": "*i1", "chunk_start_ptr": "*i32", "chunk_end_ptr": "*i32",
                          "first_chunk_ptr": "*i32"}  # fmt: skip
            for name in ("u_ptr", "w_ptr", "qg_ptr", "kg_ptr", "p_ptr", "decay_ptr"):
                delta_ptrs[name] = "*fp32"
            for per_channel in (False, True):
                flags = dict(L2NORM=True, PER_CHANNEL=per_channel)
                ce = dict(flags, DK_PAD=128, BV=gated_delta._recurrent_block_v(128, 128))
                attempt(f"gated_delta recurrent {dtype} per_channel={per_channel}",
                        gated_delta._recurrent_kernel, dtype, ce, arch, 4, 1,
                        pointers=delta_ptrs)  # fmt: skip
                ce = dict(flags, **gated_delta._prepare_config(128, 128))
                attempt(f"gated_delta chunk_prepare {dtype} per_channel={per_channel}",
                        gated_delta._chunk_prepare_kernel, dtype, ce, arch,
                        gated_delta._PREPARE_WARPS, 1, pointers=delta_ptrs)  # fmt: skip
            attempt(f"gated_delta chunk_state {dtype}", gated_delta._chunk_state_kernel, dtype,
                    gated_delta._state_config(128, 128), arch, gated_delta._STATE_WARPS, 1,
                    pointers=delta_ptrs)  # fmt: skip
            # Latent attention (MLA, kernels/mla_attention.py): the absorbed decode at
            # DeepSeek-V3's latent (512 + 64) and a 256-wide one, split and not, an 8-bit cache;
            # the expanded prefill at DeepSeek's nope 128 and Mistral 4's 64 (rope 64, v 128).
            for rank, split, fp8 in ((512, False, False), (512, True, False), (256, False, False),
                                     (512, False, True)):  # fmt: skip
                if fp8 and (dtype == "fp32" or arch < 89):
                    continue
                cfg = mla_attention.latent_decode_tiles(128, rank, tdt, fp8)
                ce = dict(RANK=rank, ROPE=64, L_PAD=rank, R_PAD=64, BLOCK_H=cfg.block_h,
                          BLOCK_N=cfg.block_n, CACHE_BLOCK=16, SPLIT=split,
                          IEEE=dtype == "fp32", KV_FP8=fp8)  # fmt: skip
                cache = {"cache_ptr": "*fp8e4nv" if fp8 else f"*{dtype}"}
                attempt(f"latent decode {dtype} L{rank} split={split} fp8={fp8}",
                        mla_attention._latent_decode_kernel, dtype, ce, arch, cfg.num_warps,
                        cfg.num_stages, no_spill=dtype == "bf16", pointers=cache)  # fmt: skip
            for nope in (128, 64):
                bm, bn, warps = mla_attention.expanded_prefill_tiles(tdt, 2048)
                ce = dict(NOPE=nope, ROPE=64, VDIM=128, N_PAD=nope, R_PAD=64, V_PAD=128,
                          BLOCK_M=bm, BLOCK_N=bn, IEEE=dtype == "fp32")  # fmt: skip
                attempt(f"expanded prefill {dtype} nope{nope}",
                        mla_attention._expanded_prefill_kernel, dtype, ce, arch, warps, 2,
                        no_spill=dtype == "bf16",
                        pointers={"cu_q_ptr": "*i32", "cu_k_ptr": "*i32"})  # fmt: skip
    if quick:
        # The quick pass is sm90; the e4m3 byte codec exists for sm80, so compile its users there.
        caches = {"k_cache_ptr": "*u8", "v_cache_ptr": "*u8"}
        ce = dict(QUANT=True, E4M3_BYTES=True, CACHE_BLOCK=16, TOKENS=4, D_PAD=128, ROW_PAD=1024)
        kernel = kv_write._kv_write_kernel
        attempt("kv_write bf16 e4m3 as bytes", kernel, "bf16", ce, 80, 4, 1, pointers=caches)
        cfg = pa.decode_tiles(4, 128, torch.bfloat16)
        ce = attention_constexprs(4, cfg, 128, "bf16", kv_fp8=True, e4m3_bytes=True)
        kernel = pa._paged_attention_kernel
        attempt("attention bf16 decode e4m3 as bytes", kernel, "bf16", ce, 80,
                cfg.num_warps, cfg.num_stages, pointers=caches)  # fmt: skip
        bm, bn, bk, _ = w4a16._gemm_blocks(1, 4096, 4096)
        f8 = {"w_ptr": "*u8", "s_ptr": "*fp32", "out_ptr": "*fp32"}
        ce = dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk)
        kernel = fp8_weights._fp8_w8a16_kernel
        attempt("fp8 w8a16 bf16 m=1", kernel, "bf16", ce, 80, 4, 1, pointers=f8)
        f8 = {**f8, "srow_ptr": "*i32"}
        ce = dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, SCALE_K=128, E4M3_BYTES=True)
        kernel = fp8_block._fp8_block_kernel
        attempt("fp8 block bf16 m=1 as bytes", kernel, "bf16", ce, 80, 4, 1, pointers=f8)
    print(f"FAILED {failed}")
    return 1 if failed else 0


if __name__ == "__main__":
    if os.environ.get("TRITON_INTERPRET") == "1":
        sys.exit("run with TRITON_INTERPRET unset: the interpreter does not compile")
    sys.exit(main(quick="--quick" in sys.argv[1:]))
