"""An 8-bit float KV cache (KV_CACHE_DTYPE fp8, issue 16 item 4): the Triton KV write stores
the bytes of its torch reference (k / k_scale clamped to the format's range, rounded to e4m3 or
e5m2; exactly on a GPU, up to the interpreter's own rounding on CPU); Triton paged attention
and the torch backend read it back as the reference does (values times the scale), and equal
attention over the dequantized cache in the model dtype; end to end, the Triton backend
generates the torch backend's tokens over an fp8 cache. The same for an e4m3 cache held as
bytes (GPUs before sm89, kernels/e4m3.py's integer codec), whose writes equal torch's bytes
exactly, interpreter included; and the codec itself against torch's conversion, code by code
and on every tie."""

from __future__ import annotations

import dataclasses

import pytest
import torch

pytest.importorskip("triton")

from serverless_llm import LLM, SamplingParams  # noqa: E402
from serverless_llm.engine.kernels import e4m3  # noqa: E402
from serverless_llm.engine.kernels import kv_write as kv_write_module  # noqa: E402
from serverless_llm.engine.kernels import paged_attention as attention_module  # noqa: E402
from serverless_llm.engine.kernels.kv_write import (  # noqa: E402
    reshape_and_cache,
    reshape_and_cache_reference,
)
from serverless_llm.engine.kernels.paged_attention import (  # noqa: E402
    paged_attention,
    paged_attention_reference,
    paged_attention_torch,
    plan_torch_decodes,
)
from serverless_llm.engine.layers import attention as attention_layer  # noqa: E402
from tests.kernels.batch import DEVICE, make_batch  # noqa: E402

FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]
IDS = ["e4m3", "e5m2"]
REQUESTS = [(20, 1), (33, 1), (0, 9), (17, 5)]  # two decodes, a prompt, a chunk over context


# (cache dtype, e4m3 as bytes through the integer codec)
CACHES = [(torch.float8_e4m3fn, False), (torch.float8_e5m2, False), (torch.float8_e4m3fn, True)]
CACHE_IDS = ["e4m3", "e5m2", "e4m3-bytes"]


@pytest.mark.parametrize(("cache_dtype", "as_bytes"), CACHES, ids=CACHE_IDS)
@pytest.mark.parametrize("k_scale", [1.0, 0.01], ids=["scale1", "scale0.01-clamps"])
def test_kv_write_stores_the_reference_bytes(cache_dtype, as_bytes, k_scale):
    batch = make_batch(
        REQUESTS,
        block_size=8,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        dtype=torch.float16,
        num_padding=3,
    )
    k, v = batch.k * 4, batch.v  # with k_scale 0.01, |k| / 0.01 passes e4m3's 448: clamped
    want = batch.kv_cache.to(cache_dtype)
    got = want.clone()
    reshape_and_cache_reference(k, v, want, batch.meta.slot_mapping, None, k_scale, 0.5)
    reshape_and_cache(k, v, got, batch.meta.slot_mapping, k_scale, 0.5, e4m3_bytes=as_bytes)
    differ = got.view(torch.uint8) != want.view(torch.uint8)
    if DEVICE.type == "cpu" and not as_bytes:
        # Triton's interpreter converts to FP8 in software, unlike the GPU's hardware: it rounds
        # ties away from zero (torch: to even) and drops the carry when rounding up to the next
        # power of two (1.97 -> 1.0 where e4m3 gives 2.0). Only those may differ, and only here.
        gb, wb = got.view(torch.uint8)[differ].int(), want.view(torch.uint8)[differ].int()
        tie = ((gb ^ wb) & 0x80 == 0) & ((gb & 0x7F) - (wb & 0x7F)).abs().eq(1)
        w, g = want.float()[differ], got.float()[differ]
        carry = (g * 2 == w) & (w.abs().log2().frac() == 0)
        assert bool((tie | carry).all())
        assert differ.float().mean() < 0.02
    else:
        assert not differ.any()
    finite = want.float().isfinite().all()
    assert finite  # clamped, never inf or NaN


@pytest.mark.parametrize(("cache_dtype", "as_bytes"), CACHES, ids=CACHE_IDS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=["fp16", "fp32"])
def test_attention_reads_the_fp8_cache_times_its_scales(cache_dtype, as_bytes, dtype):
    batch = make_batch(
        REQUESTS, block_size=8, num_heads=4, num_kv_heads=2, head_dim=32, dtype=dtype
    )
    spec = dataclasses.replace(batch.spec, k_scale=0.5, v_scale=0.25)
    cache = batch.kv_cache.float()
    cache[0] /= spec.k_scale
    cache[1] /= spec.v_scale
    cache = cache.to(cache_dtype)
    reshape_and_cache_reference(
        batch.k, batch.v, cache, batch.meta.slot_mapping, None, spec.k_scale, spec.v_scale
    )
    want = paged_attention_reference(batch.q, cache, batch.meta, spec)
    # the same attention over the cache dequantized into the model dtype
    plain = cache.float()
    plain[0] *= spec.k_scale
    plain[1] *= spec.v_scale
    unscaled = dataclasses.replace(spec, k_scale=1.0, v_scale=1.0)
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-3, rtol=2e-3)
    torch.testing.assert_close(
        want, paged_attention_reference(batch.q, plain.to(dtype), batch.meta, unscaled), **tol
    )
    got = paged_attention(batch.q, cache, batch.meta, spec, e4m3_bytes=as_bytes)
    torch.testing.assert_close(got.float(), want.float(), **tol)
    plan_torch_decodes(batch.meta)
    torch_out = paged_attention_torch(batch.q, batch.k, batch.v, cache, batch.meta, spec)
    torch.testing.assert_close(torch_out.float(), want.float(), **tol)


