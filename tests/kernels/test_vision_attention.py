"""Vision attention over packed variable-length sequences (kernels/vision_attention.py): the
Triton kernel (interpreted on CPU, compiled where there is a GPU) against the per-sequence torch
reference; tests/kernels/test_vision_attention_gpu.py compares them at real tower sizes on a GPU.

The interpreted grid: sequences of 1, 5, 16 and 37 tokens in one launch (37 spans several query
and key tiles of 16; 1 is a tile almost all padding), head dims 16 and 40 (padded to 64), float32
and float16, tiny head counts. Tolerances as the paged kernel's: float32 1e-5; float16 4e-3 (the
probabilities are rounded to fp16 before P @ V, as flash attention does).
"""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("triton")

from serverless_llm.engine.kernels.paged_attention import TileConfig  # noqa: E402
from serverless_llm.engine.kernels.vision_attention import (  # noqa: E402
    cu_seqlens_of,
    vision_attention,
    vision_attention_reference,
    vision_attention_triton,
    vision_tiles,
)
from tests.kernels.batch import DEVICE  # noqa: E402

TOL = {
    torch.float32: dict(atol=1e-5, rtol=1e-5),
    torch.float16: dict(atol=4e-3, rtol=4e-3),
    torch.bfloat16: dict(atol=3e-2, rtol=3e-2),
}
LENGTHS = [1, 5, 16, 37]
SMALL_TILES = TileConfig(block_m=16, block_n=16, num_warps=4, num_stages=1)


def _qkv(total: int, heads: int, head_dim: int, dtype, device=DEVICE, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return [
        torch.randn(total, heads, head_dim, generator=g).to(device=device, dtype=dtype)
        for _ in range(3)
    ]


def _sdpa_alone(q, k, v, lengths, scale=None):
    """Each sequence through SDPA by itself in float32, without the packing: what the reference
    must equal."""
    outs, s = [], 0
    for n in lengths:
        qs, ks, vs = (t[s : s + n].transpose(0, 1).float() for t in (q, k, v))
        o = torch.nn.functional.scaled_dot_product_attention(qs, ks, vs, scale=scale)
        outs.append(o.transpose(0, 1))
        s += n
    return torch.cat(outs)


@pytest.mark.parametrize("head_dim", [16, 40], ids=lambda d: f"d{d}")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_kernel_matches_reference(dtype, head_dim):
    lengths = LENGTHS
    q, k, v = _qkv(sum(lengths), 2, head_dim, dtype, seed=head_dim)
    cu = cu_seqlens_of(lengths, DEVICE)
    out = vision_attention_triton(q, k, v, cu, config=SMALL_TILES)
    ref = vision_attention_reference(q, k, v, cu)
    assert out.dtype == dtype and out.shape == q.shape
    torch.testing.assert_close(out.float(), ref.float(), **TOL[dtype])


def test_reference_is_sdpa_per_sequence():
    lengths = [3, 1, 7]
    q, k, v = _qkv(sum(lengths), 2, 8, torch.float32, device="cpu")
    ref = vision_attention_reference(q, k, v, cu_seqlens_of(lengths, "cpu"), scale=0.3)
    torch.testing.assert_close(ref, _sdpa_alone(q, k, v, lengths, scale=0.3))


def test_default_tiles_strided_inputs_scale_and_empty_sequences():
    """What the towers hand over: q, k, v unbound from one fused qkv projection (strided rows),
    a scale, a zero-length sequence among them, and the launcher's own tiles and max_seqlen."""
    lengths = [5, 0, 37, 16]
    total, heads, d = sum(lengths), 2, 16
    g = torch.Generator().manual_seed(3)
    qkv = torch.randn(total, 3, heads, d, generator=g).to(DEVICE)
    q, k, v = qkv.unbind(1)
    cu = cu_seqlens_of(lengths, DEVICE)
    out = vision_attention(q, k, v, cu, scale=0.2, use_kernel=True)
    torch.testing.assert_close(
        out, vision_attention_reference(q, k, v, cu, 0.2), **TOL[torch.float32]
    )
    # the reference of the dispatcher off the kernel
    torch.testing.assert_close(
        vision_attention(q, k, v, cu, scale=0.2, use_kernel=False),
        _sdpa_alone(q, k, v, [n for n in lengths if n], 0.2),
    )


def test_windows_are_shorter_sequences():
    """Qwen2.5-VL's windows: a frame's patches cut into windows of 4 and a cut one of 2; every
    window attends within itself (the kernel's answer for a window equals that window alone)."""
    lengths = [4, 4, 4, 2, 4]
    q, k, v = _qkv(sum(lengths), 1, 16, torch.float32, seed=7)
    out = vision_attention_triton(q, k, v, cu_seqlens_of(lengths, DEVICE), config=SMALL_TILES)
    torch.testing.assert_close(out.cpu(), _sdpa_alone(q, k, v, lengths).cpu(), **TOL[torch.float32])


def test_tiles():
    assert vision_tiles(80, 1024, torch.bfloat16) == TileConfig(128, 64, 8, 2)
    assert vision_tiles(64, 64, torch.bfloat16).block_m == 64  # Qwen2.5-VL windows
    assert vision_tiles(16, 1, torch.float16).block_m == 16  # tl.dot's least
    assert vision_tiles(72, 4096, torch.float32).block_m == 32


def test_refuses_mismatched_shapes():
    q, k, _ = _qkv(4, 2, 16, torch.float32, device="cpu")
    with pytest.raises(ValueError, match="one shape"):
        vision_attention_triton(q, k, k[:, :1], cu_seqlens_of([4], "cpu"))


@pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1", reason="the smoke run is the interpreter's"
)
def test_bench_cpu_smoke(capsys):
    from bench.vision_attention import main

    assert main(["--cpu-smoke"]) == 0
    summary = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("SUMMARY ")]
    assert len(summary) == 1 and "windows_vs_sdpa=" in summary[0]
