"""Everything between an EngineConfig and a model ready to step: the checkpoint resolved, the
dtype and context length settled, the attention backend chosen, the decoder built and loaded,
and the number of KV cache blocks the memory left can hold."""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass

import torch

from .config import ATTENTION_BACKENDS, KV_CACHE_DTYPES, ConfigError, EngineConfig, resolve_dtype
from .cpu_tuning import cap_kernel_caches, release_free_memory, tune_allocator
from .hf_overrides import apply_hf_overrides
from .kernels import cpu_native
from .kv_cache import (
    RecurrentState,
    allocate_kv_cache,
    allocate_state,
    bytes_per_block,
    state_bytes,
)
from .kv_cache_manager import CacheLayout, layer_cache_specs, plan_cache_groups, with_chunks
from .layers.attention import (
    AttentionBackend,
    AttentionMetadata,
    NativeCpuBackend,
    TorchAttentionBackend,
    TritonAttentionBackend,
)
from .loader import ResolvedModel, iter_weights, load_hf_config, resolve_model
from .loader.meta_build import quiet_meta
from .loader.multimodal import text_weights
from .loader.prefetch import WeightPrefetch, prefetch_weights
from .loader.quantization import check_quantization, read_side_config
from .models import DecoderModel, DecoderSpec, describe_model
from .models.encoder import EncoderModel, EncoderSpec
from .models.families_encoder import describe_encoder
from .models.sharding import check_shardable
from .multimodal import VisionFamily, vision_family_of
from .parallel.group import SINGLE, TensorParallel
from .speculative import snapshot_slots

logger = logging.getLogger(__name__)

DEFAULT_MAX_MODEL_LEN = 2048  # for a config that names no maximum length


@dataclass
class Vision:
    """A vision-language model's image side: its family (multimodal/base.py), its tower on
    the model's device, and the composite transformers config (the processor reads it)."""

    family: VisionFamily
    tower: torch.nn.Module
    config: object

    @property
    def bidirectional(self) -> str:
        """Where its image tokens attend both ways: "none", "all" or "sliding" layers."""
        return self.family.bidirectional(self.config)

    def tower_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tower.state_dict().values())


@dataclass
class LoadedModel:
    resolved: ResolvedModel
    hf_config: object
    device: torch.device
    dtype: torch.dtype
    max_model_len: int
    backend: AttentionBackend
    model: torch.nn.Module
    cache_dtype: torch.dtype  # the KV cache's: the model dtype, or an 8-bit float
    param_bytes: int = 0  # the weights this process holds (its shard with tensor parallelism)
    hybrid_cache: bool = True  # layers in cache groups by kind (False: one group of every layer)
    vision: Vision | None = None  # a vision-language model's family, tower and processor config

    def cache_layout(self) -> CacheLayout:
        """The model's cache groups: its attention layers by the kind of cache each keeps, and
        its recurrent layers (the state group)."""
        m = self.model
        if getattr(m, "is_encoder", False):  # no layer keeps KV: no block group
            n = m.num_layers
            return CacheLayout((), 1, (0,) * n, (0,) * n)
        windows = getattr(m.spec, "windows", None) or (None,) * m.num_layers
        if not self.hybrid_cache:
            windows = (None,) * m.num_layers
        attention = getattr(m.spec, "attention_layers", None)
        latent = getattr(m.spec, "latent_widths", None)
        specs = layer_cache_specs(windows, self.max_model_len, attention, latent)
        if self.hybrid_cache:  # Llama 4's chunked local layers hold their chunk only
            specs = with_chunks(specs, getattr(m.spec, "chunks", None), self.max_model_len)
        return plan_cache_groups(specs, state_layers=getattr(m.spec, "state_layers", ()))

    def kv_entry_shape(self) -> tuple[int, int, int]:
        """(parts, heads, width) of one token's entry in one layer's cache: K and V per KV head
        (2, KVH, head_dim), or a latent attention layer's row (1, 1, latent + rope)."""
        m = self.model
        shape = getattr(m, "kv_cache_shape", None)
        return shape() if shape is not None else (2, m.num_kv_heads, m.head_dim)

    def kv_bytes_per_token(self) -> int:
        """The KV cache bytes one token holds on this rank, over every cache group (a group's
        padding slots included: they are memory a block spans whether used or not)."""
        layout = self.cache_layout()
        parts, heads, width = self.kv_entry_shape()
        per_group = bytes_per_block(
            layout.layers_per_page, 1, heads, width, self.cache_dtype, parts
        )
        return layout.num_groups * per_group

    def state_slot_bytes(self) -> int:
        """Bytes of one request's recurrent state, over every recurrent layer (0: none)."""
        shapes = getattr(self.model, "state_shapes", dict)()
        return sum(state_bytes(layer) for layer in shapes.values())

    def allocate_kv_cache(self, num_blocks: int, block_size: int, num_slots: int = 2) -> list:
        """The paged KV cache of this model (this rank's KV heads), laid out for its backend:
        one tensor per layer of a cache group, each layer given its slot's; a recurrent layer
        gets its state tensors for `num_slots` slots (`RecurrentState`), a layer with neither
        None."""
        m = self.model
        layout = self.cache_layout()
        tensors = []
        if layout.num_groups:
            parts, heads, width = self.kv_entry_shape()
            tensors = allocate_kv_cache(
                layout.layers_per_page,
                num_blocks,
                block_size,
                heads,
                width,
                self.cache_dtype,
                self.device,
                head_major=self.backend.head_major_cache,
                parts=parts,
            )
        attention = getattr(m.spec, "attention_layers", None) or (True,) * m.num_layers
        caches: list = [
            tensors[slot] if attends else None
            for slot, attends in zip(layout.slot_of_layer, attention)
        ]
        views = getattr(m, "layer_cache_views", None)
        if views is not None:  # layers of another head shape (Gemma 4): views of the tensors
            caches = views(caches)
        for i, shapes in getattr(m, "state_shapes", dict)().items():
            caches[i] = RecurrentState(allocate_state(shapes, num_slots, self.device), caches[i])
        return caches


