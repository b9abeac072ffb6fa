"""The CLIP and SigLIP vision transformers that LLaVA-style models put in front of their
projector, in plain torch.

Both are ViTs over square images of the config's `image_size`: a patch convolution, learned
absolute position embeddings, pre-norm encoder layers (LayerNorm, bidirectional attention with
biased q/k/v/out projections, LayerNorm, two-linear MLP). CLIP adds a class embedding in front
of the patches and a LayerNorm before the first layer (`pre_layrnorm`, as transformers spells
it); SigLIP has neither and a biased patch convolution. Neither output norm (`post_layernorm`)
nor SigLIP's pooling head feeds a LLaVA projector: their checkpoint tensors are skipped.

`forward` returns the requested hidden states, numbered as transformers' `hidden_states`
tuple: 0 is the first encoder layer's input, i the output of layer i. Only the layers up to
the deepest requested one are built (LLaVA reads the second to last, so the last layer of the
checkpoint is never run).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ...kernels.activation import ACTIVATIONS
from ...kernels.vision_attention import cu_seqlens_of, kernel_wanted, vision_attention

# vision_config.model_type of the two towers
CLIP_TYPES = ("clip_vision_model", "clip")
SIGLIP_TYPES = ("siglip_vision_model", "siglip")


def activation(name: str):
    """transformers' activation `name` (ACT2FN) as a torch function."""
    if name == "quick_gelu":
        return lambda x: x * torch.sigmoid(1.702 * x)
    if name not in ACTIVATIONS:
        raise ValueError(f"unsupported activation {name!r} in a vision tower")
    return ACTIVATIONS[name]


def hidden_state_indices(layers: int | list[int], num_layers: int) -> list[int]:
    """Transformers' `vision_feature_layer` (an index or a list; negative ones count from the
    end of the num_layers + 1 hidden states) as non-negative indices, in order."""
    wanted = [layers] if isinstance(layers, int) else list(layers)
    total = num_layers + 1
    out = []
    for i in wanted:
        if not -total <= i < total:
            raise ValueError(f"vision feature layer {i} is out of range for {num_layers} layers")
        out.append(i % total)
    return out


class _Attention(nn.Module):
    use_kernels: bool | None = None  # the Triton kernel: set by the engine, else on CUDA

    def __init__(self, hidden: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.q_proj = nn.Linear(hidden, hidden)
        self.k_proj = nn.Linear(hidden, hidden)
        self.v_proj = nn.Linear(hidden, hidden)
        self.out_proj = nn.Linear(hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        if kernel_wanted(self.use_kernels, x):  # the images packed, one launch for all
            q, k, v = (
                p(x).view(b * s, self.heads, d // self.heads)
                for p in (self.q_proj, self.k_proj, self.v_proj)
            )
            cu = cu_seqlens_of([s] * b, x.device)
            out = vision_attention(q, k, v, cu, use_kernel=True, max_seqlen=s)
            return self.out_proj(out.view(b, s, d))

        def heads(t):
            return t.view(b, s, self.heads, d // self.heads).transpose(1, 2)

        q, k, v = heads(self.q_proj(x)), heads(self.k_proj(x)), heads(self.v_proj(x))
        out = F.scaled_dot_product_attention(q, k, v)  # every patch sees every patch
        return self.out_proj(out.transpose(1, 2).reshape(b, s, d))


class _Mlp(nn.Module):
    def __init__(self, hidden: int, intermediate: int, act: str) -> None:
        super().__init__()
        self.fc1 = nn.Linear(hidden, intermediate)
        self.fc2 = nn.Linear(intermediate, hidden)
        self.act = activation(act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class _Layer(nn.Module):
    def __init__(self, vc) -> None:
        super().__init__()
        d = vc.hidden_size
        self.layer_norm1 = nn.LayerNorm(d, eps=vc.layer_norm_eps)
        self.self_attn = _Attention(d, vc.num_attention_heads)
        self.layer_norm2 = nn.LayerNorm(d, eps=vc.layer_norm_eps)
        self.mlp = _Mlp(d, vc.intermediate_size, vc.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.layer_norm1(x))
        return x + self.mlp(self.layer_norm2(x))


class _Embeddings(nn.Module):
    def __init__(self, vc, class_token: bool) -> None:
        super().__init__()
        d = vc.hidden_size
        self.image_size = vc.image_size
        grid = vc.image_size // vc.patch_size
        self.class_embedding = nn.Parameter(torch.empty(d)) if class_token else None
        self.patch_embedding = nn.Conv2d(
            vc.num_channels, d, vc.patch_size, stride=vc.patch_size, bias=not class_token
        )
        self.position_embedding = nn.Embedding(grid * grid + int(class_token), d)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        n, _, h, w = pixel_values.shape
        if h != self.image_size or w != self.image_size:
            raise ValueError(f"the vision tower takes {self.image_size} px images, got {h}x{w}")
        x = self.patch_embedding(pixel_values).flatten(2).transpose(1, 2)  # [n, patches, d]
        if self.class_embedding is not None:
            x = torch.cat([self.class_embedding.expand(n, 1, -1), x], dim=1)
        return x + self.position_embedding.weight


class VisionTransformer(nn.Module):
    """A CLIP or SigLIP vision transformer with its first `num_layers` layers; parameters
    named as transformers 5 names them under `vision_tower.` (embeddings.*, pre_layrnorm.*,
    encoder.layers.N.*)."""

    def __init__(self, vision_config, num_layers: int) -> None:
        super().__init__()
        kind = vision_config.model_type
        if kind not in CLIP_TYPES + SIGLIP_TYPES:
            raise ValueError(f"unsupported LLaVA vision tower {kind!r}")
        clip = kind in CLIP_TYPES
        self.has_class = clip
        self.total_layers = vision_config.num_hidden_layers
        self.patch_size = vision_config.patch_size
        self.image_size = vision_config.image_size
        self.embeddings = _Embeddings(vision_config, class_token=clip)
        d = vision_config.hidden_size
        self.pre_layrnorm = nn.LayerNorm(d, eps=vision_config.layer_norm_eps) if clip else None
        self.encoder = nn.Module()
        self.encoder.layers = nn.ModuleList(_Layer(vision_config) for _ in range(num_layers))

    def skipped(self, name: str) -> bool:
        """Whether a checkpoint tensor (named relative to the tower) is one this tower does
        not use: the output norm, SigLIP's pooling head, the layers past the deepest read."""
        if name.startswith(("post_layernorm.", "head.")):
            return True
        if name.startswith("encoder.layers."):
            return int(name.split(".")[2]) >= len(self.encoder.layers)
        return False

    def forward(self, pixel_values: torch.Tensor, indices: list[int]) -> list[torch.Tensor]:
        """Hidden states `indices` (0: the first layer's input, i: layer i's output) of a batch
        of images [n, channels, size, size], each [n, tokens, hidden], in the order asked."""
        x = self.embeddings(pixel_values.to(self.embeddings.patch_embedding.weight.dtype))
        if self.pre_layrnorm is not None:
            x = self.pre_layrnorm(x)
        states = {0: x}
        for i, layer in enumerate(self.encoder.layers, start=1):
            x = layer(x)
            states[i] = x
        return [states[i] for i in indices]
