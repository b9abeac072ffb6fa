"""An MXFP4 packer written from the format's description (the OCP Microscaling spec's FP4 type,
as gpt-oss checkpoints store their experts), for tests: float weights in, the checkpoint's
`*_blocks` and `*_scales` tensors out, and a gpt-oss checkpoint rewritten that way.

Per block of 32 consecutive values along a row: one E8M0 scale byte s (the power of two
2^(s - 127)), the smallest that brings the block's largest magnitude within E2M1's 6; each value
divided by it and rounded to the nearest E2M1 value (0, 0.5, 1, 1.5, 2, 3, 4, 6 and negatives;
ties to the even code), the 4-bit codes two to a byte, the even element in the low nibble.
"""

from __future__ import annotations

import json
import math
import os
import shutil

import torch
from safetensors.torch import load_file, save_file

E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]  # codes 0-7; code | 8 is the negative


def mxfp4_pack(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [..., K] (K a multiple of 32) -> (blocks [..., K / 32, 16] uint8, scales [..., K / 32]
    uint8)."""
    *lead, k = w.shape
    assert k % 32 == 0, k
    x = w.detach().float().reshape(*lead, k // 32, 32)
    amax = x.abs().amax(dim=-1)
    # the least e with amax / 2^e <= 6 (an all-zero block takes the smallest scale)
    exps = torch.tensor(
        [math.ceil(math.log2(a / 6.0)) if a > 0 else -127 for a in amax.reshape(-1).tolist()],
        dtype=torch.int32,
    ).reshape(amax.shape)
    exps = exps.clamp(-127, 127)
    scaled = x / torch.pow(2.0, exps.float())[..., None]
    magnitudes = torch.tensor(E2M1)
    dist = (scaled.abs()[..., None] - magnitudes).abs()  # [..., 32, 8]
    # nearest magnitude; a tie goes to the even code (the first of two equal distances is
    # the lower code, so prefer it only when it is even)
    best = dist.argmin(dim=-1)
    nxt = (best + 1).clamp(max=7)
    tie = (dist.gather(-1, nxt[..., None])[..., 0] == dist.gather(-1, best[..., None])[..., 0]) & (
        nxt != best
    )
    best = torch.where(tie & (best % 2 == 1), nxt, best)
    codes = best.to(torch.uint8) | ((scaled < 0).to(torch.uint8) << 3)
    pairs = codes.reshape(*lead, k // 32, 16, 2)
    blocks = pairs[..., 0] | (pairs[..., 1] << 4)
    return blocks.contiguous(), (exps + 127).to(torch.uint8)


def mxfp4_unpack(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The packer's inverse, written the same plain way (float32)."""
    table = torch.tensor(E2M1 + [-v for v in E2M1])
    codes = torch.stack([blocks & 0x0F, blocks >> 4], dim=-1).long()
    values = table[codes].reshape(*blocks.shape[:-1], 32)
    values = values * torch.pow(2.0, scales.float() - 127)[..., None]
    return values.reshape(*blocks.shape[:-2], -1)


EXPERT_WEIGHTS = ("gate_up_proj", "down_proj")  # stored [E, in, out] in a float checkpoint


def write_mxfp4_checkpoint(src: str, dst: str) -> None:
    """Copies the gpt-oss checkpoint at `src` to `dst` with every expert projection as MXFP4
    blocks and scales (rows = output channels, as the released checkpoints store them), and a
    quantization_config saying so; everything else as it was."""
    os.makedirs(dst, exist_ok=True)
    for name in os.listdir(src):
        if not name.endswith(".safetensors") and name != "config.json":
            shutil.copy(os.path.join(src, name), os.path.join(dst, name))
    tensors = {}
    for name in sorted(os.listdir(src)):
        if not name.endswith(".safetensors"):
            continue
        for key, t in load_file(os.path.join(src, name)).items():
            leaf = key.rsplit(".", 1)[-1]
            if leaf in EXPERT_WEIGHTS:
                blocks, scales = mxfp4_pack(t.transpose(1, 2))  # [E, out, in]
                tensors[f"{key}_blocks"], tensors[f"{key}_scales"] = blocks, scales
            else:
                tensors[key] = t.contiguous()
    save_file(tensors, os.path.join(dst, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(src, "config.json")) as f:
        config = json.load(f)
    config["quantization_config"] = {
        "quant_method": "mxfp4",
        "modules_to_not_convert": [
            "model.layers.*.self_attn",
            "model.layers.*.mlp.router",
            "model.embed_tokens",
            "lm_head",
        ],
    }
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
