"""The vision towers of Qwen2.5-VL and Qwen3-VL (see qwen_vl.py for what each computes), in plain
torch. Module and parameter names follow the checkpoints' (under `model.visual.` or `visual.`),
so loading is a lookup by name.

Several images go through one pass: their patches are concatenated and attention runs within
each image (each frame), or within each window, as padded batches of those segments (the Triton
kernel of kernels/vision_attention.py instead, all segments in one launch, where the engine runs
kernels or the tower is on CUDA).
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from ...kernels.vision_attention import cu_seqlens_of, kernel_wanted, vision_attention
from ...loader.meta_build import quiet_meta
from ...multimodal.base import ImageFeatures, VisionTower, load_tower_tensors, prefixed_name

TOWER_PREFIXES = ("model.visual.", "visual.")


def activation(name: str):
    """The function transformers' ACT2FN gives for `name` (the activations these towers use)."""
    acts = {
        "silu": F.silu,
        "swish": F.silu,
        "gelu": F.gelu,
        "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
        "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
        "quick_gelu": lambda x: x * torch.sigmoid(1.702 * x),
        "relu": F.relu,
    }
    if name not in acts:
        raise ValueError(f"vision activation {name!r} is not supported")
    return acts[name]


def _grids(grid_thw: torch.Tensor) -> list[tuple[int, int, int]]:
    return [tuple(int(v) for v in row) for row in grid_thw.tolist()]


def frame_lengths(grids) -> list[int]:
    """Patches of each frame of each image, in order: the segments full attention runs over."""
    return [h * w for t, h, w in grids for _ in range(t)]


def patch_positions(grids, merge: int) -> torch.Tensor:
    """[patches, 2] (row, column) of every patch in the processor's merge-block order: blocks
    of merge x merge patches row by row, the patches of a block row by row; every frame alike."""
    out = []
    for t, h, w in grids:
        rows = torch.arange(h).view(h // merge, merge, 1, 1).expand(-1, -1, w // merge, merge)
        cols = torch.arange(w).view(1, 1, w // merge, merge).expand(h // merge, merge, -1, -1)
        rc = torch.stack([rows.permute(0, 2, 1, 3), cols.permute(0, 2, 1, 3)], dim=-1)
        out.append(rc.reshape(h * w, 2).repeat(t, 1))
    return torch.cat(out)


def rotary_cos_sin(positions: torch.Tensor, head_dim: int, theta: float):
    """2-D rotary of a vision head: a quarter of the head's dims turn with the row, a quarter
    with the column, at the frequencies of a head_dim / 2 rope; both halves alike (neox).
    float32 [patches, head_dim] cos and sin."""
    half = head_dim // 2
    inv_freq = 1.0 / theta ** (torch.arange(0, half, 2, dtype=torch.float32) / half)
    pos = positions.to(torch.float32)
    angles = torch.cat([pos[:, :1] * inv_freq, pos[:, 1:] * inv_freq], dim=-1)
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos(), angles.sin()


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Neox rotation of x [N, heads, D] in float32, back in x's dtype."""
    xf = x.float()
    x1, x2 = xf.chunk(2, dim=-1)
    turned = torch.cat([-x2, x1], dim=-1)
    return (xf * cos[:, None] + turned * sin[:, None]).to(x.dtype)


def segment_attention(q, k, v, lengths: list[int]) -> torch.Tensor:
    """Bidirectional attention within consecutive segments of `lengths` rows: q, k, v [N, heads,
    D] -> [N, heads * D]. Segments of one length go as one batch; others padded to the longest,
    the padding masked out of the keys."""
    n, heads, d = q.shape
    if len(set(lengths)) == 1:
        s, length = len(lengths), lengths[0]

        def batched(x):
            return x.reshape(s, length, heads, d).transpose(1, 2)

        out = F.scaled_dot_product_attention(batched(q), batched(k), batched(v))
        return out.transpose(1, 2).reshape(n, heads * d)
    lens = torch.tensor(lengths, device=q.device)
    longest = max(lengths)
    starts = torch.cumsum(lens, 0) - lens
    col = torch.arange(longest, device=q.device)
    valid = col[None, :] < lens[:, None]  # [S, L]
    index = (starts[:, None] + col[None, :]).clamp(max=n - 1)

    def padded(x):
        return x[index].transpose(1, 2)  # [S, heads, L, D]

    mask = valid[:, None, None, :]
    out = F.scaled_dot_product_attention(padded(q), padded(k), padded(v), attn_mask=mask)
    return out.transpose(1, 2)[valid].reshape(n, heads * d)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(dim))
        self.eps = eps

    def forward(self, x):
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


class PatchEmbed(nn.Module):
    """The 3-D convolution over (temporal, row, column) with stride = kernel, as a matrix
    product over the processor's flattened patches (C, T, P, P)."""

    def __init__(self, vc, bias: bool):
        super().__init__()
        kernel = (vc.temporal_patch_size, vc.patch_size, vc.patch_size)
        self.proj = nn.Conv3d(vc.in_channels, vc.hidden_size, kernel, stride=kernel, bias=bias)

    def forward(self, pixels):
        w = self.proj.weight
        return F.linear(pixels.to(w.dtype), w.reshape(w.shape[0], -1), self.proj.bias)


class Attention(nn.Module):
    use_kernels: bool | None = None  # the Triton kernel: set by the engine, else on CUDA

    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x, cos, sin, lengths):
        n = x.shape[0]
        q, k, v = self.qkv(x).view(n, 3, self.heads, -1).unbind(1)
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        if kernel_wanted(self.use_kernels, x):  # every frame or window in one launch
            cu = cu_seqlens_of(lengths, x.device)
            out = vision_attention(q, k, v, cu, use_kernel=True, max_seqlen=max(lengths))
            return self.proj(out.reshape(n, -1))
        return self.proj(segment_attention(q, k, v, lengths))


