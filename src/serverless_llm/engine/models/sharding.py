"""Tensor-parallel sharding of a `DecoderSpec` and of its checkpoint tensors.

Each rank builds the decoder with its local shapes (`local_spec`: 1/N of the query heads, of the
KV heads (or one replicated KV head when there are fewer KV heads than ranks), of every MLP and
expert width, and of the padded vocabulary) and reads from each checkpoint tensor only its
slice (`Sharder.take`), before the usual placement (weights.py) puts it where a model that small
would. What is split:

- column-parallel (output rows): the fused qkv (this rank's heads of q, k and v, and of
  Qwen3-Next's attention output gate), gate/up, a plain up projection, each expert's gate/up
  rows;
- row-parallel (input columns): o_proj, down, each expert's down; their partial outputs are
  all-reduced, so only rank 0 keeps their bias;
- vocab-parallel: the embedding rows and the LM head rows (and its bias);
- per head: a q/k norm with a weight per head or over all heads, gpt-oss's attention sink
  logits (this rank's heads');
- gpt-oss's expert biases: w13's [E, 2I] like w13's rows; w2's [E, H], added after the
  row-parallel down projection, held by rank 0 (zeros on the others);
- recurrent layers (hybrid models): their heads or channels, as the layer's description says
  (`RecurrentMixerSpec.tp_split`: in projection and convolution by rows, per-head vectors by
  entries, the output projection by input columns); checkpoint tensors that fill a fused weight
  in another order (Qwen3-Next's interleaved projections, OLMo Hybrid's split convolution,
  Kimi Linear's separate q/k/v) give this rank the rows of its heads, placed at their rows of
  the rank's fused weight;
- Gemma 4: each layer by its own head shape and MLP width (`Sharder.at_layer`: the global
  layers' KV heads split or replicated by their own count); the experts beside the MLP like any
  experts; the per-layer embedding by vocabulary rows like the embedding; its projection, each
  layer's gate and projection and the layer scalars replicated (no partial sums: each rank's
  per-layer inputs are one rank's exactly);
- replicated: norms, routers, learned positions, the rest.

Every rank holds every expert, with 1/N of its width: the same all-reduce serves dense and
sparse layers, and a step's load is even across ranks whatever the routing.
"""

from __future__ import annotations

import dataclasses

import torch

from ..config import ConfigError
from ..parallel.group import TensorParallel
from .decoder import DecoderSpec

Ranges = list[tuple[int, int]]  # (start, length) along one dim
# The attribute names of the row-parallel linears (their inputs split across the ranks).
ROW_PARALLEL = ("o_proj", "down_proj", "w2", "out_proj", "x_proj")


def layer_heads(spec: DecoderSpec) -> list[tuple[int, int]]:
    """Per layer, its (KV heads, head width): the model's, or its own (Gemma 4's global layers)."""
    return [own or (spec.num_kv_heads, spec.head_dim) for own in spec.layer_heads]


def check_shardable(spec: DecoderSpec, size: int) -> None:
    """Raises ConfigError naming the first dimension `size` ranks cannot split."""

    def need(value: int, what: str) -> None:
        if value % size:
            raise ConfigError(
                f"tensor_parallel_size={size} does not divide the model's {what} ({value}); "
                f"choose a size that divides it"
            )

    if any(spec.attention_layers):
        need(spec.num_heads, "number of attention heads")
        # Each head shape's KV heads (Gemma 4's global layers have their own count).
        for i, (kvh, d) in enumerate(layer_heads(spec)):
            if spec.mixers[i] in ("attention", "parallel") and kvh % size and size % kvh:
                which = "" if spec.layer_heads[i] is None else f" (layer {i}, {d} wide)"
                raise ConfigError(
                    f"tensor_parallel_size={size} and the model's {kvh} KV heads{which}: one "
                    "must divide the other (the KV heads are split across ranks, or each "
                    "replicated on size/heads ranks)"
                )
    if spec.state_layers:
        refusal = spec.recurrent.tp_refusal(spec.hidden_size, size)
        if refusal is not None:
            raise ConfigError(refusal)
    mlps = list(zip(spec.mlp_layers, spec.moe_layers))
    if any(has and not sparse for has, sparse in mlps):
        need(spec.intermediate_size, "MLP intermediate size")
        for i, width in enumerate(spec.mlp_sizes):
            if width is not None and spec.mlp_layers[i] and not spec.moe_layers[i]:
                need(width, f"layer {i}'s MLP intermediate size")
    if spec.moe_beside is not None:  # Gemma 4's experts beside the MLP: split like any experts
        need(spec.moe_beside.intermediate_size, "expert intermediate size")
    if spec.moe is not None and any(has and sparse for has, sparse in mlps):
        if spec.moe.latent_size or not spec.gated:  # as SparseMoE refuses them
            raise ConfigError(
                f"tensor_parallel_size={size}: tensor parallelism of latent or non-gated experts "
                "(Nemotron-H's) is not supported yet; use tensor_parallel_size=1"
            )
        need(spec.moe.intermediate_size, "expert intermediate size")
        if spec.moe.shared_size:
            need(spec.moe.shared_size, "shared expert intermediate size")


