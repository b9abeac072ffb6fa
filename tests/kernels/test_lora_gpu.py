"""The LoRA Triton path compiled for a real GPU at Llama-3-8B projection shapes (4096 -> 6144
fused q/k/v with three rank blocks, 4096 -> 28672 gate/up, 14336 -> 4096 down), 8 slots of rank
16, float16 and bfloat16, 1 to 300 tokens with every slot and tokens without adapter, against
the per-group torch reference on the same GPU. Run with `pytest -m gpu` on a CUDA machine;
skipped elsewhere. Tolerance relative to the largest delta: 1e-2 (fp16), 4e-2 (bf16)."""

from __future__ import annotations

import pytest
import torch

from serverless_llm.engine.kernels.lora_delta import add_lora, add_lora_reference
from tests.gpu_marks import GPU_ONLY

pytestmark = GPU_ONLY
TOL = {torch.float16: 1e-2, torch.bfloat16: 4e-2}
SHAPES = {"qkv": (4096, 6144, 48), "gate_up": (4096, 28672, 32), "down": (14336, 4096, 16)}


@pytest.mark.parametrize("tokens", [1, 9, 64, 300])
@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_add_lora_on_gpu(shape, tokens, dtype):
    k, n, ranks = SHAPES[shape]
    slots = 8
    g = torch.Generator(device="cuda").manual_seed(tokens)
    x = torch.randn(tokens, k, device="cuda", generator=g).to(dtype)
    a = (torch.randn(slots, ranks, k, device="cuda", generator=g) / k**0.5).to(dtype)
    b = (torch.randn(n, slots, ranks, device="cuda", generator=g) / ranks**0.5).to(dtype)
    base = torch.zeros(tokens, n, device="cuda", dtype=dtype)
    token_slots = torch.randint(-1, slots, (tokens,), device="cuda", generator=g)
    groups = [(s, torch.nonzero(token_slots == s).flatten()) for s in range(slots)]
    groups = [(s, rows) for s, rows in groups if rows.numel()]
    got = add_lora(base.clone(), x, a, b, token_slots).float()
    want = add_lora_reference(base.clone(), x, a, b, groups).float()
    scale = want.abs().max().clamp(min=1e-6)
    assert ((got - want).abs().max() / scale) < TOL[dtype]
