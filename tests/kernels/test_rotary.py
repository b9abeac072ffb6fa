"""Rotary embedding (Triton, interpreted, in place) against the torch references: neox against
the CPU path's `apply_rotary_ref` exactly as the model calls it, gpt-j and partial rotary against
`rotate_table_ref`. Tables come from `cos_sin_cache` with default, linear and llama3 scaling.

Tolerances: float32 atol = rtol = 1e-5 (positions up to 4k: |x| a few units); float16 one ulp
(atol = rtol = 1e-3): the kernel rounds once where the reference rounds each product.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from serverless_llm.engine.kernels.rotary import (  # noqa: E402
    rotary_embedding,
    rotary_embedding_reference,
)
from serverless_llm.engine.layers.rotary import cos_sin_cache, inv_frequencies  # noqa: E402
from tests.kernels.batch import DEVICE  # noqa: E402

TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.float16: dict(atol=1e-3, rtol=1e-3)}
MAX_POS = 4096
ROPE = {
    "default": {"rope_type": "default", "rope_theta": 10000.0},
    "linear": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0},
    "llama3": {
        "rope_type": "llama3",
        "rope_theta": 500000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 1024,
    },
}


def _inputs(dtype, head_dim, num_heads=4, num_kv_heads=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    T = 9
    positions = torch.tensor([0, 1, 2, 17, 511, 1000, 2047, 4000, 4095], device=DEVICE)
    # q and k as views into one fused QKV output, as the model hands them over.
    qkv = torch.randn(T, (num_heads + 2 * num_kv_heads) * head_dim, generator=g).to(DEVICE, dtype)
    q = qkv[:, : num_heads * head_dim].view(T, num_heads, head_dim)
    k = qkv[:, num_heads * head_dim : (num_heads + num_kv_heads) * head_dim].view(
        T, num_kv_heads, head_dim
    )
    return positions, q, k


@pytest.mark.parametrize("scaling", list(ROPE), ids=list(ROPE))
@pytest.mark.parametrize("is_neox", [True, False], ids=["neox", "gptj"])
@pytest.mark.parametrize("head_dim", [64, 128], ids=lambda d: f"d{d}")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_matches_reference(dtype, head_dim, is_neox, scaling):
    table = cos_sin_cache(inv_frequencies(ROPE[scaling], head_dim, MAX_POS), MAX_POS).to(DEVICE)
    positions, q, k = _inputs(dtype, head_dim, seed=head_dim)
    q_ref, k_ref = rotary_embedding_reference(positions, q, k, table, is_neox)
    q_out, k_out = rotary_embedding(positions, q, k, table, is_neox)
    assert q_out.data_ptr() == q.data_ptr()  # in place
    torch.testing.assert_close(q_out, q_ref, **TOL[dtype])
    torch.testing.assert_close(k_out, k_ref, **TOL[dtype])


@pytest.mark.parametrize("is_neox", [True, False], ids=["neox", "gptj"])
def test_partial_rotary_leaves_the_tail(is_neox):
    """A table narrower than the head (rot_dim 32 of 80, odd head counts): the tail is kept."""
    table = cos_sin_cache(inv_frequencies(ROPE["default"], 32, MAX_POS), MAX_POS).to(DEVICE)
    positions, q, k = _inputs(torch.float32, 80, num_heads=3, num_kv_heads=1)
    tail = q[..., 32:].clone()
    q_ref, k_ref = rotary_embedding_reference(positions, q, k, table, is_neox)
    q_out, k_out = rotary_embedding(positions, q, k, table, is_neox)
    torch.testing.assert_close(q_out, q_ref, **TOL[torch.float32])
    torch.testing.assert_close(k_out, k_ref, **TOL[torch.float32])
    assert torch.equal(q_out[..., 32:], tail)
