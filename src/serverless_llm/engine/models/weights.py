"""A `DecoderModel`'s weights (a mixin of it): quantizing its linears before materializing,
placing each checkpoint tensor (`load_weights`, by the family's `WeightNames`), and random
weights for LOAD_FORMAT=dummy."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable

import torch
from torch import nn

from ..kernels.mxfp4 import mxfp4_dequantize
from ..layers.moe import Experts
from ..layers.quant_linear import WHOLE, QuantLinear, QuantLoadError


class DecoderWeights:
    def quantize(self, scheme, mode: str) -> None:
        """Swaps every linear of the decoder layers for a QuantLinear of `scheme` (before
        `materialize`): a fused qkv_proj or gate_up_proj knows its parts' sizes, so the
        checkpoint's separate q/k/v or gate/up tensors each fill theirs."""
        s = self.spec
        if scheme.method == "mxfp4":  # experts only, decoded as they load (`_place`)
            if not any("mxfp4_" in str(t) for t in s.names.layer.values()):
                raise QuantLoadError(
                    f"MXFP4 checkpoints of {s.arch} are not supported (gpt-oss's are)"
                )
            if mode == "packed":  # kept 4-bit, run by the MXFP4 MoE kernel
                for m in self.modules():
                    if isinstance(m, Experts):
                        m.keep_mxfp4(scheme)
                self.quantization = "mxfp4 experts kept 4-bit (MXFP4 MoE kernel)"
            else:
                self.quantization = "mxfp4 experts, dequantized at load"
            return
        if self.sharder is not None:  # tensor parallel: the packed tensors are sliced too
            self.sharder.scheme = scheme
        group = "" if scheme.group_size == -1 else f" group {scheme.group_size}"
        form = mode
        if scheme.block is not None:  # block FP8: which form serves it, in words
            group = f" block {scheme.block[0]}x{scheme.block[1]}"
            if mode != "packed":
                form += " (dequantized once at load)"
            elif self.use_kernels:
                form += " (kept 8-bit: block-scaled Triton GEMM)"
            else:
                form += " (kept 8-bit: dequantized at each call, the torch reference)"
        act = " act-order" if scheme.desc_act else ""
        self.quantization = f"{scheme.method} {scheme.bits}-bit{group}{act}, {form}"
        if s.moe is not None and mode != "packed":
            self.quantization += " (experts dequantized)"
        kv = s.num_kv_heads * s.head_dim
        parts_of = {"qkv_proj": (s.num_heads * s.head_dim, kv, kv), "gate_up_proj": None}
        for layer in self.layers:
            for parent in layer.modules():
                if isinstance(parent, Experts):
                    w2_groups = None
                    if self.sharder is not None:
                        w2_groups = self.sharder.full_groups("w2", parent.inter)
                    parent.quantize(scheme, mode, w2_groups)
                for name, child in list(parent.named_children()):
                    if type(child) is not nn.Linear:
                        continue
                    if name in getattr(parent, "FLOAT_CHILDREN", ()):
                        continue  # MoE routers: quantizers leave them in float
                    parts = parts_of.get(name, (child.out_features,))
                    if name == "qkv_proj" and hasattr(parent, "qkv_parts"):  # its own sizes
                        sizes = (parent.q_size, parent.kv_size, parent.kv_size)
                        parts = sizes[: parent.qkv_parts]
                    if parts is None:
                        parts = (child.out_features // 2,) * 2
                    groups = None
                    if self.sharder is not None:
                        groups = self.sharder.full_groups(name, child.in_features)
                    quant = QuantLinear(
                        child.in_features,
                        child.out_features,
                        child.bias is not None,
                        scheme,
                        parts,
                        mode,
                        self.use_kernels,
                        num_groups=groups,
                    )
                    setattr(parent, name, quant)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copies each checkpoint tensor into its place (see `WeightNames`); raises KeyError for
        a tensor with no place and for parameters the checkpoint leaves unset."""
        names = self.spec.names
        params = dict(self.named_parameters())
        quant = {n: m for n, m in self.named_modules() if isinstance(m, QuantLinear)}
        quant_experts = {
            f"{n}.{which}": (m, which)
            for n, m in self.named_modules()
            if isinstance(m, Experts) and m.scheme is not None
            for which in ("w13", "w2")
        }
        loaded: set[str] = set()
        layer_prefix = names.layers_prefix + "."
        kv_scales: dict[int, dict[str, float]] = {}
        for name, tensor in weights:
            if any(part in name for part in names.ignore) or name.startswith(names.skip_prefixes):
                continue
            module, _, kind = name.rpartition(".")
            if kind in ("k_scale", "v_scale", "kv_scale") and module.startswith(layer_prefix):
                if not isinstance(tensor, torch.Tensor):
                    tensor = tensor.full()
                self._take_kv_scale(kv_scales, module[len(layer_prefix) :], kind, name, tensor)
                continue
            if module == "lm_head" and self.tied:  # a tied checkpoint may still save the head
                if kind == "bias" and "lm_head_bias" in params:
                    if self.sharder is not None:
                        tensor, _ = self.sharder.take("lm_head_bias", None, kind, tensor)
                    self._place(params["lm_head_bias"], "lm_head_bias", None, tensor, loaded)
                continue
            if names.base_prefix and not module.startswith(names.base_prefix):
                if not any(module == t or module.startswith(t + ".") for t in names.top):
                    module = names.base_prefix + module
            if module.startswith(layer_prefix):
                idx, _, local = module[len(layer_prefix) :].partition(".")
                target = names.layer.get(local)
                if names.mixer_layer and idx.isdigit() and int(idx) < len(self.layers):
                    by_kind = names.mixer_layer.get(self.spec.mixers[int(idx)], {})
                    target = by_kind.get(local, target)
                if target is None and f"{local}.{kind}" in names.layer:  # a bare parameter
                    target, kind = names.layer[f"{local}.{kind}"], "weight"
                if local in names.scales:
                    tensor = self._fold_scale(name, kind, tensor, names.scales[local])
                prefix = f"layers.{idx}."
                layer = int(idx) if idx.isdigit() else None
            else:
                target = names.top.get(module)
                prefix, layer = "", None
            if target is None:
                raise KeyError(f"checkpoint tensor {name!r} has no place in {self.spec.arch}")
            internal, how = (target, None) if isinstance(target, str) else target
            if self.sharder is not None:  # tensor parallel: this rank's slice, read now
                taken = self.sharder.take(internal, how, kind, tensor, layer)
                if taken is None:
                    continue
                tensor, how = taken
            pname = f"{prefix}{internal}.{kind}"
            if how is not None and how.startswith("mxfp4_"):  # a half of an MXFP4 projection
                data = params[pname].data if pname in params else None  # None: kept 4-bit
                self._take_mxfp4(data, f"{prefix}{internal}", how, tensor, loaded)
                continue
            experts = quant_experts.get(f"{prefix}{internal}")
            if experts is not None and (kind != "weight" or tensor.dtype == torch.float8_e4m3fn):
                if kind == "bias":  # GPTQ's zero bias for every quantized linear
                    if not bool((tensor == 0).all()):
                        raise QuantLoadError(f"checkpoint tensor {name!r}: an expert has no bias")
                    continue
                module, which = experts
                marks = module.take_quantized(which, how, kind, name, tensor)
                loaded.update(f"{prefix}{internal.rpartition('.')[0]}.{m}" for m in marks)
                continue
            if f"{prefix}{internal}" in quant and kind != "bias":
                self._take_quantized(quant[f"{prefix}{internal}"], name, kind, how, tensor)
                continue
            if pname not in params:
                if kind == "bias" and f"{prefix}{internal}" in quant:
                    # GPTQ writers save a bias for every quantized linear, zeros where the
                    # model has none.
                    if not bool((tensor == 0).all()):
                        raise QuantLoadError(
                            f"checkpoint tensor {name!r} is a non-zero bias for a linear that "
                            f"has none in {self.spec.arch}"
                        )
                    continue
                raise KeyError(f"checkpoint tensor {name!r} maps to unknown parameter {pname!r}")
            self._place(params[pname], pname, how, tensor, loaded)
        late: list[str] = []
        for path in sorted({p.rpartition(".")[0] for p in quant_experts}):
            marks, lack = quant_experts[f"{path}.w13"][0].settle_pending()
            loaded.update(f"{path}.{m}" for m in marks)
            late += lack
        missing = [p for p, t in params.items() if not self._complete(p, t, loaded)]
        for mname, m in quant.items():
            missing += [f"{mname}: {what}" for what in m.missing()]
        missing += late
        if missing:
            raise KeyError(f"checkpoint lacks {len(missing)} tensors, e.g. {missing[:3]}")
        for i, scales in kv_scales.items():
            attn = self.layers[i].self_attn
            attn.spec = dataclasses.replace(attn.spec, **scales)
        if quant and not any(m.packed is not None or m.took_quantized for m in quant.values()):
            scheme = next(iter(quant.values())).scheme
            raise QuantLoadError(
                f"the config says {scheme.method}, but no linear of the checkpoint is quantized "
                "(no qweight tensors): a config from the quantized repo with unquantized weights?"
            )
        self._settle_quantized()

    def _fold_scale(self, name: str, kind: str, tensor, scale: tuple) -> torch.Tensor:
        """A checkpoint tensor times its multiplier (`WeightNames.scales`): the weight's rows by
        the weight scale, the bias by the bias scale, in float32, rounded back once."""
        if not isinstance(tensor, torch.Tensor):
            tensor = tensor.full()
        factor = {"weight": scale[0], "bias": scale[1]}.get(kind)
        if factor is None or tensor.dtype not in (torch.float32, torch.float16, torch.bfloat16):
            raise QuantLoadError(
                f"checkpoint tensor {name!r} ({tensor.dtype}): {self.spec.arch}'s multipliers "
                "are folded into its float weights at load, which a quantized tensor cannot take"
            )
        f = torch.as_tensor(factor, dtype=torch.float32)
        if f.dim() == 1:  # one factor per output row
            f = f.view(-1, *(1,) * (tensor.dim() - 1))
        return (tensor.float() * f).to(tensor.dtype)

    def _take_kv_scale(self, scales: dict, local: str, kind: str, name: str, tensor) -> None:
        """A layer's KV cache scale (FP8 checkpoints made with a quantized KV cache write
        `self_attn.k_scale` and `v_scale`, older ones one `kv_scale`): what an 8-bit float cache
        divides K or V by. Read whatever the cache dtype; used only by an 8-bit cache."""
        idx = local.partition(".")[0]
        if not idx.isdigit() or int(idx) >= len(self.layers) or tensor.numel() != 1:
            raise KeyError(f"checkpoint tensor {name!r} has no place in {self.spec.arch}")
        value = float(tensor.float().reshape(()))
        if not math.isfinite(value) or value <= 0:
            raise KeyError(f"checkpoint tensor {name!r} is {value}: a KV scale must be > 0")
        names = ("k_scale", "v_scale") if kind == "kv_scale" else (kind,)
        scales.setdefault(int(idx), {}).update(dict.fromkeys(names, value))

    def _take_quantized(self, module: QuantLinear, name, kind, how, tensor) -> None:
        if how in self._SHARDS:
            module.take(kind, self._SHARDS[how], name, tensor)
        elif how in ("qkv_heads", "qkv_grouped"):
            module.take(kind, WHOLE, name, tensor, rows=lambda t: self._reorder_rows(how, t))
        elif how is None:
            module.take(kind, WHOLE, name, tensor)
        else:
            raise QuantLoadError(
                f"checkpoint tensor {name!r}: quantized {self.spec.arch} checkpoints are not "
                f"supported (its weights are stored as {how!r})"
            )

    def _settle_quantized(self) -> None:
        """QuantLinears settle on the CPU, where the checkpoint is read: each moves to the
        model's device, and a "dequantize" one becomes a plain nn.Linear (which the CPU packing
        then serves)."""
        device = self.embed_tokens.weight.device
        for parent in list(self.modules()):
            for name, child in list(parent.named_children()):
                if isinstance(child, QuantLinear):
                    child.to(device)
                    if child.weight is not None:
                        setattr(parent, name, child.to_linear())
                elif isinstance(child, Experts) and child.quantized:
                    child.to(device)  # packed experts settle on the CPU too

    def _complete(self, pname: str, param: torch.Tensor, loaded: set[str]) -> bool:
        """Whether the checkpoint filled `pname`: whole, or every one of its parts (the three
        of a qkv_proj (fewer in a layer without its own values or K/V), the two of a
        gate_up_proj, each head of a per-head norm)."""
        if pname in loaded:
            return True
        rows = [name for name in loaded if name.startswith(pname + "#rows:")]
        if rows:  # "rows:<start>:<n>" parts: whole once n of them landed
            return len(rows) == int(rows[0].rsplit(":", 1)[1])
        parts = sum(1 for name in loaded if name.startswith(pname + "#"))
        target = pname.rsplit(".", 2)[-2]
        # per-head norms: a part per row; stacked experts: one per expert (two with gate | up,
        # one for non-gated experts' up rows)
        halves = any(n.endswith((":gate", ":up")) for n in loaded if n.startswith(pname + "#"))
        qkv = 3
        if target == "qkv_proj":
            qkv = getattr(self.get_submodule(pname.rsplit(".", 2)[0]), "qkv_parts", 3)
        need = {"qkv_proj": qkv, "gate_up_proj": 2, "w13": (2 if halves else 1) * param.shape[0]}
        need = need.get(target, param.shape[0])
        return parts > 0 and parts == need

    _SHARDS = {"q": 0, "k": 1, "v": 2, "gate": 0, "up": 1}

    def _place(self, param, pname, how, tensor, loaded: set[str]) -> None:
        s = self.spec
        data = param.data
        if how == "q_gated":  # [q_h | gate_h] per head: q rows to part 0, the gates after v
            h, d = s.num_heads, s.head_dim
            t = tensor.reshape(h, 2, d, *tensor.shape[1:])
            kv = s.num_kv_heads * d
            data.narrow(0, 0, h * d).copy_(t[:, 0].flatten(0, 1))
            data.narrow(0, h * d + 2 * kv, h * d).copy_(t[:, 1].flatten(0, 1))
            loaded.add(f"{pname}#0")
            return
        if how in self._SHARDS:
            i = self._SHARDS[how]
            if how in ("q", "k", "v"):
                sizes = [s.num_heads * s.head_dim] + [s.num_kv_heads * s.head_dim] * 2
                attn = self.get_submodule(pname.rsplit(".", 2)[0])
                if hasattr(attn, "qkv_parts"):  # a layer's own head shape (Gemma 4)
                    sizes = [attn.q_size, attn.kv_size, attn.kv_size][: attn.qkv_parts]
                    if i >= len(sizes):
                        raise KeyError(f"{pname}: this layer has no {how} projection")
            else:
                sizes = [data.shape[0] // 2] * 2
            data.narrow(0, sum(sizes[:i]), sizes[i]).copy_(tensor)
            loaded.add(f"{pname}#{i}")
            return
        if how == "t":
            tensor = tensor.t()
        elif how in ("qkv_heads", "qkv_grouped"):
            tensor = self._reorder_rows(how, tensor)
        elif how is not None and how.startswith("head:"):
            data[int(how[5:])].copy_(tensor)
            loaded.add(f"{pname}#{how}")
            return
        elif how in ("experts:interleaved", "experts:interleaved_t", "experts:stacked_t"):
            self._place_experts(data, how, tensor)
            loaded.add(pname)
            return
        elif how in ("experts:gate", "experts:up", "experts:t"):
            e, rows, cols = data.shape  # w13: [E, 2I, H]; w2: [E, H, I]
            if how == "experts:t":
                dest, stored = data, (e, cols, rows)
            else:
                half = rows // 2
                dest = data.narrow(1, 0 if how == "experts:gate" else half, half)
                stored = (e, half, cols)
            if tensor.numel() != math.prod(stored) or tensor.shape[-1] != stored[-1]:
                raise KeyError(
                    f"checkpoint tensor for {pname} ({how}) is {tuple(tensor.shape)}, expected "
                    f"({stored[0] * stored[1]}, {stored[2]})"
                )
            tensor = tensor.reshape(stored)
            dest.copy_(tensor.transpose(1, 2) if how == "experts:t" else tensor)
            if how == "experts:t":
                loaded.add(pname)
            else:  # each expert's half, as the per-expert placements count them
                loaded.update(f"{pname}#expert:{i}:{how[8:]}" for i in range(e))
            return
        elif how is not None and how.startswith("mixer:"):
            # "mixer:<part>:<n>": one of n checkpoint tensors of a recurrent layer's fused
            # weight, put in its rows in the layer's order by the layer's description
            _, part, n = how.split(":")
            start, tensor = s.recurrent.checkpoint_rows(part, tensor)
            rows = tensor.shape[0]
            data.narrow(0, start, rows).copy_(tensor.reshape(rows, *data.shape[1:]))
            loaded.add(f"{pname}#rows:{start}:{n}")
            return
        elif how is not None and how.startswith("rows:"):
            start = int(how.split(":")[1])
            rows = tensor.shape[0]
            data.narrow(0, start, rows).copy_(tensor.reshape(rows, *data.shape[1:]))
            loaded.add(f"{pname}#{how}")
            return
        elif how is not None and how.startswith("expert:"):
            _, e, half = (how.split(":") + [""])[:3]
            dest = data[int(e)]
            if half:
                rows = dest.shape[0] // 2
                dest = dest.narrow(0, 0 if half == "gate" else rows, rows)
            if tuple(tensor.shape) != tuple(dest.shape):
                raise KeyError(
                    f"checkpoint tensor for {pname} ({how}) is {tuple(tensor.shape)}, expected "
                    f"{tuple(dest.shape)}"
                )
            dest.copy_(tensor)
            loaded.add(f"{pname}#{how}")
            return
        elif how is not None:
            raise ValueError(f"unknown weight placement {how!r}")
        # The offset is the decoder's own norms' (a recurrent mixer's gated norm stores its
        # weight as it is used).
        if s.norm_weight_offset and pname.endswith("norm.weight") and ".mixer." not in pname:
            tensor = tensor.float() + s.norm_weight_offset
        data.copy_(tensor.reshape(data.shape))
        loaded.add(pname)

    @staticmethod
    def _place_experts(data: torch.Tensor, how: str, tensor, experts=None) -> None:
        """Stacked expert tensors stored [E, ...] another way than ours (gpt-oss):
        "experts:interleaved": [E, 2I, ...] with gate and up rows alternating, into our
        [gate | up] rows; "experts:interleaved_t": [E, H, 2I] with gate and up columns
        alternating; "experts:stacked_t": [E, in, out] into our [E, out, in]. `experts`: the
        range of experts `tensor` holds (all of them by default)."""
        dest = data if experts is None else data[experts]
        if how in ("experts:stacked_t", "experts:interleaved_t"):
            tensor = tensor.transpose(1, 2)
        if tuple(tensor.shape) != tuple(dest.shape):
            raise KeyError(
                f"checkpoint tensor ({how}) is {tuple(tensor.shape)} read as the experts' "
                f"{tuple(dest.shape)}"
            )
        if how == "experts:stacked_t":
            dest.copy_(tensor)
            return
        half = dest.shape[1] // 2
        dest.narrow(1, 0, half).copy_(tensor[:, 0::2])
        dest.narrow(1, half, half).copy_(tensor[:, 1::2])

    def _take_mxfp4(self, data, internal: str, how: str, tensor, loaded: set[str]) -> None:
        """One half of an MXFP4 projection ("mxfp4_blocks[:<how>]" or "mxfp4_scales[:<how>]",
        kernels/mxfp4.py) of the stacked expert weight `internal`: held until its other half
        arrives, then handed to the experts kept 4-bit (`data` None: "packed") or decoded
        expert by expert (one expert's float copy in flight) into the stacked weight `data`,
        placed by <how>."""
        kind, _, place = how.partition(":")
        pname = f"{internal}.weight"
        pending = self.__dict__.setdefault("_mxfp4_pending", {})
        halves = pending.setdefault(pname, {})
        halves[kind] = tensor if isinstance(tensor, torch.Tensor) else tensor.full()
        if len(halves) < 2:
            return
        del pending[pname]
        blocks, scales = halves["mxfp4_blocks"], halves["mxfp4_scales"]
        cols = None
        if place.startswith("cols:"):  # tensor parallel: this rank's input channels, decoded
            _, lo, ln = place.split(":")
            cols, place = (int(lo), int(ln)), ""
            if data is None:
                raise QuantLoadError(
                    f"{pname}: a tensor-parallel rank's share of the MXFP4 experts' input "
                    f"channels ({cols[1]}) is not a whole number of 32-channel blocks, so they "
                    "cannot stay 4-bit; use quantized_weights='dequantize' or a "
                    "tensor_parallel_size whose share is"
                )
        if data is None:
            path, _, which = internal.rpartition(".")
            experts = self.get_submodule(path)
            if not isinstance(experts, Experts) or experts.scheme is None:
                raise KeyError(
                    f"MXFP4 tensors for {internal}, which is not a stacked expert weight"
                )
            experts.take_mxfp4(which, blocks, scales, place, self.embed_tokens.weight.device)
            return
        if blocks.shape[0] != data.shape[0]:
            raise KeyError(
                f"{pname}: MXFP4 blocks of {blocks.shape[0]} experts for {data.shape[0]}"
            )
        for e in range(data.shape[0]):
            w = mxfp4_dequantize(blocks[e], scales[e], torch.float32)
            if cols is not None:
                w = w.narrow(1, *cols)
            if place:
                self._place_experts(data, place, w[None], slice(e, e + 1))
            elif tuple(w.shape) != tuple(data.shape[1:]):
                raise KeyError(
                    f"{pname}: MXFP4 expert {tuple(w.shape)}, expected {tuple(data.shape[1:])}"
                )
            else:
                data[e].copy_(w)
        loaded.add(pname)

    def _reorder_rows(self, how: str, tensor: torch.Tensor) -> torch.Tensor:
        """A fused qkv tensor's output rows (dim 0) in the order of qkv_proj: [q | k | v]."""
        s = self.spec
        if how == "qkv_heads":  # [H, 3, D, ...] -> [3, H, D, ...]
            h, d = s.num_heads, s.head_dim
            return tensor.reshape(h, 3, d, *tensor.shape[1:]).transpose(0, 1)
        # qkv_grouped: [KVH, G + 2, D, ...] -> q rows, then k, then v
        kvh, d = s.num_kv_heads, s.head_dim
        g = s.num_heads // kvh
        t = tensor.reshape(kvh, g + 2, d, *tensor.shape[1:])
        return torch.cat([t[:, :g].flatten(0, 2), t[:, g].flatten(0, 1), t[:, g + 1].flatten(0, 1)])

    def init_dummy_weights(self, seed: int) -> None:
        """Random weights from the config alone (LOAD_FORMAT=dummy), for benchmarks."""
        g = torch.Generator(device="cpu").manual_seed(seed)
        for name, p in self.named_parameters():
            if name.endswith("norm.weight"):
                p.data.fill_(1.0)
            elif name.endswith("norm.bias") or name.endswith(".bias"):
                p.data.zero_()
            else:
                p.data.copy_(torch.randn(p.shape, generator=g) * 0.02)
        for m in self.modules():
            if isinstance(m, QuantLinear | Experts):
                m.init_dummy(g)
        self._settle_quantized()
