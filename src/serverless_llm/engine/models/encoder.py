"""Bidirectional encoders (BERT, XLM-RoBERTa) and their sequence-classification cross-encoders,
run on the step's flat ragged batch like the decoder, but with no KV cache and no sampling: each
request's tokens attend to all of its own tokens, both ways, in one step (the scheduler never
splits an encoder prompt: `Scheduler.whole_prompts`).

A family (families_encoder.py) is a function from its transformers config to an `EncoderSpec`
plus the map from its checkpoint's tensor names to this module's (`EncoderNames`). The model is
post-LayerNorm, as BERT is: embeddings (word + token type + absolute position) -> LayerNorm,
then per layer x = LN(x + O(attn(x))), x = LN(x + down(act(up(x)))). Its final hidden states are
what the pooling path (engine/pooling.py) pools; a cross-encoder checkpoint also has its
classifier head here (`classify`, with `num_labels` and `classifier_pooling`, the members
pooling.py's classifier-head interface asks for).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from ..layers.attention import AttentionBackend, AttentionMetadata, AttentionSpec
from ..layers.linear import linear_act, pack_linears_for_cpu, packed_act_works
from ..layers.norm import LayerNorm

ACTIVATIONS = {
    "gelu": lambda x: F.gelu(x),
    "gelu_python": lambda x: F.gelu(x),
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
    "silu": F.silu,
    "swish": F.silu,
}
# The activations a packed linear can apply as it writes (layers/linear.py's POST_OPS names).
FUSABLE = {
    "gelu": "gelu",
    "gelu_python": "gelu",
    "gelu_new": "gelu_tanh",
    "gelu_pytorch_tanh": "gelu_tanh",
    "relu": "relu",
}


@dataclass
class EncoderNames:
    """Checkpoint tensor names -> this model's: `prefixes` are stripped first (the base model's
    name inside a ...ForSequenceClassification checkpoint), then `rules` (regex, replacement)
    apply in order; a name matching `ignore` is skipped."""

    prefixes: tuple[str, ...]
    rules: list[tuple[str, str]]
    ignore: tuple[str, ...] = ()
    qkv: dict[str, str] = field(default_factory=lambda: {"query": "q", "key": "k", "value": "v"})
    # The checkpoint's fused MLP input holds [up | gate] with the activation on the second half
    # (gte's up_gate_proj); this model's is [activated | multiplier]: the halves are swapped.
    swap_up_halves: bool = False


@dataclass(frozen=True)
class EncoderSpec:
    hidden_size: int
    num_layers: int
    num_heads: int
    intermediate_size: int
    vocab_size: int
    max_positions: int  # rows of the absolute position table
    eps: float = 1e-12
    act: str = "gelu"
    type_vocab_size: int = 2  # 0: no token type embedding
    # XLM-RoBERTa: positions start at pad_token_id + 1 and a pad token sits at pad_token_id
    # (fairseq's make_positions); None: positions 0, 1, ... (BERT).
    position_pad: int | None = None
    # The classifier of a ...ForSequenceClassification checkpoint: None (a plain encoder),
    # "bert" (BERT's pooler dense + tanh on the CLS row, then `classifier`) or "roberta" (the
    # head's dense + tanh on the CLS row, then out_proj).
    classifier: str | None = None
    num_labels: int = 0
    arch: str = ""
    names: EncoderNames | None = field(default=None, compare=False)
    # ModernBERT's shape: pre-LayerNorm layers (the first without an attention norm) and a
    # final norm; rotary positions (`rope_thetas`: each layer's base; no position table); a
    # gated MLP (up = [input | gate], act(input) * gate); biases on the linears and norms or
    # not; per layer a bidirectional window (`windows`: a query sees keys within distance
    # window - 1; None: all); the classifier head's pooling ("cls" or "mean") and activation.
    pre_norm: bool = False
    rope_thetas: tuple[float, ...] | None = None
    gated_mlp: bool = False
    linear_bias: bool = True
    norm_bias: bool = True
    windows: tuple[int | None, ...] | None = None
    head_pooling: str = "cls"
    head_act: str = "gelu"
    head_bias: bool = True
    # gte (NewModel): the MLP's input projection without a bias while the other linears have
    # one (None: as linear_bias); NTK-scaled rotary (the factor, and the "mixed" exponent b).
    up_bias: bool | None = None
    rope_ntk: float | None = None
    rope_mixed_b: float | None = None

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def max_tokens(self) -> int:
        """The longest input the position table covers."""
        if self.rope_thetas is not None:
            return self.max_positions
        if self.position_pad is None:
            return self.max_positions
        return self.max_positions - self.position_pad - 1

    # What the engine's cache planning reads of a decoder's spec: no layer keeps KV.
    @property
    def attention_layers(self) -> tuple[bool, ...]:
        return (False,) * self.num_layers


BERT_RULES = [
    (r"^embeddings\.word_embeddings\.", "embed_tokens."),
    (r"^embeddings\.position_embeddings\.", "embed_positions."),
    (r"^embeddings\.token_type_embeddings\.", "embed_types."),
    (r"^embeddings\.LayerNorm\.", "embed_norm."),
    (r"^encoder\.layer\.(\d+)\.attention\.self\.(query|key|value)\.", r"layers.\1.qkv.\2."),
    (r"^encoder\.layer\.(\d+)\.attention\.output\.dense\.", r"layers.\1.o_proj."),
    (r"^encoder\.layer\.(\d+)\.attention\.output\.LayerNorm\.", r"layers.\1.attn_norm."),
    (r"^encoder\.layer\.(\d+)\.intermediate\.dense\.", r"layers.\1.up."),
    (r"^encoder\.layer\.(\d+)\.output\.dense\.", r"layers.\1.down."),
    (r"^encoder\.layer\.(\d+)\.output\.LayerNorm\.", r"layers.\1.mlp_norm."),
    (r"^pooler\.dense\.", "head_dense."),  # BERT's pooler: the classifier's first half
    (r"^classifier\.dense\.", "head_dense."),  # RoBERTa's classification head
    (r"^classifier\.out_proj\.", "classifier."),
    (r"^classifier\.", "classifier."),
]


# Fused linears a checkpoint may store in parts (row blocks, in this order): BERT's query, key
# and value; NomicBERT's gate (the activated half) and up projections.
FUSED = {"qkv": ("query", "key", "value"), "up": ("act", "gate")}
FUSED_PART = re.compile(r"^(layers\.\d+\.(qkv|up))\.(query|key|value|act|gate)\.(weight|bias)$")

HEAD = ("head_dense.", "head_norm.", "classifier.")


class EncoderLayer(nn.Module):
    def __init__(self, s: EncoderSpec, i: int, use_kernels: bool) -> None:
        super().__init__()
        h, b = s.hidden_size, s.linear_bias
        self.qkv = nn.Linear(h, 3 * h, bias=b)
        self.o_proj = nn.Linear(h, h, bias=b)
        first_pre = s.pre_norm and i == 0  # ModernBERT's first layer reads the embedding norm
        self.attn_norm = None if first_pre else _norm(s, use_kernels)
        up_bias = b if s.up_bias is None else s.up_bias
        self.up = nn.Linear(h, s.intermediate_size * (2 if s.gated_mlp else 1), bias=up_bias)
        self.down = nn.Linear(s.intermediate_size, h, bias=b)
        self.mlp_norm = _norm(s, use_kernels)
        window = s.windows[i] if s.windows else None
        self.attn_spec = AttentionSpec(
            s.num_heads, s.num_heads, s.head_dim, s.head_dim**-0.5, sliding_window=window
        )
        self.rope_theta = s.rope_thetas[i] if s.rope_thetas else None


def _norm(s: EncoderSpec, use_kernels: bool) -> LayerNorm:
    return LayerNorm(s.hidden_size, s.eps, bias=s.norm_bias, use_kernels=use_kernels)


class EncoderModel(nn.Module):
    """See the module docstring. Built on the meta device, `materialize`d, then loaded."""

    is_encoder = True

    def __init__(self, spec: EncoderSpec, config, backend: AttentionBackend, **_: object) -> None:
        super().__init__()
        s = self.spec = spec
        self.config = config
        self.backend = backend
        self.num_layers = s.num_layers
        self.num_kv_heads = s.num_heads
        self.head_dim = s.head_dim
        self.act = ACTIVATIONS[s.act]
        k = backend.use_kernels
        self.embed_tokens = nn.Embedding(s.vocab_size, s.hidden_size)
        self.embed_positions = None
        if s.rope_thetas is None:
            self.embed_positions = nn.Embedding(s.max_positions, s.hidden_size)
        self.embed_types = (
            nn.Embedding(s.type_vocab_size, s.hidden_size) if s.type_vocab_size else None
        )
        self.embed_norm = _norm(s, k)
        self.layers = nn.ModuleList(EncoderLayer(s, i, k) for i in range(s.num_layers))
        self.final_norm = _norm(s, k) if s.pre_norm else None
        # The classifier head (cross-encoders): BERT / RoBERTa: dense + tanh on the CLS row,
        # then the labels; ModernBERT: dense + act + LayerNorm on the CLS or mean row.
        self.num_labels = s.num_labels if s.classifier else None
        self.classifier_pooling = s.head_pooling
        if s.classifier:
            self.head_dense = nn.Linear(s.hidden_size, s.hidden_size, bias=s.head_bias)
            if s.classifier == "modernbert":
                self.head_norm = _norm(s, k)
            self.classifier = nn.Linear(s.hidden_size, s.num_labels)
        # The tokenizer's [SEP] id (set by the engine): with token types, a pair's second text
        # (after the first [SEP]) is type 1, as the tokenizer marks a (query, document) pair.
        self.sep_token_id: int | None = None
        self.quantization = "none"
        # The MLP's activation fused into its up projection (`optimize_for_cpu`), or None.
        self.fused_act: str | None = None

    # -- building ------------------------------------------------------------------------------

    def materialize(self, device: torch.device) -> EncoderModel:
        self.to_empty(device=device)
        return self

    def quantize(self, scheme, mode) -> None:
        raise ValueError(f"{self.spec.arch}: quantized encoders are not served")

    def init_dummy_weights(self, seed: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for name, p in self.named_parameters():
                if "norm" in name:
                    p.fill_(1.0 if name.endswith("weight") else 0.0)
                else:
                    p.copy_(torch.randn(p.shape, generator=gen) * 0.02)

    def load_weights(self, weights, names: EncoderNames | None = None) -> None:
        """Fills every parameter from (name, tensor) pairs; KeyError naming what is missing."""
        names = names or self.spec.names
        params = dict(self.named_parameters())
        filled: set[str] = set()
        rows = {"qkv": self.spec.hidden_size, "up": self.spec.intermediate_size}
        for name, tensor in weights:
            target = self.map_name(name, names)
            if target is None:
                continue
            tensor = tensor.full() if hasattr(tensor, "full") else tensor
            if names.swap_up_halves and re.match(r"^layers\.\d+\.up\.(weight|bias)$", target):
                tensor = torch.cat(tensor.chunk(2, dim=0)[::-1])
            m = FUSED_PART.match(target)
            if m:  # one part of a fused linear: its rows
                n = rows[m.group(2)]
                part = FUSED[m.group(2)].index(m.group(3))
                p = params[f"{m.group(1)}.{m.group(4)}"]
                with torch.no_grad():
                    p[part * n : (part + 1) * n].copy_(tensor)
                filled.add(target)
                continue
            if target not in params and self.num_labels is None and target.startswith(HEAD):
                continue  # a base model's pooler: the engine pools by itself
            if target not in params:
                raise KeyError(f"{self.spec.arch}: checkpoint tensor {name!r} has no place")
            with torch.no_grad():
                params[target].copy_(tensor)
            filled.add(target)
        missing = []
        for pname in params:
            m = re.match(r"^(layers\.\d+\.(qkv|up))\.(weight|bias)$", pname)
            if m and pname not in filled:  # filled whole (ModernBERT's Wqkv) or in parts
                parts = [f"{m.group(1)}.{p}.{m.group(3)}" for p in FUSED[m.group(2)]]
                missing += [p for p in parts if p not in filled]
            elif not m and pname not in filled:
                missing.append(pname)
        if missing:
            raise KeyError(f"{self.spec.arch}: the checkpoint has no tensor for {missing[:6]}")

    @staticmethod
    def map_name(name: str, names: EncoderNames) -> str | None:
        if any(x in name for x in names.ignore):
            return None
        for prefix in names.prefixes:
            if name.startswith(prefix):
                name = name[len(prefix) :]
                break
        name = name.replace(".gamma", ".weight").replace(".beta", ".bias")  # old LayerNorm names
        for pattern, repl in names.rules:
            new, n = re.subn(pattern, repl, name)
            if n:
                return new
        return None

    def optimize_for_cpu(self) -> str | None:
        """float32 on CPU: the linears packed for oneDNN, the LayerNorms (residual add fused)
        on the native kernel when the backend has it. Returns the start-up line, or None."""
        if self.embed_tokens.weight.dtype != torch.float32:
            return None
        native = getattr(self.backend, "kernels", None)
        if native is not None:
            for m in self.modules():
                if isinstance(m, LayerNorm):
                    m.native = native
        if not pack_linears_for_cpu(self):
            return None
        fused = FUSABLE.get(self.spec.act)
        if not self.spec.gated_mlp and fused is not None and packed_act_works(fused):
            self.fused_act = fused
        return (
            "encoder linears packed for oneDNN"
            + (f" ({self.spec.act} fused into the up projection)" if self.fused_act else "")
            + (", native norms" if native else "")
        )

    # -- running -------------------------------------------------------------------------------

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list,
        meta: AttentionMetadata | list[AttentionMetadata],
        images=None,
    ) -> torch.Tensor:
        """Final hidden states [T, hidden] of the step's requests, each whole (positions from
        0: an encoder prompt is never split)."""
        if isinstance(meta, list):
            meta = meta[0]
        s = self.spec
        x = self.embed_tokens(input_ids)
        if self.embed_positions is not None:
            pos = positions
            if s.position_pad is not None:
                pos = self._padded_positions(input_ids, meta)
            x = x + self.embed_positions(pos)
        if self.embed_types is not None:
            x = x + self.embed_types(self._token_types(input_ids, meta))
        x = self.embed_norm(x)
        H, D = s.num_heads, s.head_dim
        rope: dict[float, tuple[torch.Tensor, torch.Tensor]] = {}
        for layer in self.layers:
            h = x
            if s.pre_norm and layer.attn_norm is not None:
                h = layer.attn_norm(x)
            q, k, v = layer.qkv(h).view(-1, 3, H, D).unbind(1)
            if layer.rope_theta is not None:
                if layer.rope_theta not in rope:
                    rope[layer.rope_theta] = _rope_cos_sin(
                        positions, D, layer.rope_theta, s.rope_ntk, s.rope_mixed_b
                    )
                q, k = _rotate(q, *rope[layer.rope_theta]), _rotate(k, *rope[layer.rope_theta])
            attn = self.backend.encoder_attention(q, k, v, meta, layer.attn_spec)
            if s.pre_norm:
                x = x + layer.o_proj(attn)
                up = linear_act(layer.up, layer.mlp_norm(x), self.fused_act, self._mlp_act)
                x = x + layer.down(up)
            else:
                x = layer.attn_norm(layer.o_proj(attn), x)[0]
                up = linear_act(layer.up, x, self.fused_act, self._mlp_act)
                x = layer.mlp_norm(layer.down(up), x)[0]
        return self.final_norm(x) if self.final_norm is not None else x

    def _mlp_act(self, up: torch.Tensor) -> torch.Tensor:
        if not self.spec.gated_mlp:
            return self.act(up)
        inp, gate = up.chunk(2, dim=-1)
        return self.act(inp) * gate

    def _request_index(self, meta: AttentionMetadata, device) -> torch.Tensor:
        lens = torch.tensor(meta.query_lens_host, device=device)
        return torch.repeat_interleave(torch.arange(len(lens), device=device), lens)

    def _segment_cumsum(self, flags: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """Inclusive cumulative sums of `flags` [T] restarting at each request."""
        c = flags.cumsum(0)
        starts = meta.query_start_loc[:-1].long()
        before = torch.cat([c.new_zeros(1), c])[starts]  # the sum before each request
        return c - before[self._request_index(meta, flags.device)]

    def _padded_positions(self, ids: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """XLM-RoBERTa's positions: pad + the count of non-pad tokens so far (pad tokens sit at
        `pad`), per request."""
        pad = self.spec.position_pad
        mask = (ids != pad).long()
        return self._segment_cumsum(mask, meta) * mask + pad

    def _token_types(self, ids: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """0 up to and including a request's first [SEP], 1 after it (a text pair's second
        text, as the tokenizer's token_type_ids); all 0 without a known [SEP] id."""
        if self.sep_token_id is None or self.spec.type_vocab_size < 2:
            return torch.zeros_like(ids)
        sep = (ids == self.sep_token_id).long()
        before = self._segment_cumsum(sep, meta) - sep  # [SEP]s strictly before each token
        return before.clamp(max=1)

    def classify(self, rows: torch.Tensor) -> torch.Tensor:
        """A cross-encoder's logits [N, num_labels] from pooled CLS rows [N, hidden]."""
        if self.num_labels is None:
            raise ValueError(f"{self.spec.arch} has no classifier head")
        if self.spec.classifier == "modernbert":
            return self.classifier(
                self.head_norm(ACTIVATIONS[self.spec.head_act](self.head_dense(rows)))
            )
        return self.classifier(torch.tanh(self.head_dense(rows)))

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """An encoder has no LM head: its classifier's logits when it has one, else the rows
        (what the CUDA memory profile runs after the forward)."""
        return hidden if self.num_labels is None else self.classify(hidden)