class GatedMLP(nn.Module):
    def __init__(self, dim: int, inner: int, act: str):
        super().__init__()
        self.gate_proj = nn.Linear(dim, inner)
        self.up_proj = nn.Linear(dim, inner)
        self.down_proj = nn.Linear(inner, dim)
        self.act = activation(act)

    def forward(self, x):
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class PlainMLP(nn.Module):
    def __init__(self, dim: int, inner: int, act: str):
        super().__init__()
        self.linear_fc1 = nn.Linear(dim, inner)
        self.linear_fc2 = nn.Linear(inner, dim)
        self.act = activation(act)

    def forward(self, x):
        return self.linear_fc2(self.act(self.linear_fc1(x)))


class Block(nn.Module):
    def __init__(self, norm1, norm2, attn, mlp):
        super().__init__()
        self.norm1, self.norm2, self.attn, self.mlp = norm1, norm2, attn, mlp

    def forward(self, x, cos, sin, lengths):
        x = x + self.attn(self.norm1(x), cos, sin, lengths)
        return x + self.mlp(self.norm2(x))


class Qwen2_5Merger(nn.Module):
    """RMSNorm per patch, merge^2 consecutive patches -> one row, Linear-GELU-Linear."""

    def __init__(self, vc):
        super().__init__()
        wide = vc.hidden_size * vc.spatial_merge_size**2
        self.ln_q = RMSNorm(vc.hidden_size)
        self.mlp = nn.Sequential(
            nn.Linear(wide, wide), nn.GELU(), nn.Linear(wide, vc.out_hidden_size)
        )

    def forward(self, x):
        return self.mlp(self.ln_q(x).reshape(-1, self.mlp[0].in_features))


class Qwen3Merger(nn.Module):
    """LayerNorm per patch (the DeepStack mergers: over the merged row), merge^2 consecutive
    patches -> one row, Linear-GELU-Linear."""

    def __init__(self, vc, after_merge: bool):
        super().__init__()
        self.wide = vc.hidden_size * vc.spatial_merge_size**2
        self.after_merge = after_merge
        self.norm = nn.LayerNorm(self.wide if after_merge else vc.hidden_size, eps=1e-6)
        self.linear_fc1 = nn.Linear(self.wide, self.wide)
        self.linear_fc2 = nn.Linear(self.wide, vc.out_hidden_size)

    def forward(self, x):
        if self.after_merge:
            x = self.norm(x.reshape(-1, self.wide))
        else:
            x = self.norm(x).reshape(-1, self.wide)
        return self.linear_fc2(F.gelu(self.linear_fc1(x)))


