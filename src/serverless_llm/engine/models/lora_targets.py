"""Where LoRA adapters attach in a `DecoderModel` (a mixin of it): every attention and dense-MLP
projection wrapped in a `LoRALinear` (layers/lora_linear.py), and an adapter's module names mapped onto
them through the family's `WeightNames`. A hybrid model's recurrent layers take no adapter (an
adapter naming their projections is refused); its attention and MLP layers do."""

from __future__ import annotations

import torch

from ..layers.lora_linear import LoRALinear, LoRAStep


class DecoderLoRA:
    # Latent attention (models/mla.py) takes adapters on its query and latent projections and
    # o_proj; not on kv_b_proj, whose weight the absorbed decode folds into the queries.
    LORA_TARGETS = ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.up_proj",
                    "mlp.down_proj", "self_attn.q_proj", "self_attn.q_a_proj",
                    "self_attn.q_b_proj", "self_attn.kv_a_proj_with_mqa")  # fmt: skip

    def enable_lora(
        self, max_loras: int, max_rank: int, dtype: torch.dtype
    ) -> tuple[LoRAStep, dict[str, LoRALinear]]:
        """Wraps every attention and dense-MLP projection of the decoder layers in a LoRALinear
        with `max_loras` empty slots (after loading; the CPU packing may come before or after).
        Returns the step object the runner fills and the wrapped layers by internal path."""
        s = self.spec
        q, kv = s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim
        device = self.embed_tokens.weight.device
        step = LoRAStep(
            num_slots=max_loras, masked=device.type == "cpu", use_kernels=self.use_kernels
        )
        layers: dict[str, LoRALinear] = {}
        for i, layer in enumerate(self.layers):
            for path in self.LORA_TARGETS:
                parent_name, _, name = path.rpartition(".")
                parent = getattr(layer, parent_name, None)  # None: a recurrent or MLP-less layer
                child = getattr(parent, name, None)
                if child is None:  # a sparse layer's MLP has none of these
                    continue
                out = child.out_features
                if name == "qkv_proj":
                    lq, lkv = getattr(parent, "q_size", q), getattr(parent, "kv_size", kv)
                    parts = [(0, lq), (lq, lkv), (lq + lkv, lkv)][: getattr(parent, "qkv_parts", 3)]
                elif name == "gate_up_proj":
                    parts = [(0, out // 2), (out // 2, out // 2)]
                else:
                    parts = [(0, out)]
                wrapped = LoRALinear(
                    child, child.in_features, parts, max_loras, max_rank, dtype, device, step
                )
                setattr(parent, name, wrapped)
                layers[f"layers.{i}.{path}"] = wrapped
        self.lora_layers = layers
        return step, layers

    def lora_target(self, module: str) -> tuple[str, int | None, int, int]:
        """Where an adapter's module (the checkpoint's name, e.g. model.layers.3.self_attn.q_proj)
        lands: (internal layer path, part index or None for the whole output, in features, out
        rows); KeyError saying why for a module adapters cannot target."""
        names = self.spec.names
        prefix = names.layers_prefix + "."
        if not module.startswith(prefix):
            raise KeyError("only the decoder layers' attention and MLP projections take adapters")
        idx, _, local = module[len(prefix) :].partition(".")
        target = names.layer.get(local)
        if target is None or not idx.isdigit():
            raise KeyError(f"no such module in {self.spec.arch}")
        if local in names.scales:
            raise KeyError(
                f"{self.spec.arch} folds multipliers into this projection's weights at load, "
                "which an adapter's delta would miss"
            )
        internal, how = (target, None) if isinstance(target, str) else target
        layer = getattr(self, "lora_layers", {}).get(f"layers.{idx}.{internal}")
        if layer is None and internal.endswith("kv_b_proj"):
            raise KeyError(
                "latent attention's kv_b_proj is folded into the queries when decoding (the "
                "absorbed form), so adapters cannot target it"
            )
        if layer is None:
            raise KeyError(
                "not a layer adapters can target here (attention and dense MLP projections)"
            )
        if how in self._SHARDS:
            part = self._SHARDS[how]
            if part >= len(layer.parts):  # Gemma 4: no v rows (k_eq_v), or no K/V (shared KV)
                raise KeyError(f"this layer has no {how} projection of its own")
            out_rows = layer.parts[part][1]
        elif how is None:
            part, out_rows = None, layer.lora_b.shape[0]
        else:
            raise KeyError(f"its weight is stored as {how!r}, which adapters cannot target")
        path, in_features = f"layers.{idx}.{internal}", layer.lora_a.shape[2]
        if getattr(self, "sharder", None) is not None:  # tensor parallel: the whole layer's
            in_features, out_rows = self.sharder.lora_full_shape(path, part, in_features, out_rows)
        return path, part, in_features, out_rows