def rope_inv_freq(
    dim: int, theta: float, ntk: float | None = None, mixed_b: float | None = None, device=None
) -> torch.Tensor:
    """The rotary frequencies [dim / 2], float32. With an NTK factor f > 1 (gte's "ntk" rope
    scaling), fixed NTK: base theta * f and every frequency divided by f^(2 / dim); mixed NTK
    (exponent b): the base kept and frequency i (from 1) divided by exp(a * i^b), where
    a = ln(f) / (dim / 2)^b, so the lowest frequency is divided by f."""
    idx = torch.arange(0, dim, 2, device=device).float() / dim
    if ntk is None or ntk <= 1.0:
        return 1.0 / (theta**idx)
    if mixed_b is None:
        return 1.0 / ((theta * ntk) ** idx) / ntk ** (2.0 / dim)
    a = torch.tensor(float(ntk)).log() / (dim / 2) ** mixed_b
    steps = torch.arange(1, dim // 2 + 1, device=device).float()
    return 1.0 / (theta**idx) / (a * steps**mixed_b).exp()


def _rope_cos_sin(
    positions: torch.Tensor,
    dim: int,
    theta: float,
    ntk: float | None = None,
    mixed_b: float | None = None,
):
    """cos and sin [T, 1, dim] of the rotary angles (halves layout), in float32."""
    inv = rope_inv_freq(dim, theta, ntk, mixed_b, positions.device)
    freqs = positions.float()[:, None] * inv[None, :]
    emb = torch.cat([freqs, freqs], dim=-1)[:, None, :]
    return emb.cos(), emb.sin()


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary positions on x [T, H, D] (rotate-half layout), computed in float32."""
    xf = x.float()
    half = x.shape[-1] // 2
    rotated = torch.cat([-xf[..., half:], xf[..., :half]], dim=-1)
    return (xf * cos + rotated * sin).to(x.dtype)