class QwenVisionTower(VisionTower):
    """What both towers share: construction without initialisation, loading by name, batching
    the images of one `encode` into one pass."""

    def __init__(self, config, dtype: torch.dtype):
        super().__init__()
        vc = config.vision_config
        self.vc = vc
        self.merge = vc.spatial_merge_size
        self.heads = vc.num_heads
        self.head_dim = vc.hidden_size // vc.num_heads
        self.theta = float((getattr(vc, "rope_parameters", None) or {}).get("rope_theta", 10000.0))
        with torch.device("meta"), quiet_meta():  # no torch._refs imports
            self.build(vc)
        self.to(dtype)
        with quiet_meta():
            self.to_empty(device="cpu")

    def build(self, vc) -> None:
        raise NotImplementedError

    def forward_images(self, pixels, grids) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Merged rows of all images ([tokens, text hidden]) and the DeepStack rows (per layer)."""
        raise NotImplementedError

    def rotary(self, grids, device):
        cos, sin = rotary_cos_sin(patch_positions(grids, self.merge), self.head_dim, self.theta)
        return cos.to(device), sin.to(device)

    @torch.no_grad()
    def encode(self, items: list[dict[str, torch.Tensor]]) -> list[ImageFeatures]:
        if not items:
            return []
        pixels = torch.cat([item["pixel_values"] for item in items])
        grid_thw = torch.cat([item["image_grid_thw"].reshape(-1, 3) for item in items])
        grids = _grids(grid_thw)
        merged, deep = self.forward_images(pixels, grids)
        sizes = [t * h * w // self.merge**2 for t, h, w in grids]
        embeds = merged.split(sizes)
        deep = [d.split(sizes) for d in deep]
        return [
            ImageFeatures(embeds[i], [d[i] for d in deep] if deep else None)
            for i in range(len(items))
        ]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        params = dict(self.named_parameters())
        local = [(p, "") for p in TOWER_PREFIXES]
        load_tower_tensors(params, weights, lambda n: prefixed_name(n, local), "Qwen-VL")


class Qwen2_5VisionTower(QwenVisionTower):
    def build(self, vc) -> None:
        dim = vc.hidden_size
        self.patch_embed = PatchEmbed(vc, bias=False)
        self.blocks = nn.ModuleList(
            Block(
                RMSNorm(dim),
                RMSNorm(dim),
                Attention(dim, vc.num_heads),
                GatedMLP(dim, vc.intermediate_size, vc.hidden_act),
            )
            for _ in range(vc.depth)
        )
        self.merger = Qwen2_5Merger(vc)
        self.full_layers = set(vc.fullatt_block_indexes or ())
        self.window_cells = max(1, vc.window_size // self.merge // vc.patch_size)

    def window_order(self, grids) -> tuple[torch.Tensor, list[int]]:
        """The merged cells (merge x merge patch blocks) of all images regrouped window by
        window (windows of window_cells x window_cells cells, row by row over each frame, the
        last ones cut at the edges; cells row by row within a window), and each window's
        patches."""
        order, lengths, base = [], [], 0
        cells = self.window_cells
        for t, h, w in grids:
            rows, cols = h // self.merge, w // self.merge
            r = torch.arange(rows).repeat_interleave(cols)
            c = torch.arange(cols).repeat(rows)
            window = (r // cells) * math.ceil(cols / cells) + c // cells
            in_frame = torch.argsort(window, stable=True)
            sizes = (torch.bincount(window) * self.merge**2).tolist()
            for frame in range(t):
                order.append(base + frame * rows * cols + in_frame)
                lengths += sizes
            base += t * rows * cols
        return torch.cat(order), lengths

    def forward_images(self, pixels, grids):
        x = self.patch_embed(pixels)
        device = x.device
        cos, sin = self.rotary(grids, device)
        cell_order, window_lengths = self.window_order(grids)
        unit = self.merge**2
        patch_order = (cell_order[:, None] * unit + torch.arange(unit)).reshape(-1).to(device)
        x, cos, sin = x[patch_order], cos[patch_order], sin[patch_order]
        full_lengths = frame_lengths(grids)
        for i, block in enumerate(self.blocks):
            lengths = full_lengths if i in self.full_layers else window_lengths
            x = block(x, cos, sin, lengths)
        merged = self.merger(x)
        return merged[torch.argsort(cell_order).to(device)], []


class Qwen3VisionTower(QwenVisionTower):
    def build(self, vc) -> None:
        dim = vc.hidden_size
        self.patch_embed = PatchEmbed(vc, bias=True)
        self.pos_embed = nn.Embedding(vc.num_position_embeddings, dim)
        self.side = int(vc.num_position_embeddings**0.5)
        self.blocks = nn.ModuleList(
            Block(
                nn.LayerNorm(dim, eps=1e-6),
                nn.LayerNorm(dim, eps=1e-6),
                Attention(dim, vc.num_heads),
                PlainMLP(dim, vc.intermediate_size, vc.hidden_act),
            )
            for _ in range(vc.depth)
        )
        self.merger = Qwen3Merger(vc, after_merge=False)
        self.deepstack_layers = list(getattr(vc, "deepstack_visual_indexes", None) or ())
        self.deepstack_merger_list = nn.ModuleList(
            Qwen3Merger(vc, after_merge=True) for _ in self.deepstack_layers
        )

    def position_embeddings(self, grids) -> torch.Tensor:
        """The learned square grid of position embeddings resampled to each image's patch grid
        (bilinear, corners aligned), in merge-block order, every frame alike: [patches, dim]."""
        table = self.pos_embed.weight.float().reshape(self.side, self.side, -1).permute(2, 0, 1)
        m = self.merge
        out = []
        for t, h, w in grids:
            grid = F.interpolate(table[None], size=(h, w), mode="bilinear", align_corners=True)[0]
            grid = grid.reshape(-1, h // m, m, w // m, m).permute(1, 3, 2, 4, 0)
            out.append(grid.reshape(h * w, -1).repeat(t, 1))
        return torch.cat(out)

    def forward_images(self, pixels, grids):
        x = self.patch_embed(pixels)
        x = x + self.position_embeddings(grids).to(x.dtype)
        cos, sin = self.rotary(grids, x.device)
        lengths = frame_lengths(grids)
        deep = []
        for i, block in enumerate(self.blocks):
            x = block(x, cos, sin, lengths)
            if i in self.deepstack_layers:
                deep.append(self.deepstack_merger_list[self.deepstack_layers.index(i)](x))
        return self.merger(x), deep
