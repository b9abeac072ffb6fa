"""The Llama-family decoder: Llama 1/2/3, Mistral (sliding window) and Qwen2 (QKV bias).

Q/K/V and gate/up projections are fused into one matmul each; checkpoints keep them apart, so
`load_weights` copies each into its slice. The model runs on the flat ragged batch of a step:
`input_ids` and `positions` are [T], and attention reads the paged cache through `meta`.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import nn

from ..layers.activation import SiluAndMul
from ..layers.attention import AttentionBackend, AttentionMetadata, AttentionSpec
from ..layers.linear import PackedLinear, pack_linears_for_cpu
from ..layers.norm import RMSNorm
from ..layers.rotary import (
    RotaryStep,
    apply_rotary,
    cos_sin_cache,
    inv_frequencies,
    rope_parameters,
    rotary_step,
)


@dataclass(frozen=True)
class ArchVariant:
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False


def head_dim_of(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def num_kv_heads_of(config) -> int:
    return getattr(config, "num_key_value_heads", None) or config.num_attention_heads


def sliding_windows(config) -> list[int | None]:
    """The window of each layer: transformers 5 names layer kinds in `layer_types`; older
    configs put one `sliding_window` on every layer (Qwen2 only with use_sliding_window)."""
    n = config.num_hidden_layers
    window = getattr(config, "sliding_window", None)
    if getattr(config, "model_type", "") == "qwen2" and not getattr(
        config, "use_sliding_window", False
    ):
        window = None
    if not window:
        return [None] * n
    kinds = getattr(config, "layer_types", None)
    if kinds:
        return [window if kind == "sliding_attention" else None for kind in kinds]
    return [window] * n


class Attention(nn.Module):
    def __init__(
        self, config, variant: ArchVariant, spec: AttentionSpec, backend: AttentionBackend
    ):
        super().__init__()
        self.spec = spec
        self.backend = backend
        h, kvh, d = spec.num_heads, spec.num_kv_heads, spec.head_dim
        self.q_size, self.kv_size = h * d, kvh * d
        self.qkv_proj = nn.Linear(
            config.hidden_size, self.q_size + 2 * self.kv_size, bias=variant.qkv_bias
        )
        self.o_proj = nn.Linear(self.q_size, config.hidden_size, bias=variant.o_bias)

    def forward(self, x, rope: RotaryStep, kv_cache, meta: AttentionMetadata):
        T = x.shape[0]
        s = self.spec
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(T, s.num_heads, s.head_dim)
        k = k.view(T, s.num_kv_heads, s.head_dim)
        v = v.reshape(T, s.num_kv_heads, s.head_dim)
        q, k = apply_rotary(q, k, rope)
        return self.o_proj(self.backend.forward(q, k, v, kv_cache, meta, s))


class MLP(nn.Module):
    def __init__(self, config, variant: ArchVariant, use_kernels: bool):
        super().__init__()
        self.gate_up_proj = nn.Linear(
            config.hidden_size, 2 * config.intermediate_size, bias=variant.mlp_bias
        )
        self.down_proj = nn.Linear(
            config.intermediate_size, config.hidden_size, bias=variant.mlp_bias
        )
        self.act_fn = SiluAndMul(use_kernels)

    def forward(self, x):
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


class DecoderLayer(nn.Module):
    def __init__(self, config, variant, spec, backend):
        super().__init__()
        self.self_attn = Attention(config, variant, spec, backend)
        self.mlp = MLP(config, variant, backend.use_kernels)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, backend.use_kernels)
        self.post_attention_layernorm = RMSNorm(
            config.hidden_size, config.rms_norm_eps, backend.use_kernels
        )

    def forward(self, x, residual, rope: RotaryStep, kv_cache, meta):
        if residual is None:
            residual = x
            x = self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(x, rope, kv_cache, meta)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class LlamaForCausalLM(nn.Module):
    variant = ArchVariant()

    def __init__(self, config, backend: AttentionBackend, max_position: int):
        """Built on the meta device by the model builder, then `materialize`d."""
        super().__init__()
        self.config = config
        self.max_position = max_position
        self.use_kernels = backend.use_kernels
        d = head_dim_of(config)
        self.num_layers = config.num_hidden_layers
        self.num_kv_heads = num_kv_heads_of(config)
        self.head_dim = d
        variant = self.variant_for(config)
        windows = sliding_windows(config)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            DecoderLayer(
                config,
                variant,
                AttentionSpec(
                    num_heads=config.num_attention_heads,
                    num_kv_heads=self.num_kv_heads,
                    head_dim=d,
                    scale=d**-0.5,
                    sliding_window=windows[i],
                ),
                backend,
            )
            for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, backend.use_kernels)
        self.tied = bool(getattr(config, "tie_word_embeddings", False))
        if not self.tied:
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.packed_lm_head = None
        # The cos/sin table: from the config, not the checkpoint; computed by `materialize`.
        self.register_buffer("rope_cache", None, persistent=False)

    def materialize(self, device: torch.device) -> LlamaForCausalLM:
        """Storage on `device` for a model built on the meta device: the weights uninitialised
        (`load_weights` or `init_dummy_weights` fills them), the rope table computed."""
        self.to_empty(device=device)
        inv_freq = inv_frequencies(rope_parameters(self.config), self.head_dim, self.max_position)
        self.rope_cache = cos_sin_cache(inv_freq, self.max_position).to(device)
        return self

    @classmethod
    def variant_for(cls, config) -> ArchVariant:
        bias = bool(getattr(config, "attention_bias", False))
        return ArchVariant(
            qkv_bias=bias, o_bias=bias, mlp_bias=bool(getattr(config, "mlp_bias", False))
        )

    @property
    def lm_head_weight(self) -> torch.Tensor:
        return self.embed_tokens.weight if self.tied else self.lm_head.weight

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """Hidden states of every token, after the final norm: [T, hidden]."""
        x = self.embed_tokens(input_ids)
        rope = rotary_step(self.rope_cache, positions, x.dtype, self.use_kernels)
        residual = None
        for layer, cache in zip(self.layers, kv_caches):
            x, residual = layer(x, residual, rope, cache, meta)
        x, _ = self.norm(x, residual)
        return x

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.packed_lm_head is not None:
            return self.packed_lm_head(hidden)
        return torch.nn.functional.linear(hidden, self.lm_head_weight)

    def optimize_for_cpu(self) -> None:
        """Packs the linear layers for oneDNN (after weights are loaded, float32 only)."""
        if self.embed_tokens.weight.dtype != torch.float32 or not pack_linears_for_cpu(self):
            return
        if self.tied:  # the embedding itself stays plain for the lookup
            self.packed_lm_head = PackedLinear(None, self.embed_tokens.weight)
        else:
            self.packed_lm_head = self.lm_head

    # -- weights ----------------------------------------------------------------------------

    _FUSED = {
        "q_proj": ("qkv_proj", 0),
        "k_proj": ("qkv_proj", 1),
        "v_proj": ("qkv_proj", 2),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, tensor in weights:
            if "rotary_emb" in name:
                continue
            if name.startswith("model."):
                name = name[len("model.") :]
            if name == "lm_head.weight" and self.tied:
                continue
            parts = name.split(".")
            fused = self._FUSED.get(parts[-2]) if len(parts) >= 2 else None
            if fused is not None:
                target, shard = fused
                pname = ".".join(parts[:-2] + [target, parts[-1]])
                param = params[pname]
                self._shard(param, target, shard).copy_(tensor)
                loaded.add(f"{pname}#{shard}")
                continue
            if name not in params:
                raise KeyError(f"checkpoint tensor {name!r} has no place in {type(self).__name__}")
            params[name].data.copy_(tensor)
            loaded.add(name)
        expected = set()
        for pname in params:
            target = pname.split(".")[-2]
            if target == "qkv_proj":
                expected |= {f"{pname}#{i}" for i in range(3)}
            elif target == "gate_up_proj":
                expected |= {f"{pname}#{i}" for i in range(2)}
            else:
                expected.add(pname)
        missing = sorted(expected - loaded)
        if missing:
            raise KeyError(f"checkpoint lacks {len(missing)} tensors, e.g. {missing[:3]}")

    def _shard(self, param: torch.Tensor, target: str, shard: int) -> torch.Tensor:
        if target == "qkv_proj":
            attn = self.layers[0].self_attn
            sizes = [attn.q_size, attn.kv_size, attn.kv_size]
        else:
            half = param.shape[0] // 2
            sizes = [half, half]
        start = sum(sizes[:shard])
        return param.data.narrow(0, start, sizes[shard])

    def init_dummy_weights(self, seed: int) -> None:
        """Random weights from the config alone (LOAD_FORMAT=dummy), for benchmarks."""
        g = torch.Generator(device="cpu").manual_seed(seed)
        for name, p in self.named_parameters():
            if name.endswith("norm.weight") or "layernorm" in name:
                p.data.fill_(1.0)
            else:
                p.data.copy_(torch.randn(p.shape, generator=g) * 0.02)


class MistralForCausalLM(LlamaForCausalLM):
    pass


class Qwen2ForCausalLM(LlamaForCausalLM):
    @classmethod
    def variant_for(cls, config) -> ArchVariant:
        return ArchVariant(qkv_bias=True)