@pytest.mark.parametrize("as_bytes", [False, True], ids=["e4m3", "e4m3-bytes"])
def test_triton_backend_matches_torch_over_an_fp8_cache(tiny_model_dirs, monkeypatch, as_bytes):
    """Under the interpreter the Triton backend's KV write runs its torch reference here: the
    interpreter's FP8 rounding differs from torch's on ties (test above), and one different
    byte is enough for a tiny random model's greedy tokens to part. Compiled on a GPU, the
    kernel itself writes. Held as bytes (the path of GPUs before sm89, forced here), the
    kernels' own codec writes and reads, exactly as torch rounds."""
    if as_bytes:
        calls = []

        def forced(dtype, device):
            calls.append(dtype)
            return dtype == torch.float8_e4m3fn

        monkeypatch.setattr(kv_write_module, "e4m3_as_bytes", forced)
        monkeypatch.setattr(attention_module, "e4m3_as_bytes", forced)
    elif DEVICE.type == "cpu":

        def write(k, v, kv_cache, slot_mapping, k_scale=1.0, v_scale=1.0):
            reshape_and_cache_reference(k, v, kv_cache, slot_mapping, None, k_scale, v_scale)

        monkeypatch.setattr(attention_layer, "reshape_and_cache", write)
    path = tiny_model_dirs["llama"]
    prompts = [[5 + (7 * i + j) % 300 for j in range(n)] for i, n in enumerate((3, 19, 40))]
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    tokens = {}
    for backend in ("torch", "triton"):
        monkeypatch.setenv("TRITON_INTERPRET", "1")
        llm = LLM(
            path,
            attention_backend=backend,
            dtype="float32",
            kv_cache_dtype="fp8",
            num_kv_blocks=64,
            block_size=8,
            max_model_len=256,
            max_num_batched_tokens=24,
        )
        assert llm.engine.kv_caches[0].dtype == torch.float8_e4m3fn
        tokens[backend] = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert tokens["triton"] == tokens["torch"]
    if as_bytes:
        assert calls and set(calls) == {torch.float8_e4m3fn}


# -- the integer codec, against torch's conversion -------------------------------------------------

_encode = _decode = None  # the codec's JIT functions, bound by _roundtrip_kernel


def _roundtrip_kernel():
    import triton
    import triton.language as tl

    from serverless_llm.engine.kernels.triton_lazy import LazyKernel

    global _encode, _decode
    _encode, _decode = (
        f.jit if isinstance(f, LazyKernel) else f for f in (e4m3.e4m3_encode, e4m3.e4m3_decode)
    )

    @triton.jit
    def roundtrip(x_ptr, code_ptr, back_ptr, n, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        x = tl.load(x_ptr + offs, mask=mask, other=0.0)
        code = _encode(x)
        tl.store(code_ptr + offs, code.to(tl.uint8), mask=mask)
        tl.store(back_ptr + offs, _decode(code), mask=mask)

    return roundtrip


def test_e4m3_codec_equals_torch_on_every_code_and_tie():
    """Every finite e4m3 value, the midpoints between neighbours (ties: to even), a float32 ulp
    either side of each midpoint, the subnormal/normal border, signed zeros and random values
    within +-448: the codes equal torch's float8_e4m3fn bytes and decode to torch's values."""
    codes = torch.tensor([b for b in range(256) if b & 0x7F != 0x7F], dtype=torch.uint8)
    values = codes.view(torch.float8_e4m3fn).float()
    pos = values[values > 0].unique().sort().values
    mids = (pos[1:] + pos[:-1]) / 2
    first = pos[:1] / 2  # the tie between 0 and the smallest subnormal
    ties = torch.cat([first, mids])
    near = torch.cat([ties.nextafter(torch.tensor(0.0)), ties.nextafter(torch.tensor(1e9))])
    g = torch.Generator().manual_seed(0)
    rand = (torch.rand(4000, generator=g) * 2 - 1) * 448 * torch.rand(4000, generator=g) ** 6
    border = torch.tensor([2.0**-6, 2.0**-6 * (1 - 2**-10), 2.0**-7, 448.0, 0.0, -0.0, 1e-30])
    x = torch.cat([values, ties, -ties, near, -near, rand, border, -border]).float()
    code = torch.empty(len(x), dtype=torch.uint8, device=DEVICE)
    back = torch.empty(len(x), dtype=torch.float32, device=DEVICE)
    block = 256
    _roundtrip_kernel()[(triton_cdiv(len(x), block),)](
        x.to(DEVICE), code, back, len(x), BLOCK=block
    )
    want = x.to(torch.float8_e4m3fn)
    assert torch.equal(code.cpu(), want.view(torch.uint8))
    assert torch.equal(back.cpu(), want.float())
    assert torch.equal(back.cpu().signbit(), want.float().signbit())  # -0 stays -0


def triton_cdiv(a: int, b: int) -> int:
    return -(-a // b)