@dataclass
class PreparedModel:
    """What loading decides before any weight is read (the same on every rank)."""

    resolved: ResolvedModel
    hf_config: object
    scheme: object  # the quantization scheme, or None
    dtype: torch.dtype
    max_model_len: int
    spec: DecoderSpec
    prefetch: WeightPrefetch | None = None  # the weight files read ahead (loader/prefetch.py)


def prepare_model(config: EngineConfig) -> PreparedModel:
    """Resolves the checkpoint (downloading it) and settles dtype, context length and the
    family's description; with tensor parallelism, checks that the model can be split."""
    device = config.resolve_device()
    resolved = resolve_model(config)
    # The disk reads the weights while the CPU reads the config and builds the model (not
    # with tensor parallelism: every rank prepares, and reads only its slices).
    prefetch = prefetch_weights(resolved) if config.tensor_parallel_size == 1 else None
    hf_config = load_hf_config(resolved, trust_remote_code=config.trust_remote_code)
    apply_hf_overrides(hf_config, config.hf_overrides)
    read_side_config(hf_config, resolved.model_dir)
    scheme = check_quantization(config.quantization, hf_config, resolved.source)
    dtype = resolve_dtype(
        config.dtype,
        getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None),
        device,
    )
    spec = describe_encoder(hf_config)
    if spec is not None:  # a bidirectional encoder (models/encoder.py)
        max_model_len = encoder_max_len(spec, resolved.model_dir, config.max_model_len)
    else:
        max_model_len = max_model_len_of(hf_config, config.max_model_len)
        spec = describe_model(hf_config)
    if config.kv_cache_dtype in KV_CACHE_DTYPES and device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        if (major, minor) < (8, 0):  # Triton's FP8 conversions need sm80 (compile-checked)
            raise ConfigError(
                f"kv_cache_dtype={config.kv_cache_dtype}: an 8-bit float KV cache needs a GPU "
                f"of compute capability 8.0 or newer ({torch.cuda.get_device_name(device)} is "
                f"{major}.{minor}); use auto"
            )
    n = config.tensor_parallel_size
    if n > 1 and isinstance(spec, EncoderSpec):
        raise ConfigError(f"{spec.arch}: encoders are not split (tensor_parallel_size=1)")
    if n > 1:
        if device.type == "cuda" and torch.cuda.device_count() < n:
            raise ConfigError(
                f"tensor_parallel_size={n} needs {n} GPUs; {torch.cuda.device_count()} visible"
            )
        check_shardable(spec, n)
    return PreparedModel(resolved, hf_config, scheme, dtype, max_model_len, spec, prefetch)