def local_spec(spec: DecoderSpec, tp: TensorParallel) -> DecoderSpec:
    """The spec of the part of the model one rank holds."""
    n = tp.size
    moe = spec.moe
    if moe is not None:
        moe = dataclasses.replace(
            moe,
            intermediate_size=moe.intermediate_size // n,
            shared_size=moe.shared_size // n,
        )
    recurrent = spec.recurrent
    if recurrent is not None and spec.state_layers:
        recurrent = recurrent.shard(spec.hidden_size, n)
    # Gemma 4: each layer's own KV heads and MLP width split like the model's; the experts
    # beside the MLP by width; the per-layer embedding by vocabulary rows, like the embedding
    # (its per-layer width and the per-layer projection stay whole on every rank).
    beside = spec.moe_beside
    if beside is not None:
        beside = dataclasses.replace(beside, intermediate_size=beside.intermediate_size // n)
    per_layer_input = spec.per_layer_input
    if per_layer_input is not None:
        per_layer_input = (tp.vocab_range(per_layer_input[0])[1], per_layer_input[1])
    return dataclasses.replace(
        spec,
        recurrent=recurrent,
        num_heads=spec.num_heads // n,
        num_kv_heads=max(1, spec.num_kv_heads // n),
        intermediate_size=spec.intermediate_size // n if not all(spec.moe_layers) else 0,
        vocab_size=tp.vocab_range(spec.vocab_size)[1],
        moe=moe,
        layer_heads=tuple(
            None if h is None else (max(1, h[0] // n), h[1]) for h in spec.layer_heads
        ),
        mlp_sizes=tuple(None if w is None else w // n for w in spec.mlp_sizes),
        moe_beside=beside,
        per_layer_input=per_layer_input,
    )


class Sharder:
    """This rank's slice of each checkpoint tensor, in the checkpoint's own layout."""

    def __init__(self, spec: DecoderSpec, tp: TensorParallel) -> None:
        self.spec, self.tp = spec, tp
        self.scheme = None  # the quantization scheme, set by DecoderModel.quantize
        s, n, r = spec, tp.size, tp.rank
        d = s.head_dim
        self.q_heads = (r * (s.num_heads // n), s.num_heads // n)
        if s.num_kv_heads >= n:
            self.kv_heads = (r * (s.num_kv_heads // n), s.num_kv_heads // n)
        else:  # each KV head serves n / kvh ranks: the one holding this rank's query heads
            self.kv_heads = (r * s.num_kv_heads // n, 1)
        self.q_rows = (self.q_heads[0] * d, self.q_heads[1] * d)
        self.kv_rows = (self.kv_heads[0] * d, self.kv_heads[1] * d)
        self._views: dict[tuple, Sharder] = {}  # per-layer shapes (`at_layer`)

    def at_layer(self, layer: int | None) -> Sharder:
        """The sharder of layer `layer`'s tensors: one of the layer's own KV heads, head width and
        MLP width where they are not the model's (Gemma 4's global layers, its double-wide MLPs);
        itself otherwise (and for None: a tensor outside the layers)."""
        s = self.spec
        if layer is None or not 0 <= layer < s.num_layers:
            return self
        changes = {}
        if s.layer_heads[layer] is not None:
            changes["num_kv_heads"], changes["head_dim"] = s.layer_heads[layer]
        if s.mlp_sizes[layer] is not None:
            changes["intermediate_size"] = s.mlp_sizes[layer]
        if not changes:
            return self
        key = tuple(sorted(changes.items()))
        view = self._views.get(key)
        if view is None:
            view = self._views[key] = Sharder(dataclasses.replace(s, **changes), self.tp)
        view.scheme = self.scheme
        return view

    def take(
        self, internal: str, how, kind: str, tensor, layer: int | None = None
    ) -> tuple[torch.Tensor, object] | None:
        """(this rank's part of `tensor`, its placement) for the parameter `internal`.`kind`
        placed `how` (see WeightNames) of layer `layer` (None: outside the layers), or None when
        this rank holds none of it. `tensor` is a torch tensor or a loader LazyTensor (only the
        slice is read)."""
        view = self.at_layer(layer)
        if view is not self:
            return view.take(internal, how, kind, tensor)
        leaf = internal.rpartition(".")[2]
        bias = kind == "bias"
        if internal == "mixer":  # a recurrent layer's bare parameter (A_log, D), named by kind
            return self._recurrent(internal, how, kind, tensor)
        if self.scheme is not None and kind not in ("weight", "bias"):
            return self._quantized(internal, leaf, how, kind, tensor), how
        if internal.startswith("mixer."):
            return self._recurrent(internal, how, kind, tensor)
        if leaf in ("q_norm", "k_norm"):
            return self._qk_norm(leaf, how, tensor)
        if leaf in ("embed_tokens", "lm_head", "lm_head_bias", "embed_tokens_per_layer"):
            return self._vocab(tensor), how
        if leaf == "qkv_proj" and how in ("qkv_heads", "qkv_grouped"):
            return self._qkv_interleaved(how, tensor), how
        if leaf == "sinks":  # gpt-oss: a sink logit per head, this rank's heads'
            return _read(tensor, 0, [self.q_heads]), how
        if leaf == "w13_bias":  # gpt-oss: [E, 2I] as w13's rows (gate and up alternating)
            return self._experts("w13", how, False, tensor, dim=1), how
        if leaf == "w2_bias":  # [E, H], added after the down projection: by rank 0 only
            t = _full(tensor)
            return (t if self.tp.rank == 0 else torch.zeros_like(t)), how
        if leaf in ("w13", "w2"):
            if bias and self.scheme is not None:  # GPTQ's zero bias: checked, then dropped
                return _full(tensor), how
            part = self._experts(leaf, how, bias, tensor)
            return part if isinstance(part, tuple) else (part, how)
        split = self._linear_split(internal, leaf, how)
        if split is None:
            return _full(tensor), how
        axis, ranges = split
        if axis == "in" and bias:  # the partial outputs are summed: rank 0 adds the bias once
            t = _full(tensor)
            return (t if self.tp.rank == 0 else torch.zeros_like(t)), how
        dim = 0 if axis == "out" else 1  # a weight is [out, in], a bias [out]
        if how == "t" and not bias:  # a GPT-2 Conv1D weight is stored [in, out]
            dim = 1 - dim
        return _read(tensor, dim, ranges), how

    def _experts(self, leaf: str, how, bias: bool, tensor, dim: int = 0):
        """A stacked expert weight's part: every expert, 1/N of each one's width (w13's rows,
        w2's columns), in whichever form the checkpoint stores them (`dim`: where a w13
        stored with gate and up alternating has them, for gpt-oss's w13 bias [E, 2I])."""
        if bias:
            raise ConfigError(f"tensor parallelism over experts with a bias ({leaf})")
        if isinstance(how, str) and how.startswith(("experts:interleaved", "experts:stacked_t",
                                                    "mxfp4_")):  # fmt: skip
            return self._gpt_oss_experts(leaf, how, tensor, dim)
        if how == "experts:t" and len(tensor.shape) == 3:
            # Llama 4: stacked and transposed, gate_up [E, H, 2I] ([gate | up] along the last
            # dim), down [E, I, H]: 1/N of each expert's width from each half / from the rows.
            if leaf == "w13":
                half = tensor.shape[2] // 2
                lo, ln = self._even(half)
                return _read(tensor, 2, [(lo, ln), (half + lo, ln)])
            return _read(tensor, 1, [self._even(tensor.shape[1])])
        if how in ("experts:gate", "experts:up", "experts:t"):  # DBRX: [E * I, H]
            return _read(tensor, 0, self._per_expert(tensor.shape[0]))
        if leaf == "w2":  # [H, I] per expert, or Granite-MoE's stacked [E, H, I]
            dim = len(tensor.shape) - 1
            return _read(tensor, dim, [self._even(tensor.shape[dim])])
        if how is None:  # Granite-MoE: [E, 2I, H], each expert's [gate | up]
            half = tensor.shape[1] // 2
            lo, ln = self._even(half)
            return _read(tensor, 1, [(lo, ln), (half + lo, ln)])
        return _read(tensor, 0, [self._even(tensor.shape[0])])  # one expert's gate or up

    def _gpt_oss_experts(self, leaf: str, how: str, tensor, dim: int) -> torch.Tensor:
        """gpt-oss's experts: w13 with gate and up alternating (each intermediate channel's
        pair side by side: this rank's channels are one run of 2I/N), as columns of
        [E, H, 2I] ("experts:interleaved_t"), entries of the bias [E, 2I] or rows of the MXFP4
        blocks [E, 2I, H / 32, 16] and scales [E, 2I, H / 32]; w2 [E, I, H] by rows
        ("experts:stacked_t") or its MXFP4 blocks and scales by input blocks of 32 (dim 2);
        when the ranks' channels do not fall on blocks, (the whole tensor, its placement
        "mxfp4_*:cols:<first channel>:<count>"), cut once decoded (weights.py)."""
        mxfp4 = how.startswith("mxfp4_")
        if leaf == "w13":
            if how == "experts:interleaved_t":
                dim = 2
            elif mxfp4:
                dim = 1
            lo, ln = self._even(tensor.shape[dim] // 2)
            return _read(tensor, dim, [(2 * lo, 2 * ln)])
        if not mxfp4:
            return _read(tensor, 1, [self._even(tensor.shape[1])])
        blocks = tensor.shape[2]  # the input's blocks of 32
        if blocks % self.tp.size:
            # A rank's channels end inside a block (gpt-oss's 2880 = 90 blocks over 4 ranks):
            # the whole projection, decoded at load and then cut ("cols:<first>:<count>").
            lo, ln = self._even(blocks * 32)
            return _full(tensor), f"{how}:cols:{lo}:{ln}"
        return _read(tensor, 2, [self._even(blocks)])

    # Quantized linears: each tensor kind's layout, as {axis: (dim, unit)}: the output axis
    # ("out") or the input axis ("in") is `dim` of the tensor, counted in `unit`s of logical
    # rows ("p": the values packed in an int32, "g": the group size). None: held whole.
    QUANT_LAYOUT = {
        ("gptq", "qweight"): {"out": (1, 1), "in": (0, "p")},
        ("gptq", "qzeros"): {"out": (1, "p"), "in": (0, "g")},
        ("gptq", "scales"): {"out": (1, 1), "in": (0, "g")},
        ("gptq", "g_idx"): {"out": None, "in": (0, 1)},
        ("awq", "qweight"): {"out": (1, "p"), "in": (0, 1)},
        ("awq", "qzeros"): {"out": (1, "p"), "in": (0, "g")},
        ("awq", "scales"): {"out": (1, 1), "in": (0, "g")},
        ("packed_int", "weight_packed"): {"out": (0, 1), "in": (1, "p")},
        ("packed_int", "weight_scale"): {"out": (0, 1), "in": (1, "g")},
        ("packed_int", "weight_g_idx"): {"out": None, "in": (0, 1)},
        ("fp8", "weight_scale"): {"out": (0, 1), "in": None},  # per channel; a scalar is whole
        ("fp8", "input_scale"): {"out": None, "in": None},
    }

    def _linear_split(self, internal: str, leaf: str, how) -> tuple[str, Ranges] | None:
        """How a linear layer splits, in logical rows: ("out", ranges of its output rows) or
        ("in", the range of its input columns); None for a replicated one."""
        if internal.startswith("mixer."):  # a recurrent layer's linear
            if isinstance(how, str) and how.startswith(("mixer:", "rows:")):
                return None  # a quantized piece of a fused weight: refused by the loader
            return self._mixer_split(internal.partition(".")[2])
        s = self._mlp_width(internal)
        mla = self.spec.mla
        if mla is not None and leaf in ("q_proj", "q_b_proj", "kv_b_proj", "o_proj"):
            return self._mla_split(leaf, how)
        if leaf == "qkv_proj":
            qn, kvn = (
                self.spec.num_heads * self.spec.head_dim,
                self.spec.num_kv_heads * self.spec.head_dim,
            )
            if how == "q":
                return "out", [self.q_rows]
            if how == "q_gated":  # Qwen3-Next: [q_h | gate_h] per head, this rank's heads
                return "out", [(2 * self.q_rows[0], 2 * self.q_rows[1])]
            if how in ("k", "v"):
                return "out", [self.kv_rows]
            if how in (None, "t"):  # [q | k | v] fused (a Conv1D stores it as columns)
                kv = [(qn + self.kv_rows[0], self.kv_rows[1])]
                return "out", [self.q_rows, *kv, (qn + kvn + self.kv_rows[0], self.kv_rows[1])]
        elif leaf == "gate_up_proj" and how in ("gate", "up"):
            return "out", [self._even(s)]
        elif leaf == "gate_up_proj" and how is None:
            lo, ln = self._even(s)
            return "out", [(lo, ln), (s + lo, ln)]
        elif leaf == "up_proj" and how in (None, "t"):
            return "out", [self._even(s)]
        elif leaf in ("w13", "w2") and isinstance(how, str) and how.startswith("expert:"):
            # One expert's tensor of a quantized checkpoint ("expert:<e>[:gate|up]"): its width
            # splits like a dense MLP's (gate/up by output rows, down by input columns).
            width = (self.spec.moe or self.spec.moe_beside).intermediate_size
            if leaf == "w2":
                return "in", [self._even(width)]
            if how.endswith((":gate", ":up")):
                return "out", [self._even(width)]
            lo, ln = self._even(width)
            return "out", [(lo, ln), (width + lo, ln)]
        elif leaf == "o_proj" and how in (None, "t"):
            return "in", [self.q_rows]
        elif leaf == "down_proj" and how in (None, "t"):
            return "in", [self._even(s)]
        elif leaf not in ("qkv_proj", "gate_up_proj", "up_proj", "o_proj", "down_proj", "w13",
                          "w2"):  # fmt: skip
            return None
        raise ConfigError(f"tensor parallelism over {internal} stored as {how!r} is not supported")

    def _mla_split(self, leaf: str, how) -> tuple[str, Ranges]:
        """Latent attention's per-head linears (models/mla.py): the queries' and kv_b_proj's
        output rows of this rank's heads, o_proj's input columns of their values. The rest of
        the layer (q_a_proj, kv_a_proj_with_mqa, their norms) is replicated: every rank makes
        the same latents and caches them whole."""
        if how is not None:
            raise ConfigError(f"tensor parallelism over {leaf} stored as {how!r} is not supported")
        m = self.spec.mla
        first, count = self.q_heads
        width = {
            "q_proj": m.qk_head_dim,
            "q_b_proj": m.qk_head_dim,
            "kv_b_proj": m.qk_nope_head_dim + m.v_head_dim,
            "o_proj": m.v_head_dim,
        }[leaf]
        return ("in" if leaf == "o_proj" else "out"), [(first * width, count * width)]

    def _mixer_split(self, name: str):
        """How this rank cuts the recurrent layer's parameter `name` (`tp_split`)."""
        return self.spec.recurrent.tp_split(name, self.spec.hidden_size, self.tp.rank, self.tp.size)

    def _recurrent(self, internal: str, how, kind: str, tensor) -> tuple[torch.Tensor, object]:
        """This rank's part of a recurrent layer's parameter (`internal` under "mixer"; a bare
        parameter of the mixer, A_log or D, is named by `kind`)."""
        name = kind if internal == "mixer" else internal.partition(".")[2]
        split = self._mixer_split(name)
        if isinstance(how, str) and how.startswith(("mixer:", "rows:")):
            return self._fused_rows(split, how, tensor)
        if split is None:
            return _full(tensor), how
        axis, ranges = split
        if axis == "in":
            if kind == "bias":  # summed by the all-reduce: rank 0 adds it once
                t = _full(tensor)
                return (t if self.tp.rank == 0 else torch.zeros_like(t)), how
            return _read(tensor, 1, ranges), how
        # The split dimension: the first, or past leading 1s (Kimi's A_log is [1, 1, H, 1]).
        dim = next((d for d, n in enumerate(tensor.shape) if n > 1), 0)
        return _read(tensor, dim, ranges), how

    def _fused_rows(self, split, how: str, tensor) -> tuple[torch.Tensor, str]:
        """This rank's rows of one checkpoint tensor that fills part of a fused recurrent weight
        ("mixer:<part>:<n>": in the order the layer's description gives,
        `checkpoint_segments`; "rows:<start>:<n>": from row `start` on), read from the tensor
        in the order of the rank's fused weight, with their placement there:
        "rows:<local start>:<whole model's start>:<n>" (the middle field tells the n parts
        apart when the loader counts them; a part may hold none of this rank's rows)."""
        if split is None or split[0] != "out":
            raise ConfigError(f"tensor parallelism over a fused recurrent weight stored as {how!r}")
        form, first, n = how.split(":")
        rows = tensor.shape[0]
        if form == "mixer":
            runs = self.spec.recurrent.checkpoint_segments(first, rows)
        else:
            runs = [(0, int(first), rows)]
        start = min(dst for _, dst, _ in runs)
        pieces = []  # (row in this rank's weight, checkpoint row, length)
        local = 0
        before = 0  # this rank's rows before `start`: where an empty part would go
        for lo, ln in split[1]:
            before += max(0, min(ln, start - lo))
            for src, dst, length in runs:
                a, b = max(lo, dst), min(lo + ln, dst + length)
                if a < b:
                    pieces.append((local + a - lo, src + a - dst, b - a))
            local += ln
        pieces.sort()
        for (at, _, length), (nxt, _, _) in zip(pieces, pieces[1:]):
            if at + length != nxt:  # a part's rows are one run of the fused weight
                raise ConfigError(f"a checkpoint part ({how}) does not fill one run of rows")
        at = pieces[0][0] if pieces else before
        part = _read(tensor, 0, [(src, length) for _, src, length in pieces] or [(0, 0)])
        return part, f"rows:{at}:{start}:{n}"

    def _mlp_width(self, internal: str) -> int:
        """The full MLP width of the layer at `internal` (a shared expert's own width)."""
        moe = self.spec.moe
        if "shared_expert" in internal and moe is not None:
            return moe.shared_size
        return self.spec.intermediate_size

    def _quantized(self, internal: str, leaf: str, how, kind: str, tensor) -> torch.Tensor:
        """This rank's part of a quantized linear's packed weight, scales, zero points or group
        indices, sliced along the packed layout without unpacking (a range must fall on pack
        and group boundaries)."""
        method = self.scheme.method
        layout = self.QUANT_LAYOUT.get((method, kind))
        if self.scheme.block is not None and kind in ("weight_scale", "weight_scale_inv"):
            # block FP8: one scale per block of rows and columns, split on block boundaries
            layout = {"out": (0, self.scheme.block[0]), "in": (1, self.scheme.block[1])}
        split = self._linear_split(internal, leaf, how)
        if kind == "weight_shape":  # compressed-tensors: [out, in], now this rank's
            out, inp = (int(v) for v in _full(tensor).reshape(-1).tolist())
            if split is not None:
                axis, ranges = split
                size = sum(ln for _, ln in ranges)
                out, inp = (size, inp) if axis == "out" else (out, size)
            return torch.tensor([out, inp], dtype=torch.int64)
        if layout is None or split is None:
            return _full(tensor)
        axis, ranges = split
        where = layout[axis]
        if where is None or (method == "fp8" and tensor.shape in ((), (1,))):
            return _full(tensor)
        dim, unit = where
        if self.scheme.desc_act and axis == "in":
            # Act-order: a rank's inputs belong to groups spread over the whole input, so a
            # row-parallel rank keeps every group's scales and zero points and its inputs' group
            # indices as they are (QuantLinear is told the full group count, `full_groups`).
            if unit == "g":
                return _full(tensor)
            if kind == "g_idx":
                return _read(tensor, dim, ranges)
        step = {"p": 32 // self.scheme.bits, "g": self.scheme.group_size}.get(unit, unit)
        if step == -1:  # one group over the whole input
            return _full(tensor)
        if any(lo % step or ln % step for lo, ln in ranges):
            raise ConfigError(
                f"tensor_parallel_size={self.tp.size}: {internal}.{kind} does not split at "
                f"{step}-row boundaries ({'pack' if unit == 'p' else 'group'} size of the "
                f"{method} checkpoint)"
            )
        part = _read(tensor, dim, [(lo // step, ln // step) for lo, ln in ranges])
        g = self.scheme.group_size
        if kind in ("g_idx", "weight_g_idx") and g != -1:  # this rank's inputs' groups, from 0
            part = part - ranges[0][0] // g
            if int(part.min()) < 0 or int(part.max()) >= ranges[0][1] // g:
                raise ConfigError(
                    f"{internal}.{kind}: act-order groups cross the tensor-parallel ranks' "
                    "inputs; serve this checkpoint without tensor parallelism"
                )
        return part

    # A LoRA part of a fused layer as the placement its checkpoint tensor would have.
    _LORA_HOW = {("qkv_proj", 0): "q", ("qkv_proj", 1): "k", ("qkv_proj", 2): "v",
                 ("gate_up_proj", 0): "gate", ("gate_up_proj", 1): "up"}  # fmt: skip

    def lora_full_shape(self, internal: str, part: int | None, inp: int, out: int):
        """(in features, out rows) of the whole model's layer `internal` (its `part`, None: the
        whole output) that this rank holds `inp` x `out` of: what an adapter's A and B must
        fit before `lora_slice` takes this rank's share. `internal` is the layer's path
        ("layers.<i>.self_attn.qkv_proj"), so a layer of its own head shape counts its own."""
        layer, internal = _layer_of(internal)
        if self.at_layer(layer) is not self:
            return self.at_layer(layer).lora_full_shape(internal, part, inp, out)
        leaf = internal.rpartition(".")[2]
        how = self._LORA_HOW.get((leaf, part))
        split = self._linear_split(internal, leaf, how)
        if split is None:
            return inp, out
        s, width = self.spec, self._mlp_width(internal)
        if s.mla is not None and leaf in ("q_proj", "q_b_proj", "o_proj"):
            full = s.num_heads * (s.mla.v_head_dim if leaf == "o_proj" else s.mla.qk_head_dim)
            return (full, out) if split[0] == "in" else (inp, full)
        qn, kvn = s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim
        full = {"q": qn, "k": kvn, "v": kvn, "gate": width, "up": width}.get(how)
        if full is None:
            full = {"qkv_proj": qn + 2 * kvn, "gate_up_proj": 2 * width, "up_proj": width,
                    "o_proj": qn, "down_proj": width}[leaf]  # fmt: skip
        return (full, out) if split[0] == "in" else (inp, full)

    def lora_slice(self, internal: str, part: int | None, a: torch.Tensor, b: torch.Tensor):
        """This rank's share of an adapter's A [r, in] and B [out, r] for layer `internal`: B's
        rows of a column-parallel layer, A's columns of a row-parallel one (each rank's
        B (A x) is then a partial sum that the layer's all-reduce adds up, like its output)."""
        layer, internal = _layer_of(internal)
        if self.at_layer(layer) is not self:
            return self.at_layer(layer).lora_slice(internal, part, a, b)
        leaf = internal.rpartition(".")[2]
        split = self._linear_split(internal, leaf, self._LORA_HOW.get((leaf, part)))
        if split is None:
            return a, b
        axis, ranges = split
        return (a, _read(b, 0, ranges)) if axis == "out" else (_read(a, 1, ranges), b)

    def full_groups(self, name: str, in_features: int) -> int | None:
        """The group count a row-parallel linear (`name`: its attribute name, `ROW_PARALLEL`:
        o_proj, down_proj, a recurrent layer's out_proj or x_proj, or w2 for experts) of an
        act-order checkpoint holds: every group of the whole input (see `_quantized`); None for
        any other linear."""
        if not (self.scheme is not None and self.scheme.desc_act and self.tp.size > 1):
            return None
        if name not in ROW_PARALLEL or self.scheme.group_size == -1:
            return None
        return -(-in_features * self.tp.size // self.scheme.group_size)

    def _even(self, size: int) -> tuple[int, int]:
        per = size // self.tp.size
        return self.tp.rank * per, per

    def _per_expert(self, rows: int) -> Ranges:
        experts = self.spec.moe.num_experts
        width = rows // experts
        lo, ln = (self.tp.rank * width // self.tp.size, width // self.tp.size)
        return [(e * width + lo, ln) for e in range(experts)]

    def _qkv_interleaved(self, how, tensor) -> torch.Tensor:
        """A fused qkv stored per head ([H, 3, D]: a head's q, k, v rows together, H == KVH) or
        per KV head ([KVH, G + 2, D]: its queries, then its k and v) sliced to this rank's
        heads, in the same layout."""
        s, d = self.spec, self.spec.head_dim
        if how == "qkv_heads":
            lo, ln = self.q_heads
            return _read(tensor, 0, [(lo * 3 * d, ln * 3 * d)])
        g = s.num_heads // s.num_kv_heads
        kv0, kvn = self.kv_heads
        if s.num_kv_heads >= self.tp.size:
            return _read(tensor, 0, [(kv0 * (g + 2) * d, kvn * (g + 2) * d)])
        base = kv0 * (g + 2) * d  # one KV head shared with other ranks: this rank's queries
        q0 = self.q_heads[0] - kv0 * g
        return _read(tensor, 0, [(base + q0 * d, self.q_heads[1] * d), (base + g * d, 2 * d)])

    def _qk_norm(self, leaf: str, how, tensor):
        kind = self.spec.qk_norm
        heads = self.q_heads if leaf == "q_norm" else self.kv_heads
        if kind == "rms_full":  # [heads * D]
            return _read(tensor, 0, [self.q_rows if leaf == "q_norm" else self.kv_rows]), how
        if kind == "layer_head":
            if isinstance(how, str) and how.startswith("head:"):  # one head's row
                h = int(how[5:]) - heads[0]
                return (_full(tensor), f"head:{h}") if 0 <= h < heads[1] else None
            return _read(tensor, 0, [heads]), how
        return _full(tensor), how  # shared by the heads

    def _vocab(self, tensor) -> torch.Tensor:
        lo, ln = self.tp.vocab_range(tensor.shape[0])
        rows = max(0, min(ln, tensor.shape[0] - lo))
        part = _read(tensor, 0, [(lo, rows)]) if rows else None
        if rows == ln:
            return part
        pad = torch.zeros((ln - rows, *tensor.shape[1:]), dtype=tensor.dtype)
        return pad if part is None else torch.cat([part, pad])


def _layer_of(path: str) -> tuple[int | None, str]:
    """(i, the rest) of a path "layers.<i>.<rest>"; (None, path) for any other."""
    head, _, rest = path.partition(".")
    index, _, local = rest.partition(".")
    if head == "layers" and index.isdigit() and local:
        return int(index), local
    return None, path


def _full(tensor) -> torch.Tensor:
    return tensor if isinstance(tensor, torch.Tensor) else tensor.full()


def _read(tensor, dim: int, ranges: Ranges) -> torch.Tensor:
    """`ranges` of `tensor` along `dim`, concatenated (a copy: the checkpoint's storage is let go)."""
    if not isinstance(tensor, torch.Tensor):
        return tensor.read(dim, ranges)
    parts = [tensor.narrow(dim, lo, ln) for lo, ln in ranges]
    return (parts[0] if len(parts) == 1 else torch.cat(parts, dim)).clone()
