"""A GGUF file's tensors read straight from the file, under the checkpoint names the model's
loader knows, without a converted float copy on disk.

The name map is the `gguf` package's tensor-name table (what llama.cpp's converter names each
checkpoint module) applied to the module names of our family description (models/,
`WeightNames`), so a family's own names and fused tensors come from its description, not from
a loader of its own; a layer's stacked experts are read one expert at a time. The per-family
fix-up of a tensor's values is transformers' (`TENSOR_PROCESSORS`: llama's q/k row order,
gemma's `1 + w` norms, Bloom's q/k/v order, GPT-2's transposed Conv1D weights, Mamba's `A`),
Falcon's our own. The tensors a caller keeps in their blocks (layers/gguf_linear.py; which ones
a layer's linears stack: `gguf_block_parts`) are skipped; every other one is read as float32
(F32/F16/BF16 exactly, quantized types dequantized as the `gguf` package does), one at a time.
Every architecture served from the file by default is tested against the same weights
dequantized (tests/engine/test_gguf_families.py).
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import torch

from ..kernels.gguf_blocks import FileTensor, tensor_to_float


def gguf_name_map(hf_config) -> tuple[dict[str, str], object]:
    """(GGUF tensor name -> checkpoint name, the family's tensor processor) for `hf_config`: the
    `gguf` package's tensor-name table (checkpoint module name -> GGUF name) applied to the
    module names our family description reads (models/, `WeightNames`). transformers'
    `get_gguf_hf_weights_map` does the same from a transformers model built on meta, which
    costs importing its modeling code (seconds) and walking every submodule's state dict."""
    from gguf import MODEL_ARCH_NAMES, get_tensor_name_map
    from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, TensorProcessor

    from ..models import describe_model

    model_type = hf_config.model_type
    # the file's architecture name: llama.cpp writes Mistral's files as llama ones
    arch_name = {"cohere": "command-r", "qwen2_moe": "qwen2moe", "qwen3_moe": "qwen3moe",
                 "gemma3_text": "gemma3", "gpt_oss": "gpt-oss", "mistral": "llama",
                 "minimax_m2": "minimax-m2"}.get(model_type, model_type)  # fmt: skip
    arch = next((k for k, v in MODEL_ARCH_NAMES.items() if v == arch_name), None)
    if arch is None:
        raise ValueError(f"the gguf package has no tensor names for {model_type}")
    layers = hf_config.num_hidden_layers
    table = get_tensor_name_map(arch, layers)
    wn = describe_model(hf_config).names
    # A module that fills its target whole before one that fills a part of it: where both have
    # the file's name (phi3's fused `mlp.gate_up_proj` and llama's `mlp.up_proj`, inherited,
    # are both `ffn_up` to the table), the file holds the fused one, as the checkpoint did.
    local = sorted(wn.layer, key=lambda k: not isinstance(wn.layer[k], str))
    modules = list(wn.top) + [f"{wn.layers_prefix}.{i}.{name}" for i in range(layers)
                              for name in local]  # fmt: skip
    names = {}
    for i in range(layers):  # per-expert checkpoint tensors: the file stacks them, [experts, ...]
        for local, target in wn.layer.items():
            how = target[1] if isinstance(target, tuple) else ""
            if how.startswith("expert:"):
                e = how.split(":")[1]
                layer = f"{wn.layers_prefix}.{i}."
                got = table.get_name(layer + local.replace(f".{e}.", ".", 1))
                if got is not None:  # one name for every expert: `{}` takes the expert's index
                    each = layer + local.replace(f".{e}.", ".{}.", 1) + ".weight"
                    names.setdefault(f"{got}.weight", each)
    for module in modules:
        if module.endswith((".weight", ".bias")):  # one tensor of a module (Mamba's dt_proj)
            got = table.get_name(module, try_suffixes=(".weight", ".bias"))
            if got is not None:
                names.setdefault(got, module)
            continue
        # llama.cpp's converter drops a checkpoint's outer `transformer.` for some families
        # (Bloom's `h.N...`, `word_embeddings`): the table knows those names without it
        got = table.get_name(module) or table.get_name(module.split(".", 1)[-1])
        if got is not None:
            # a module's weight and bias, or a bare parameter (Mamba's A_log: `blk.N.ssm_a`)
            names.setdefault(got, module)
            for suffix in ("weight", "bias"):
                names.setdefault(f"{got}.{suffix}", f"{module}.{suffix}")
    # the values' fix-ups by the file's architecture (llama's q/k rows, permuted by llama.cpp's
    # converter, mistral files included; gemma's norms, stored as 1 + w)
    # (Falcon's: our own, transformers has none)
    kind = _falcon_processor() if arch_name == "falcon" else TENSOR_PROCESSORS.get(arch_name)
    return names, (kind or TensorProcessor)(config=hf_config.to_dict())


def _falcon_processor():
    from transformers.modeling_gguf_pytorch_utils import GGUFTensor, TensorProcessor

    class FalconProcessor(TensorProcessor):
        """Falcon's new decoder (40B-style): llama.cpp's converter stores the fused q/k/v as
        every q head, then the k heads, then the v heads; the checkpoint (and this engine's
        `qkv_grouped`) holds [kv_heads, q heads of the group + k + v, head_dim] rows. The old
        decoder's multi-query q | k | v is stored as it is. (transformers has no Falcon
        processor: its own conversion keeps the file's order.)"""

        def process(self, weights, name, **kwargs):
            c = self.config
            if "attn_qkv" in name and c.get("new_decoder_architecture"):
                heads, kv = c["num_attention_heads"], c["num_kv_heads"]
                d = c["hidden_size"] // heads
                rest = weights.shape[1:]
                q = weights[: heads * d].reshape(kv, heads // kv, d, *rest)
                k = weights[heads * d : (heads + kv) * d].reshape(kv, 1, d, *rest)
                v = weights[(heads + kv) * d :].reshape(kv, 1, d, *rest)
                weights = np.concatenate([q, k, v], axis=1).reshape(-1, *rest)
            return GGUFTensor(weights, name, {})

    return FalconProcessor


def gguf_weights(
    tensors: dict[str, FileTensor], hf_config, skip: set[str] | frozenset = frozenset()
) -> Iterator[tuple[str, torch.Tensor]]:
    """(checkpoint name, float32 tensor) for every tensor of the file the model has a name for,
    except those in `skip` (GGUF names)."""
    names, processor = gguf_name_map(hf_config)
    for gname, t in tensors.items():
        if gname in skip or gname not in names:
            continue
        w = tensor_to_float(t).numpy()
        shape = tuple(reversed(t.shape))  # the file lists inputs first
        w = w.reshape(shape)
        if "{}" in names[gname]:  # a stack of experts' matrices (`ffn_gate_exps`): one by one
            for e in range(shape[0]):
                yield names[gname].format(e), torch.from_numpy(np.ascontiguousarray(w[e]))
            continue
        got = processor.process(weights=w, name=gname, tensor_key_mapping=names,
                                parsed_parameters={"tensors": {}, "config": {}})  # fmt: skip
        if got is None or got.weights is None or got.name not in names:
            continue  # a processor that places a tensor itself (gpt-oss's experts): not here
        yield names[got.name], torch.from_numpy(np.ascontiguousarray(got.weights, np.float32))


_STACK = {"q": 0, "k": 1, "v": 2, "gate": 0, "up": 1}  # a fused linear's parts, in row order
_STACKS = ({"q", "k", "v"}, {"gate", "up"})


def gguf_block_parts(hf_config, i: int) -> dict[str, list[tuple[str, int | None]]]:
    """Per linear of decoder layer i that the file's blocks can serve (its module path inside
    the layer): the GGUF weights it stacks, in row order, each with the head count where
    llama.cpp's converter permuted the rows (llama's q and k), else None. Derived from the
    family's weight-name map, so a family's own names need no loader of their own: phi3's fused
    `attn_qkv` and `ffn_up` serve qkv_proj and gate_up_proj whole, a plain MLP's `ffn_up` its
    up_proj, GPT-2's Conv1D weights (stored [out, in] by llama.cpp) theirs. Layouts the blocks
    cannot take as stored (Bloom's and Falcon's per-head q/k/v, MoE experts, row slices) are
    left out: those linears load as float. Norms come too: the caller takes the entries that
    are linears and checks each stack's shape against the linear's. Every layer's are found in
    one pass over the name map and kept for the next call on the same config (a 48-layer MoE's
    map holds ~1,500 names)."""
    cached = _PARTS_CACHE.get("config")
    if cached is not hf_config:
        _PARTS_CACHE.update(config=hf_config, parts=_all_block_parts(hf_config))
    return _PARTS_CACHE["parts"].get(i, {})


_PARTS_CACHE: dict = {}


def _all_block_parts(hf_config) -> dict[int, dict[str, list[tuple[str, int | None]]]]:
    from ..models import describe_model

    names, processor = gguf_name_map(hf_config)
    wn = describe_model(hf_config).names
    heads = hf_config.num_attention_heads
    kv = getattr(hf_config, "num_key_value_heads", None) or heads
    permuted = type(processor).__name__ == "LlamaTensorProcessor"
    transposed = type(processor).__name__ == "GPT2TensorProcessor"
    whole: dict[int, dict[str, str]] = {}
    stacked: dict[int, dict[str, dict[str, str]]] = {}
    lead = f"{wn.layers_prefix}."
    for gname, ckpt in names.items():
        if not (gname.endswith(".weight") and ckpt.startswith(lead)):
            continue
        index, _, local = ckpt[len(lead) :].partition(".")
        if not index.isdigit():
            continue
        i = int(index)
        target = wn.layer.get(local[: -len(".weight")], wn.layer.get(local))
        if isinstance(target, str) or (transposed and target and target[1] == "t"):
            name = target if isinstance(target, str) else target[0]
            whole.setdefault(i, {}).setdefault(name, gname)
        elif target and target[1] in _STACK:
            stacked.setdefault(i, {}).setdefault(target[0], {})[target[1]] = gname
    parts: dict[int, dict[str, list[tuple[str, int | None]]]] = {}
    for i in set(whole) | set(stacked):
        layer = parts[i] = {t: [(g, None)] for t, g in whole.get(i, {}).items()}
        for target, got in stacked.get(i, {}).items():
            if target in layer or set(got) not in _STACKS:
                continue  # a fused tensor of the file serves it whole; or a stack missing a part
            order = sorted(got, key=_STACK.__getitem__)
            count = {"q": heads, "k": kv} if permuted else {}
            layer[target] = [(got[how], count.get(how)) for how in order]
    return parts