def rank_device(config: EngineConfig, tp: TensorParallel) -> torch.device:
    """This rank's device: cuda:<rank> with tensor parallelism on CUDA."""
    device = config.resolve_device()
    if device.type == "cuda" and tp.enabled:
        device = torch.device("cuda", tp.rank)
        torch.cuda.set_device(device)
    return device


def load_model(
    config: EngineConfig, tp: TensorParallel = SINGLE, prepared: PreparedModel | None = None
) -> LoadedModel:
    """Builds and loads the model the config names (on meta first, so no memory is touched
    twice), packed for oneDNN on CPU; with tensor parallelism, this rank's shard of it."""
    p = prepared if prepared is not None else prepare_model(config)
    resolved, hf_config, scheme, dtype = p.resolved, p.hf_config, p.scheme, p.dtype
    max_model_len, spec = p.max_model_len, p.spec
    device = rank_device(config, tp)
    if device.type == "cpu":
        tune_allocator()
        cap_kernel_caches()
    torch.manual_seed(config.seed)
    backend = make_attention_backend(config.attention_backend, device)
    with torch.device("meta"), quiet_meta():  # no torch._refs imports (loader/meta_build.py)
        if isinstance(spec, EncoderSpec):
            model = EncoderModel(spec, hf_config, backend)
        else:
            model = DecoderModel(spec, hf_config, backend, max_position=max_model_len, tp=tp)
        if scheme is not None:
            mode = config.quantized_weights
            if mode == "auto":
                mode = "packed" if device.type == "cuda" else "dequantize"
            model.quantize(scheme, mode)
    gguf_tensors, gguf_kernels, gguf_taken = None, None, set()
    if resolved.load_format == "gguf":  # served from the file's blocks (no float copy)
        gguf_tensors, gguf_kernels, gguf_taken = gguf_blocks_on_meta(model, resolved, hf_config)
    # In the model's dtype before any storage exists: materialized in float32 and converted
    # after loading, a 7B float16 model would need 28 GB on the device for a moment.
    with quiet_meta():
        model = model.to(dtype).materialize(device)
    family = vision_family_of(getattr(hf_config, "architectures", None))
    tower_weights: list = []
    if resolved.load_format == "dummy":
        model.init_dummy_weights(config.seed)
    else:
        if gguf_tensors is not None:
            from .loader.gguf_direct import gguf_weights

            weights = gguf_weights(gguf_tensors, hf_config, gguf_taken)
        else:
            weights = iter_weights(resolved, show_progress=config.show_progress, lazy=tp.enabled)
        if getattr(hf_config, "text_part_of", None):  # a multimodal checkpoint's text decoder
            keep = None
            if family is not None:
                prefixes = family.tower_prefixes

                def keep(name: str, tensor) -> None:
                    if name.startswith(prefixes):
                        full = tensor.full() if hasattr(tensor, "full") else tensor
                        tower_weights.append((name, full))

            weights = text_weights(weights, keep)
        model.load_weights(weights)
    if p.prefetch is not None:
        p.prefetch.stop()
    vision = None
    if family is not None:
        vision = load_vision(family, resolved, config, dtype, device, tower_weights)
        vision.tower.set_use_kernels(backend.use_kernels)
    model = model.to(dtype).eval()  # what settled at load in the checkpoint's dtype (scales)
    held = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    held += gguf_blocks_bytes(model)
    if device.type == "cpu":
        choice = model.optimize_for_cpu()
        if choice:
            logger.info(choice)
        if gguf_kernels is not None:
            from .layers.gguf_linear import finish_gguf_blocks

            logger.info(finish_gguf_blocks(model, gguf_kernels))
        elif scheme is not None and config.quantized_weights == "packed":
            from .layers.quant_blocks import serve_int_blocks

            logger.info(serve_int_blocks(model))
        # The load's one-off copies (a shard's tensors before their slices, stacked experts
        # before their panels) were freed into the heap, which keeps freed memory for the
        # steps' activations (cpu_tuning.tune_allocator): give them back once, here.
        release_free_memory()
    cache_dtype = KV_CACHE_DTYPES.get(config.kv_cache_dtype, dtype)
    return LoadedModel(
        resolved,
        hf_config,
        device,
        dtype,
        max_model_len,
        backend,
        model,
        cache_dtype,
        held,
        hybrid_cache=not config.disable_hybrid_kv_cache_manager,
        vision=vision,
    )


