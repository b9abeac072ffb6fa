"""The vision attention kernel compiled on a GPU at the towers' real sizes (`pytest -m gpu`;
skipped elsewhere): against the float32 per-sequence reference, and inside a full-width
Qwen2.5-VL tower against the tower's own SDPA path.

Tolerances (atol = rtol): bfloat16 3e-2, float16 5e-3 (probabilities rounded to the input dtype
before P @ V, as flash attention does), float32 1e-4 (IEEE dots).
"""

from __future__ import annotations

import pytest
import torch

from serverless_llm.engine.kernels.vision_attention import (
    cu_seqlens_of,
    vision_attention,
    vision_attention_reference,
)
from tests.gpu_marks import GPU_ONLY

pytestmark = GPU_ONLY

TOL = {
    torch.float32: dict(atol=1e-4, rtol=1e-4),
    torch.float16: dict(atol=5e-3, rtol=5e-3),
    torch.bfloat16: dict(atol=3e-2, rtol=3e-2),
}
# Four 1024-patch images (448 x 448 at 14 px), a 4096-patch one and odd sizes; Qwen2.5-VL's
# 64-patch windows of the same images (and cut ones at the edges).
IMAGES = [1024] * 4 + [4096, 777, 1]
WINDOWS = [64] * 256 + [48, 16, 32]


def _qkv(total: int, heads: int, head_dim: int, dtype, seed: int):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(total, heads, head_dim, generator=g).to("cuda", dtype) for _ in range(3)]


@pytest.mark.parametrize("lengths", [IMAGES, WINDOWS], ids=["images", "windows"])
@pytest.mark.parametrize("head_dim", [64, 72, 80], ids=lambda d: f"d{d}")
@pytest.mark.parametrize(
    "dtype", [torch.bfloat16, torch.float16, torch.float32], ids=["bf16", "fp16", "fp32"]
)
def test_kernel_matches_reference_at_tower_sizes(dtype, head_dim, lengths):
    """16 heads (Qwen2.5-VL: head_dim 80; CLIP-L, Pixtral: 64; SigLIP-so400m: 72)."""
    q, k, v = _qkv(sum(lengths), 16, head_dim, dtype, seed=head_dim)
    cu = cu_seqlens_of(lengths, "cuda")
    out = vision_attention(q, k, v, cu, max_seqlen=max(lengths))  # on CUDA: the kernel
    ref = vision_attention_reference(q, k, v, cu)
    torch.testing.assert_close(out.float(), ref.float(), **TOL[dtype])


def test_max_seqlen_read_from_cu_seqlens():
    q, k, v = _qkv(300, 2, 80, torch.bfloat16, seed=1)
    cu = cu_seqlens_of([100, 200], "cuda")
    torch.testing.assert_close(
        vision_attention(q, k, v, cu), vision_attention(q, k, v, cu, max_seqlen=200)
    )


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_qwen2_5_vl_tower_on_the_kernel_equals_its_sdpa_path(dtype):
    """Qwen2.5-VL's tower at full width (hidden 1280, 16 heads of 80), 4 layers (windows, then
    full attention), two images of 448 x 448 and 308 x 532 (1024 and 836 patches)."""
    import transformers

    from serverless_llm.engine.models.vision.qwen_vl import Qwen2_5VLFamily

    config = transformers.Qwen2_5_VLConfig(
        vision_config=dict(
            depth=4,
            hidden_size=1280,
            intermediate_size=3420,
            num_heads=16,
            fullatt_block_indexes=[1, 3],
            out_hidden_size=896,
        ),
        text_config=dict(hidden_size=896, num_attention_heads=14, num_key_value_heads=2),
    )
    tower = Qwen2_5VLFamily().build_tower(config, dtype)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in tower.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * (0.02 if p.dim() > 1 else 1.0))
    tower = tower.to("cuda").eval()
    vc = config.vision_config
    assert vc.hidden_size // vc.num_heads == 80
    width = vc.in_channels * vc.temporal_patch_size * vc.patch_size**2
    items = []
    for h, w in ((32, 32), (22, 38)):
        pixels = torch.randn(h * w, width, generator=g).to("cuda", dtype)
        items.append({"pixel_values": pixels, "image_grid_thw": torch.tensor([[1, h, w]])})
    tower.set_use_kernels(False)
    want = tower.encode(items)
    tower.set_use_kernels(True)
    got = tower.encode(items)
    for a, b in zip(got, want):
        err = (a.embeds.float() - b.embeds.float()).abs().max()
        scale = b.embeds.float().abs().max()
        assert err <= (3e-2 if dtype == torch.bfloat16 else 1e-3) * scale, (err, scale)
