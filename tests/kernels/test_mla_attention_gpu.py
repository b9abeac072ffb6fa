"""The MLA kernels compiled on a GPU at DeepSeek-V3's sizes (`pytest -m gpu`; skipped
elsewhere): the absorbed decode over a 512 + 64 latent cache for 128 heads (split-KV and not, an
e4m3 cache on GPUs that have it) and the expanded prefill at nope 128, rope 64, value 128,
against their float32 references.

Tolerances: bfloat16 3e-2 (probabilities rounded to bf16 before P @ latents), float32 1e-4."""

from __future__ import annotations

import pytest
import torch

from serverless_llm.engine.kernels.mla_attention import (
    expanded_prefill,
    expanded_prefill_reference,
    latent_decode,
    latent_decode_reference,
)
from tests.gpu_marks import GPU_ONLY
from tests.kernels.test_mla_attention import expanded_batch, latent_batch

pytestmark = GPU_ONLY

TOL = {torch.float32: dict(atol=1e-4, rtol=1e-4), torch.bfloat16: dict(atol=3e-2, rtol=3e-2)}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("splits", [None, 1, 8])
def test_latent_decode_at_deepseek_v3_size(dtype, splits):
    q, cache, meta = latent_batch(
        [0, 100, 1000, 4000], rank=512, rope=64, heads=128, dtype=dtype, block_size=16
    )
    want = latent_decode_reference(q, cache, meta, 0.07, 512)
    got = latent_decode(q, cache, meta, 0.07, 512, num_splits=splits)
    torch.testing.assert_close(got, want, **TOL[dtype])


def test_latent_decode_fp8_cache():
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("e4m3 needs sm89+ in the MLA kernel (older GPUs take the torch path)")
    q, cache, meta = latent_batch(
        [7, 300, 2000], rank=512, rope=64, heads=128, dtype=torch.bfloat16, block_size=16
    )
    cache8 = (cache.float() / 2.0).to(torch.float8_e4m3fn)
    want = latent_decode_reference(q, cache8, meta, 0.07, 512, kv_scale=2.0)
    got = latent_decode(q, cache8, meta, 0.07, 512, kv_scale=2.0)
    torch.testing.assert_close(got, want, **TOL[torch.bfloat16])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_expanded_prefill_at_deepseek_v3_size(dtype):
    b = expanded_batch(
        [(0, 1), (0, 700), (1500, 300), (0, 2048)],
        heads=16,
        nope=128,
        rope=64,
        vdim=128,
        dtype=dtype,
    )
    want = expanded_prefill_reference(b, 192**-0.5)
    torch.testing.assert_close(expanded_prefill(b, 192**-0.5), want, **TOL[dtype])