def gguf_blocks_on_meta(model, resolved: ResolvedModel, hf_config):
    """A GGUF model served from its blocks (resolve chose it: QUANTIZED_WEIGHTS=packed on CPU):
    on the model still on meta, the linears, token embedding and LM head whose tensors have a
    block layout take them (layers/gguf_linear.py). Returns (the file's tensors, the block
    kernels or None, the names taken); without kernels every tensor loads as float."""
    from .kernels import gguf_blocks
    from .layers.gguf_linear import take_gguf_blocks

    tensors = gguf_blocks.read_tensors(resolved.gguf_path)
    other = gguf_blocks.dequantized_types_line(tensors)  # Q2_K, Q3_K, IQ*, TQ*: floats
    if other:
        logger.info(other)
    kernels = gguf_blocks.load()
    if kernels is None:
        logger.warning("GGUF blocks: off (the block kernels did not build; see the warning "
                       "above): every tensor is dequantized to float32 at load")  # fmt: skip
        return tensors, None, set()
    from .loader.gguf_direct import gguf_block_parts

    return tensors, kernels, take_gguf_blocks(model, tensors, hf_config, kernels, gguf_block_parts)


def gguf_blocks_bytes(model) -> int:
    """Bytes of the GGUF blocks the model holds (not in its state dict)."""
    seen, total = set(), 0
    for m in list(model.modules()) + [getattr(model, "packed_lm_head", None)]:
        blocks = getattr(m, "blocks", None)
        if blocks is not None and hasattr(blocks, "nbytes") and id(blocks) not in seen:
            seen.add(id(blocks))
            total += blocks.nbytes()
    return total


def load_vision(
    family: VisionFamily, resolved: ResolvedModel, config: EngineConfig, dtype, device, weights
) -> Vision:
    """The vision tower of a vision-language checkpoint (replicated on every tensor-parallel
    rank: it is small beside the decoder and its images' features feed every rank's embedding
    rows), its weights from `weights` (random for load_format=dummy)."""
    import transformers

    composite = transformers.AutoConfig.from_pretrained(
        resolved.model_dir, trust_remote_code=config.trust_remote_code, local_files_only=True
    )
    tower = family.build_tower(composite, dtype)
    if resolved.load_format == "dummy":
        gen = torch.Generator().manual_seed(config.seed)
        with torch.no_grad():
            for p in tower.parameters():
                p.copy_(torch.randn(p.shape, generator=gen) * 0.02)
    else:
        tower.load_weights(weights)
    tower = tower.to(device=device, dtype=dtype).eval()  # its size: the engine's ready line
    return Vision(family, tower, composite)


def step_token_budget(config: EngineConfig, device: torch.device) -> int:
    """The most tokens one step computes: max_num_batched_tokens, or 8192 on CUDA, else 2048."""
    if config.max_num_batched_tokens is not None:
        return config.max_num_batched_tokens
    return 8192 if device.type == "cuda" else 2048


def make_attention_backend(name: str, device: torch.device) -> AttentionBackend:
    """The engine's one choice between the Triton kernels and their torch references, made once
    at build: for attention here, and for RMSNorm, rotary and SiLU through the backend's
    `use_kernels`, which the model hands to those layers as it builds them.

    `auto`: Triton on CUDA, the torch reference elsewhere. Left at `auto`, the argument yields to
    ATTENTION_BACKEND in the environment, so the worker and the offline LLM can be forced without
    code changes. `triton` off CUDA runs the kernels in Triton's interpreter, which is only valid
    with TRITON_INTERPRET=1 (tests, debugging: it is very slow)."""
    if name == "auto":
        name = os.environ.get("ATTENTION_BACKEND", "").strip().lower() or "auto"
        if name not in ATTENTION_BACKENDS:
            raise ConfigError(
                f"ATTENTION_BACKEND={name!r}: allowed {', '.join(ATTENTION_BACKENDS)}"
            )
    if name == "auto" and device.type == "cpu":
        kernels = cpu_native.load()  # None, with a warning saying why, where it cannot be
        return NativeCpuBackend(kernels) if kernels is not None else TorchAttentionBackend()
    if name == "auto":
        name = "triton" if device.type == "cuda" else "torch"
    if name == "torch":
        return TorchAttentionBackend()
    if name == "native":
        if device.type != "cpu":
            raise ConfigError(
                f"attention_backend='native' is the CPU path (the device is {device.type})"
            )
        kernels = cpu_native.load()
        if kernels is None:
            raise ConfigError(
                "attention_backend='native': the native CPU kernels could not be built or failed "
                "their self-check (the log says why); use 'torch' or 'auto'"
            )
        return NativeCpuBackend(kernels)
    if name != "triton":
        raise ConfigError(f"attention_backend={name!r}: allowed {', '.join(ATTENTION_BACKENDS)}")
    interpreted = os.environ.get("TRITON_INTERPRET", "0").strip() == "1"
    if device.type != "cuda" and not (device.type == "cpu" and interpreted):
        raise ConfigError(
            f"attention_backend='triton' needs a CUDA device (the device is {device.type}); "
            "on CPU use 'torch', or set TRITON_INTERPRET=1 to run the kernels in Triton's "
            "interpreter (tests and debugging only)"
        )
    try:
        return TritonAttentionBackend()
    except ImportError as e:  # the CPU build of torch does not bring Triton
        raise ConfigError(
            f"attention_backend='triton' needs the triton package, which is not importable: {e}"
        ) from e


def max_model_len_of(hf_config, requested: int | None) -> int:
    """The context length: the requested one, which may not exceed the model's own."""
    limit = None
    for key in ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length"):
        value = getattr(hf_config, key, None)
        if isinstance(value, int) and value > 0:
            limit = value
            break
    if requested is None:
        if limit is None:
            # Bloom's config names no length (ALiBi has no table to run out of): vLLM's default.
            logger.warning(
                "the model config gives no maximum length; serving %d tokens (set max_model_len)",
                DEFAULT_MAX_MODEL_LEN,
            )
            return DEFAULT_MAX_MODEL_LEN
        return limit
    if limit is not None and requested > limit:
        raise ConfigError(f"max_model_len={requested} exceeds the model's maximum length {limit}")
    return requested


def encoder_max_len(spec: EncoderSpec, model_dir: str | None, requested: int | None) -> int:
    """An encoder's longest input: what its position table covers (XLM-RoBERTa's starts past
    the pad id), and no more than a sentence-transformers `max_seq_length`
    (sentence_bert_config.json), as sentence-transformers itself truncates there."""
    limit = spec.max_tokens
    path = os.path.join(model_dir or "", "sentence_bert_config.json")
    if model_dir and os.path.isfile(path):
        with open(path, encoding="utf-8") as f:
            st_len = json.load(f).get("max_seq_length")
        if isinstance(st_len, int) and 0 < st_len < limit:
            limit = st_len
    if requested is None:
        return limit
    if requested > limit:
        raise ConfigError(f"max_model_len={requested} exceeds the encoder's maximum length {limit}")
    return requested


@dataclass
class CacheCapacity:
    """What the cache memory holds: KV blocks, and recurrent-state slots (slot 0 is scratch;
    0 for a model without recurrent layers)."""

    num_blocks: int
    num_slots: int = 0
    # Memory neither blocks nor slots take: an attention-free model's, after its slots (a
    # speculative head's or draft's KV cache is sized from it).
    left_bytes: int = 0


def cache_capacity(
    config: EngineConfig, loaded: LoadedModel, block_size: int, max_num_batched_tokens: int
) -> CacheCapacity:
    """NUM_KV_BLOCKS when set; on CUDA what GPU_MEMORY_UTILIZATION leaves after a profiled
    peak step; on CPU the configured cache size. A model with recurrent layers first gives
    max_num_seqs requests (plus the scratch slot, and with speculation a spare slot for each
    request that may speculate: speculative.snapshot_slots) their states, from at most half of
    that memory when it also attends (all of it when it does not), and the KV blocks the rest;
    with less room, fewer requests run at once (the others queue)."""
    layout = loaded.cache_layout()
    parts, heads, width = loaded.kv_entry_shape()
    per_block = bytes_per_block(
        layout.layers_per_page, block_size, heads, width, loaded.cache_dtype, parts
    )
    slot_bytes = loaded.state_slot_bytes()
    if config.num_kv_blocks is not None and not slot_bytes:
        return CacheCapacity(config.num_kv_blocks)
    if loaded.device.type == "cuda":
        budget = _profile_cuda_budget(config, loaded, block_size, max_num_batched_tokens)
    else:
        budget = int(config.kv_cache_space_gib * (1 << 30))
    if loaded.vision is not None:  # the encoder cache comes out of the same memory
        budget -= encoder_cache_bytes(config, loaded)
    if not slot_bytes:
        if loaded.device.type == "cuda" and budget < per_block:
            raise ConfigError(
                f"no GPU memory left for the KV cache at gpu_memory_utilization="
                f"{config.gpu_memory_utilization}"
            )
        return CacheCapacity(max(1, budget // per_block))
    share = budget // 2 if layout.num_groups else budget
    spare = snapshot_slots(config.speculative_config, config.max_num_seqs)
    slots = min(config.max_num_seqs + 1 + spare, share // slot_bytes)
    if slots < 2:
        raise ConfigError(
            f"the cache memory ({budget / 2**20:.1f} MiB) has no room for one request's "
            f"recurrent state ({slot_bytes / 2**20:.1f} MiB): give the cache more memory "
            "(GPU_MEMORY_UTILIZATION, KV_CACHE_SPACE)"
        )
    if config.num_kv_blocks is not None:
        return CacheCapacity(config.num_kv_blocks, slots)
    if not layout.num_groups:
        # no attention: the block pool is never drawn on
        return CacheCapacity(1, slots, budget - slots * slot_bytes)
    return CacheCapacity(max(1, (budget - slots * slot_bytes) // per_block), slots)


def encoder_cache_bytes(config: EngineConfig, loaded: LoadedModel) -> int:
    """The encoder cache of a vision-language model: image features for twice a step's token
    budget (at least 4096 rows) of the decoder's width, in the model dtype."""
    if loaded.vision is None:
        return 0
    rows = max(2 * step_token_budget(config, loaded.device), 4096)
    width = loaded.model.full_spec.hidden_size
    return rows * width * torch.finfo(loaded.dtype).bits // 8


def profile_metadata(n: int, block_size: int, dev: torch.device, state: bool) -> AttentionMetadata:
    """The metadata of one request's first `n`-token step with nothing cached, writing no KV
    (the largest step the scheduler can form, for profiling and warm-up); with recurrent
    layers it starts a state in slot 1."""
    meta = AttentionMetadata(
        query_start_loc=torch.tensor([0, n], dtype=torch.int32, device=dev),
        seq_lens=torch.tensor([n], dtype=torch.int32, device=dev),
        context_lens=torch.zeros(1, dtype=torch.int32, device=dev),
        block_tables=torch.zeros(1, 1, dtype=torch.int32, device=dev),
        slot_mapping=torch.full((n,), -1, dtype=torch.int64, device=dev),
        num_decodes=0,
        max_query_len=n,
        max_seq_len=n,
        query_lens_host=[n],
        seq_lens_host=[n],
        block_size=block_size,
    )
    if state:
        meta.state_slots = torch.ones(1, dtype=torch.int32, device=dev)
        meta.has_initial_state = torch.zeros(1, dtype=torch.bool, device=dev)
    return meta


@torch.inference_mode()
def _profile_cuda_budget(
    config: EngineConfig,
    loaded: LoadedModel,
    block_size: int,
    max_num_batched_tokens: int,
) -> int:
    """Runs the largest step the scheduler can produce, with nothing cached, and returns the
    bytes of GPU_MEMORY_UTILIZATION of the device left after that peak, for the cache."""
    dev = loaded.device
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(dev)
    n = min(max_num_batched_tokens, loaded.max_model_len)
    m = loaded.model
    dummy = loaded.allocate_kv_cache(1, block_size)
    meta = profile_metadata(n, block_size, dev, loaded.cache_layout().has_state)
    loaded.backend.prepare(meta)
    hidden = m(
        torch.zeros(n, dtype=torch.int64, device=dev), torch.arange(n, device=dev), dummy, meta
    )
    rows = min(config.max_num_seqs, n)
    m.compute_logits(hidden[:rows]).float().softmax(-1)
    torch.cuda.synchronize(dev)
    peak = torch.cuda.max_memory_allocated(dev)
    del hidden, dummy
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(dev)
    non_torch = total - free - torch.cuda.memory_reserved(dev)
    budget = total * config.gpu_memory_utilization - peak - non_torch
    if budget <= 0:
        raise ConfigError(
            f"no GPU memory left for the KV cache at gpu_memory_utilization="
            f"{config.gpu_memory_utilization} (weights and activations peak at "
            f"{peak / 2**30:.1f} GiB of {total / 2**30:.1f} GiB)"
        )
    return int(budget)
