"""The synchronous engine: owns the model, the KV cache, the scheduler and the sampler; `step()`
runs one scheduled batch and returns what each request produced.

A step is: schedule (scheduler.py) -> execute the ragged batch (model_runner.py) -> sample
(sampling/sampler.py) -> postprocess each sampled token (output_processor.py, or the beam search
driver, beam_runner.py). Requests come in through `add`, built and checked by
input_processor.py, so an invalid request never reaches the scheduler or holds blocks.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time

import torch

from .beam_runner import BeamSearchRunner
from .config import ConfigError, EngineConfig, lora_dtype
from .cpu_tuning import ThreadGovernor
from .decode_capture import CapturedDecode
from .draft_model import DraftModel, check_same_tokenizer, split_blocks
from .eagle import HeadLoad, HiddenDraft, check_mtp_target, load_eagle, load_eagle3, load_mtp
from .generation_defaults import sampling_defaults
from .input_processor import (
    ImageInputs,
    InputProcessor,
    InvalidRequestError,
    PreparedPrompt,
    PromptInput,
)
from .kv_cache import BlockPool
from .kv_cache_manager import KVCacheManager, StatePool, blocks_for_one_request
from .loader import ModelLoadError
from .lora_adapters import LoRAManager, LoRARequest
from .model_builder import (
    cache_capacity,
    encoder_cache_bytes,
    load_model,
    prepare_model,
    step_token_budget,
)
from .model_runner import ModelRunner
from .output_processor import make_output, process_token
from .outputs import EngineOutput, EngineStats
from .parallel.group import COLLECTIVE_TIMEOUT_S, SINGLE, TensorParallel, TensorParallelError
from .parallel.workers import RankProcesses, backend_for, threads_per_rank
from .pooling import (
    PoolingParams,
    TokenPairHead,
    embed_params,
    embedding_output,
    instructed_text,
    reranker_prompt_ids,
    sentence_transformers_pooling,
    sentence_transformers_prompts,
)
from .request import FinishReason, Request
from .sampling.params import SamplingParams
from .sampling.sampler import Sampler, SamplingBatch
from .sampling.structured.bitmask import allocate_bitmask, fill_bitmasks
from .sampling.verify import DraftRun, verify_sampled
from .scheduler import Sampled, Scheduler
from .speculative import (
    accept_greedy,
    backing_off,
    can_speculate,
    note_verified,
    parse_speculative_config,
    plain_argmax,
    probe_drafts,
    propose_ngram,
    verify_rows,
)
from .tokenizer import eos_token_ids, load_generation_config, load_tokenizer

logger = logging.getLogger(__name__)


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        t0 = time.perf_counter()
        self.config = config
        # Seconds of each start-up phase (the worker's start-up line, bench/coldstart.py).
        self.start_phases: dict[str, float] = {}
        self.tp: TensorParallel = SINGLE
        self._load_window: tuple[float, float] | None = None  # rank 0's, with parallelism
        self.ranks: RankProcesses | None = None  # the other tensor-parallel ranks
        tokenizer, tokenizer_seconds = None, 0.0
        if config.tensor_parallel_size > 1:
            loaded = self._start_ranks(config)
        else:
            prepared = prepare_model(config)
            # The tokenizer before the weights: the weight files are being read ahead
            # (loader/prefetch.py), so on a cold page cache its load fills the wait for the
            # disk instead of following it.
            t_tok = time.perf_counter()
            tokenizer = load_tokenizer(
                prepared.resolved.tokenizer_dir, trust_remote_code=config.trust_remote_code
            )
            tokenizer_seconds = time.perf_counter() - t_tok
            loaded = load_model(config, prepared=prepared)
        self.start_phases["weights"] = time.perf_counter() - t0 - tokenizer_seconds
        if tokenizer is not None:
            self.start_phases["tokenizer"] = tokenizer_seconds
        try:
            self._build(config, loaded, t0, tokenizer)
        except BaseException:
            self.close()
            raise

    def _image_inputs(self, config: EngineConfig) -> ImageInputs | None:
        """The processor of a vision-language model, from its checkpoint's files; None (the
        model is served for text, with a warning) when they cannot make one."""
        family = self.vision.family
        try:
            processor = family.make_processor(self.resolved.model_dir, self.vision.config)
        except Exception as e:
            logger.warning(
                "%s: cannot build its image processor (%s: %s): serving it for text only; "
                "image prompts are refused",
                self.resolved.source,
                type(e).__name__,
                e,
            )
            return None
        whole = self.vision.bidirectional != "none"
        return ImageInputs(family, processor, self.max_num_batched_tokens if whole else None)

    def _start_ranks(self, config: EngineConfig):
        """Tensor parallelism: checks that the model splits, starts ranks 1..N-1 and loads
        rank 0's shard beside them (parallel/workers.py)."""
        prepared = prepare_model(config)  # a model that cannot be split fails before any spawn
        device = config.resolve_device()
        if device.type == "cpu":
            torch.set_num_threads(threads_per_rank(config.tensor_parallel_size))
        self.ranks = RankProcesses(config)
        try:
            self.ranks.wait_for("joining")  # a rank that cannot start fails here, not in a wait
            self.tp = TensorParallel.join(
                0,
                config.tensor_parallel_size,
                self.ranks.init_file,
                backend_for(device),
                COLLECTIVE_TIMEOUT_S,
            )
            slots = self.ranks.load_slots
            with slots if slots is not None else contextlib.nullcontext():
                start = time.time()
                loaded = load_model(config, self.tp, prepared)
                self._load_window = (start, time.time())
            self.ranks.wait_for("loaded")
        except BaseException:
            self.close()
            raise
        return loaded

    def _build(self, config: EngineConfig, loaded, t0: float, tokenizer=None) -> None:
        self.resolved = loaded.resolved
        self.hf_config = loaded.hf_config
        self.device = loaded.device
        self.dtype = loaded.dtype
        self.cache_dtype = loaded.cache_dtype
        self.max_model_len = loaded.max_model_len
        self.backend = loaded.backend
        self.model = model = loaded.model
        self.param_bytes = loaded.param_bytes
        self.max_num_batched_tokens = step_token_budget(config, self.device)
        # CPU: the op thread count follows the cores other processes leave (cpu_tuning).
        self._threads = (
            ThreadGovernor(torch.get_num_threads()) if self.device.type == "cpu" else None
        )
        if self.max_num_batched_tokens < 1:
            raise ConfigError(f"max_num_batched_tokens={self.max_num_batched_tokens}: must be >= 1")

        if tokenizer is None:  # with tensor parallelism: not loaded beside the weights
            tokenizer = load_tokenizer(
                self.resolved.tokenizer_dir, trust_remote_code=config.trust_remote_code
            )
        self.tokenizer = tokenizer
        eos = eos_token_ids(
            self.tokenizer, self.hf_config, load_generation_config(self.resolved.model_dir)
        )
        self.sampling_defaults = sampling_defaults(
            self.resolved.model_dir, config.generation_config, config.override_generation_config
        )
        self.vocab_size = self.hf_config.vocab_size
        self.task = self._resolve_task(config)
        self.pooling = self._pooling_defaults(config)
        self.encoder = getattr(self.model, "is_encoder", False)
        if self.encoder:
            self._fit_encoder(config)
        self.pooling_head = self._pooling_head(config)
        self.prompts = sentence_transformers_prompts(self.resolved.model_dir)
        self.inputs = InputProcessor(
            self.tokenizer,
            self.vocab_size,
            self.max_model_len,
            eos,
            grammar_compile_timeout=config.grammar_compile_timeout,
            grammar_max_chars=config.grammar_max_chars,
        )

        self.vision = loaded.vision
        if self.vision is not None:
            self.inputs.images = self._image_inputs(config)
            template = getattr(self.inputs.images, "processor", None)
            template = getattr(template, "chat_template", None)
            if isinstance(template, str) and not getattr(self.tokenizer, "chat_template", None):
                # Vision checkpoints often keep their template with the processor
                # (chat_template.json / .jinja), not in the tokenizer's config.
                self.tokenizer.chat_template = template
        self.block_size = config.block_size
        draft = self._load_draft(config, loaded)  # before the cache is sized: its weights count
        capacity = cache_capacity(config, loaded, self.block_size, self.max_num_batched_tokens)
        num_blocks, num_slots = capacity.num_blocks, capacity.num_slots
        draft_blocks = None
        if draft is not None and config.num_kv_blocks is None:
            num_blocks = split_blocks(
                num_blocks, loaded.kv_bytes_per_token(), draft.kv_bytes_per_token()
            )
            if not loaded.kv_bytes_per_token():  # no attention: what the states leave
                per_block = draft.kv_bytes_per_token() * self.block_size
                draft_blocks = max(1, capacity.left_bytes // per_block)
        if self.ranks is not None:  # every rank's cache holds the same blocks: the fewest
            try:
                num_blocks = self.tp.min_int(num_blocks, self.device)
                num_slots = self.tp.min_int(num_slots, self.device)
            except Exception as e:
                raise self.ranks.failure(e) from e
        self.cache_layout = layout = loaded.cache_layout()
        # Resident KV bytes a token costs (this rank's, every cache group): MLA's latents show
        # here as a fraction of what per-head K and V would take.
        self.kv_bytes_per_token = loaded.kv_bytes_per_token()
        self.num_state_slots = num_slots
        one_request = blocks_for_one_request(
            layout, self.block_size, self.max_model_len, self.max_num_batched_tokens
        )
        if num_blocks < one_request:
            raise ConfigError(
                f"the KV cache holds {num_blocks} blocks of {self.block_size} tokens, fewer than "
                f"the {one_request} one request of max_model_len={self.max_model_len} needs: "
                "lower max_model_len or give the cache more memory"
            )
        t_kv = time.perf_counter()
        self.kv_caches = loaded.allocate_kv_cache(num_blocks, self.block_size, max(num_slots, 2))
        self.start_phases["KV allocation"] = time.perf_counter() - t_kv
        prefix_caching = config.enable_prefix_caching
        # With recurrent layers a cached prefix also needs the state after it: kept in spare
        # state slots at block boundaries where a step ends (a prompt's chunk ends at its last
        # one), and a prefix serves only where its state is kept (kv_cache_manager).
        self.block_pool = BlockPool(num_blocks, prefix_caching)
        self.state_pool = StatePool(num_slots) if layout.has_state else None
        self.kv = KVCacheManager(self.block_pool, layout, self.block_size, self.state_pool)
        self.lora = None
        self._retiring_loras: set[int] = set()  # adapters to forget once no request uses them
        if config.enable_lora:
            self.lora = LoRAManager(
                model,
                config.max_loras,
                config.max_lora_rank,
                config.max_cpu_loras or config.max_loras,
                lora_dtype(config, self.dtype),
                cache_dir=config.download_dir,
                token=config.hf_token,
            )
        self.scheduler = Scheduler(
            self.kv,
            self.block_size,
            config.max_num_seqs,
            self.max_num_batched_tokens,
            config.max_loras if config.enable_lora else 0,
            config.scheduling_policy,
            config.max_num_partial_prefills,
        )
        self.runner = ModelRunner(
            self.model, self.kv_caches, self.backend, self.block_size, self.device, layout
        )
        self.runner.kv = self.kv
        self.runner.pooling_head = self.pooling_head
        if self.vision is not None:
            mode = self.vision.bidirectional
            if not self.runner.attach_vision(
                self.vision.tower, encoder_cache_bytes(config, loaded), mode
            ):
                logger.warning(
                    "%s: its image tokens attend both ways on the sliding-window layers only, "
                    "and a cache group holds both kinds of layers (a window covering "
                    "max_model_len, or the hybrid cache disabled): serving it for text only",
                    self.resolved.source,
                )
                self.inputs.images = None
            self.scheduler.whole_images = mode != "none"
        self.scheduler.copy_blocks = self.runner.copy_blocks
        self.scheduler.whole_prompts = self.encoder  # bidirectional: never in chunks
        self.drafter: DraftModel | None = None
        if draft is not None:
            kind = HiddenDraft if isinstance(draft, HeadLoad) else DraftModel
            self.drafter = kind(
                draft, draft_blocks or num_blocks, self.block_size, self.max_num_batched_tokens
            )
            self.scheduler.on_free = self.drafter.free
            # eagle/mtp draft from the target's hidden states (eagle.py)
            self.runner.keep_hidden = isinstance(draft, HeadLoad)
        self.spec = self._speculation(config, layout)
        self.spec_drafts = 0
        self.spec_draft_tokens = 0
        self.spec_accepted_tokens = 0
        if self.spec is not None:
            self.scheduler.propose = self._propose
        if self.lora is not None:
            self.runner.lora_step = self.lora.step
            if self.ranks is not None:
                self.lora.loads_for_peers = self.runner.lora_loads
        if self.ranks is not None:
            self.ranks.wait_for("ready")
            self.runner.peers = self.ranks
        t_warm = time.perf_counter()
        self.kernel_warmup = self._warm_up_kernels(config)
        t_capture = time.perf_counter()
        self.runner.captured = self._capture_decodes(config)
        if self.drafter is not None and getattr(self.drafter, "method", None) == "eagle3":
            # eagle3 reads three layers' streams through hooks, which a replayed graph skips
            self.runner.captured = None
        self.start_phases["kernel warm-up"] = t_capture - t_warm
        self.start_phases["graph capture"] = time.perf_counter() - t_capture
        self.sampler = Sampler(config.seed, self.device)
        self.beams = BeamSearchRunner(self.scheduler, self.kv, self.runner.copy_blocks, self.inputs)
        self._sampling_cache: dict = {}  # reused per-row sampler tensors between steps
        self.requests: dict[str, Request] = {}
        # Requests that failed alone in a step (their output processing raised): aborted, the
        # others in the step went on. The caller takes them from here after each step.
        self.failed: dict[str, Exception] = {}
        self._bitmask = None
        captured = self.runner.captured
        logger.info(
            "engine ready in %.1fs: model=%s dtype=%s quantization=%s device=%s backend=%s "
            "max_model_len=%d kv_blocks=%d (block_size %d, %d tokens, %s, %d B a token) "
            "cache=%s%s "
            "decode_capture=%s tensor_parallel_size=%d%s",
            time.perf_counter() - t0,
            self.resolved.source,
            str(self.dtype).replace("torch.", ""),
            getattr(self.model, "quantization", "none"),
            self.device,
            self.backend.name,
            self.max_model_len,
            num_blocks,
            self.block_size,
            num_blocks * self.block_size,
            str(self.cache_dtype).replace("torch.", ""),
            self.kv_bytes_per_token,
            layout.describe(),
            self._state_line(loaded),
            "off" if captured is None else f"{captured.mode} ({captured.capture_seconds:.1f}s)",
            self.tp.size,
            self._images_line(config, loaded),
        )

    def _resolve_task(self, config: EngineConfig) -> str:
        """TASK as served: "auto" is "classify" for a classifier checkpoint, else "generate";
        a classifier cannot generate, and classify/score need a head (ConfigError)."""
        labels = getattr(self.model, "num_labels", None)
        task = config.task
        if task == "auto":
            task = "classify" if labels is not None else "generate"
            if labels is None and getattr(self.hf_config, "classifier_from_token", None):
                task = "score"  # vLLM's hf_overrides for a causal LM reranker
        if task == "generate" and labels is not None:
            raise ConfigError(
                f"{self.hf_config.architectures[0]} is a classifier (a score head of {labels} "
                "labels, no LM head): it cannot generate; serve it with TASK=classify or score"
            )
        if task == "classify" and labels is None:
            raise ConfigError(
                "TASK=classify needs a classifier checkpoint (...ForSequenceClassification); "
                "this model has no classifier head"
            )
        if task == "score" and labels not in (None, 1):
            raise ConfigError(
                f"TASK=score needs a one-label head; this classifier has {labels} labels "
                "(serve it with TASK=classify)"
            )
        return task

    def _pooling_head(self, config: EngineConfig):
        """The classifier head classify/score requests read (pooling.py): the checkpoint's own,
        or with TASK=score on a causal LM the yes/no token scorer (Qwen3-Reranker's recipe:
        tokens from hf_overrides' `classifier_from_token` [no, yes], else "no" and "yes")."""
        if getattr(self.model, "num_labels", None) is not None:
            return self.model
        if self.task != "score":
            return None
        if config.tensor_parallel_size > 1:
            raise ConfigError(
                "TASK=score on a causal LM reads two rows of the LM head: tensor_parallel_size "
                "must be 1"
            )
        words = getattr(self.hf_config, "classifier_from_token", None) or ["no", "yes"]
        if len(words) != 2:
            raise ConfigError(f"classifier_from_token must name two tokens [no, yes]: {words}")
        ids = []
        for word in words:
            tid = self.tokenizer.convert_tokens_to_ids(word)
            if tid is None or tid == self.tokenizer.unk_token_id or tid >= self.vocab_size:
                raise ConfigError(f"TASK=score: the tokenizer has no token {word!r}")
            ids.append(int(tid))
        return TokenPairHead(self.model, ids[0], ids[1])

    def _fit_encoder(self, config: EngineConfig) -> None:
        """A bidirectional encoder (models/encoder.py) serves pooling only: TASK auto is embed
        (classify for a cross-encoder, as `_resolve_task` says), generate is refused; CLS
        pooling unless POOLING_TYPE or its sentence-transformers files say otherwise; each
        prompt whole in one step, so the step budget must hold the longest."""
        arch = self.hf_config.architectures[0]
        if config.task == "generate":
            raise ConfigError(
                f"{arch} is an encoder (no LM head): it cannot generate; serve it with "
                "TASK=embed (or auto), or classify/score for a cross-encoder"
            )
        if self.task == "generate":
            self.task = "embed"
        if config.pooling_type is None and self.pooling.pooling_type == "last":
            st_type, _ = sentence_transformers_pooling(self.resolved.model_dir)
            if st_type is None:
                self.pooling = dataclasses.replace(self.pooling, pooling_type="cls")
        if self.max_num_batched_tokens < self.max_model_len:
            raise ConfigError(
                f"max_num_batched_tokens={self.max_num_batched_tokens} is below "
                f"max_model_len={self.max_model_len}: an encoder computes each input in one step"
            )
        self.model.sep_token_id = getattr(self.tokenizer, "sep_token_id", None)

    def _pooling_defaults(self, config: EngineConfig) -> PoolingParams:
        """The model's pooling: the config's, else a sentence-transformers layout's, else
        last-token pooling, normalised (causal embedders: Qwen3-Embedding, e5-mistral)."""
        try:
            st_type, st_norm = sentence_transformers_pooling(self.resolved.model_dir)
        except ValueError as e:
            if config.task == "embed" and config.pooling_type is None:
                raise ConfigError(str(e)) from e
            st_type, st_norm = None, None
        pooling_type = config.pooling_type or st_type or "last"
        normalize = config.normalize
        if normalize is None:
            normalize = st_norm if st_norm is not None else True
        return PoolingParams(pooling_type, normalize)

    def _speculation_off(self, layout, method: str) -> str | None:
        """Why speculative decoding by `method` cannot run with this model and engine (None: it
        can). With tensor parallelism every method proposes on rank 0 (a draft model whole,
        like vLLM's draft_tensor_parallel_size 1; an eagle/mtp head with whole copies of the
        target's embedding and LM head, eagle.vocab_tables; the other ranks verify the drafts'
        rows as any other rows of the step). With recurrent layers every method runs:
        a speculating request's state is copied aside before the step and a partly rejected
        run goes back to it (kv_cache_manager.snapshot_state); a hidden-state head gets the
        kept tokens' rows when they are computed again (eagle.HiddenDraft.observe)."""
        return None

    def _load_draft(self, config: EngineConfig, loaded):
        """The draft model of a `draft_model` speculative config, loaded on the target's device
        with the target's dtype setting and context length (LoadedModel), its vocabulary
        checked against the target's; None without one, or where speculation is off."""
        spec = parse_speculative_config(config.speculative_config)
        if spec is None or spec.method == "ngram":
            return None
        if spec.method == "mtp":
            check_mtp_target(loaded)  # a target without MTP layers is refused at once
        if self._speculation_off(loaded.cache_layout(), spec.method) is not None:
            return None  # _speculation says why
        if spec.method == "mtp":
            return load_mtp(config, loaded)
        if spec.method == "eagle":
            return load_eagle(config, spec, loaded)
        if spec.method == "eagle3":
            return load_eagle3(config, spec, loaded)
        draft_config = dataclasses.replace(
            config,
            model=spec.model,
            revision=spec.revision,
            tokenizer=None,
            tokenizer_revision=None,
            quantization=None,
            hf_overrides=None,
            max_model_len=self.max_model_len,
            num_kv_blocks=None,
            enable_lora=False,
            tensor_parallel_size=1,
            speculative_config=None,
            task="generate",
        )
        try:
            draft = load_model(draft_config)
        except (ConfigError, ModelLoadError) as e:  # the same error, naming the draft
            raise type(e)(f"speculative_config draft model {spec.model!r}: {e}") from e
        try:
            draft_tok = load_tokenizer(
                draft.resolved.tokenizer_dir, trust_remote_code=config.trust_remote_code
            )
        except Exception as e:  # no tokenizer files of its own: the vocabulary size decides
            logger.info("draft model %s: no tokenizer of its own (%s)", spec.model, e)
            draft_tok = None
        check_same_tokenizer(
            self.tokenizer, self.vocab_size, draft_tok, draft.hf_config.vocab_size, spec.model
        )
        if draft.cache_layout().has_state:
            raise ConfigError(
                f"speculative_config draft model {spec.model!r} has recurrent layers: a draft "
                "model here keeps a KV cache only (choose an attention-only draft)"
            )
        return draft

    def _speculation(self, config: EngineConfig, layout):
        """The speculative config to run (speculative.py), or None: off, or on where this slice
        cannot run it (said in the log)."""
        spec = parse_speculative_config(config.speculative_config)
        if spec is None:
            return None
        why = self._speculation_off(layout, spec.method)
        if why is not None:
            logger.warning("speculative decoding off: %s", why)
            return None
        if spec.method != "ngram":
            d = self.drafter
            tokens_mib = self.block_size * self.block_pool.num_blocks / 2**20
            draft_mib = self.block_size * d.num_blocks / 2**20
            logger.info(
                "speculative decoding: %s %s (%.1f MiB of weights), %d tokens a step "
                "(greedy drafts); KV cache split: target %d blocks (%.1f MiB, %d B a token), "
                "draft %d blocks (%.1f MiB, %d B a token)%s",
                spec.method,
                d.source,
                d.loaded.param_bytes / 2**20,
                spec.num_speculative_tokens,
                self.block_pool.num_blocks,
                tokens_mib * self.kv_bytes_per_token,
                self.kv_bytes_per_token,
                d.num_blocks,
                draft_mib * d.kv_bytes_per_token,
                d.kv_bytes_per_token,
                " (num_kv_blocks: each the same count)" if config.num_kv_blocks else "",
            )
            logger.info("speculative decoding: %s", _off_rule(spec))
            return spec
        logger.info(
            "speculative decoding: ngram, %d tokens a step, prompt lookup %d..%d (greedy and "
            "sampled requests; not beam search, images or guided decoding); %s",
            spec.num_speculative_tokens,
            spec.prompt_lookup_min,
            spec.prompt_lookup_max,
            _off_rule(spec),
        )
        return spec

    def _propose(self, req: Request, room: int) -> list[int]:
        """Draft tokens for `req`'s next decode (at most `room`), [] when it does not
        speculate: never past its max_tokens or max_model_len."""
        spec = self.spec
        k = self.draft_room(req, room)
        if k < 1:
            return []
        if self.drafter is not None:
            return self.drafter.take(req, k)
        tokens = req.prompt_token_ids + req.output_token_ids
        return propose_ngram(tokens, spec.prompt_lookup_min, spec.prompt_lookup_max, k)

    def _draft(self) -> None:
        """The draft model's proposals for this step (draft_model.py): for each running
        request whose next grant is a decode, as many drafts as it may verify."""
        room = self.max_num_batched_tokens - len(self.scheduler.running)
        wanted = []
        for req in self.scheduler.running:
            if req.num_tokens - req.num_computed_tokens == 1:
                k = self.draft_room(req, room)
                if k > 0:
                    wanted.append((req, k))
        self.drafter.propose_for(wanted)

    def draft_room(self, req: Request, room: int) -> int:
        """How many drafts `req` may verify this step (0: it decodes one token): at most
        num_speculative_tokens and `room`, never past its max_tokens or max_model_len, and
        none for a request that does not speculate (speculative.can_speculate), in a step with
        more running requests than the config's disable_by_batch_size, or in a backoff after
        poor drafts (speculative.backing_off); one draft for a request probing after a
        backoff (speculative.probe_drafts)."""
        if not can_speculate(req):
            return 0
        off = self.spec.disable_by_batch_size
        if off is not None and len(self.scheduler.running) > off:
            return 0  # a batch this large gains nothing from drafts (speculative.py)
        if backing_off(req):
            return 0  # its recent drafts were mostly rejected (speculative.py)
        n = req.num_tokens
        return min(
            probe_drafts(req, self.spec.num_speculative_tokens),
            room,
            req.max_total_tokens - n - 1,  # the drafts and the model's own next token
            self.max_model_len - n,  # the drafts' positions n .. n + k - 1
        )

    def _images_line(self, config: EngineConfig, loaded) -> str:
        """The start-up line's image side: the vision family, its tower's size (on every rank)
        and the encoder cache's ('' for a model that takes no images)."""
        if self.vision is None:
            return ""
        if self.inputs.images is None:  # served for text (the warning above says why)
            return " images=off (no image processor)"
        family = type(self.vision.family).__name__.removesuffix("Family")
        return (
            f" images={family.removesuffix('Vision')} (tower "
            f"{self.vision.tower_bytes() / 2**20:.1f} MiB, encoder cache "
            f"{encoder_cache_bytes(config, loaded) / 2**20:.1f} MiB)"
        )

    def _state_line(self, loaded) -> str:
        """The start-up line's state slots: how many requests' recurrent states fit, and their
        size ('' for a model without recurrent layers)."""
        if self.state_pool is None:
            return ""
        mib = loaded.state_slot_bytes() / 2**20
        return f"; state_slots={self.state_pool.num_slots - 1} ({mib:.2f} MiB a request)"

    def close(self) -> None:
        """Stops the other tensor-parallel ranks and leaves the group (nothing to do without
        tensor parallelism); the engine cannot step afterwards."""
        if self.ranks is not None:
            self.ranks.close()
            if self.ranks.failed is None:
                self.ranks.failed = TensorParallelError("the engine is closed")
        self.tp.leave()

    def rank_state(self) -> list[dict]:
        """Each tensor-parallel rank's state (one entry, rank 0, without tensor parallelism)."""
        me = {
            "rank": 0,
            "alive": self.ranks is None or self.ranks.failed is None,
            "device": str(self.device),
            "param_bytes": self.param_bytes,
            "load_window": self._load_window,
        }
        return [me] + ([] if self.ranks is None else self.ranks.state())

    def _warm_up_kernels(self, config: EngineConfig):
        """Lists and compiles the model's Triton kernels before the first request (on CUDA with
        the Triton backend, unless kernel_warmup is off); a warm-up that fails only logs why,
        and the kernels compile at their first launch as before."""
        if not config.kernel_warmup or self.device.type != "cuda" or self.backend.name != "triton":
            return None
        if self.ranks is not None:
            logger.info("kernel warm-up off: tensor parallelism (each rank compiles at first use)")
            return None
        from .kernel_warmup import SweepLimits, warm_up, watch_request_path

        limits = SweepLimits(self.max_num_batched_tokens, config.max_num_seqs, self.max_model_len,
                             whole_prompts=self.encoder)  # fmt: skip
        try:
            result = warm_up(self.runner, limits, self.inputs.images)  # its tower's too
        except Exception as e:  # noqa: BLE001 - never fail a start over an optimisation
            logger.warning("kernel warm-up failed, kernels compile at first use: %r", e)
            return None
        logger.info("kernel warm-up: %s", result.describe())
        watch_request_path()
        return result

    def _capture_decodes(self, config: EngineConfig) -> CapturedDecode | None:
        """Captured decode steps (decode_capture.py): CUDA graphs on CUDA unless enforce_eager;
        the eager-replay twin when asked for; None when off or when capture failed its
        self-check (then every step runs eagerly, and the warning says why)."""
        if self.encoder:  # an encoder has no decode step to capture
            return None
        mode = config.decode_capture
        if mode == "auto":
            mode = "cuda" if self.device.type == "cuda" and not config.enforce_eager else "off"
        elif mode == "replay" and config.enforce_eager:
            mode = "off"
        if mode == "off":
            return None
        if self.ranks is not None:
            # A captured step would run on rank 0 alone; the other ranks replay nothing.
            logger.info("decode capture off: tensor parallelism runs every step eagerly")
            return None
        if self.lora is not None:
            # The adapters' rows change every step (host-side groups), which a graph cannot hold.
            logger.info("decode capture off: LoRA is enabled")
            return None
        if mode == "cuda" and self.backend.name != "triton":
            # The torch backend syncs with the host inside a step (its KV write index, its
            # gather sizes), which a graph cannot hold.
            logger.info("decode capture off: it needs the triton attention backend")
            return None
        captured = CapturedDecode(
            self.model,
            self.kv_caches,
            self.backend,
            self.block_size,
            self.device,
            max_num_seqs=config.max_num_seqs,
            max_seq_len=min(config.max_seq_len_to_capture, self.max_model_len),
            mode=mode,
            layout=self.cache_layout,
            verify_rows=verify_rows(self.spec),
        )
        return captured if captured.capture() else None

    # -- requests ---------------------------------------------------------------------------

    @property
    def eos_token_ids(self) -> set[int]:
        """Every id that ends generation (kept by the input processor, which masks them)."""
        return self.inputs.eos_token_ids

    @eos_token_ids.setter
    def eos_token_ids(self, ids: set[int]) -> None:
        self.inputs.eos_token_ids = ids

    @property
    def grammar_compiler(self):
        return self.inputs.grammar_compiler

    def tokenize_prompt(self, prompt: str | list[int]) -> PromptInput:
        return self.inputs.tokenize_prompt(prompt)

    def add(self, req: Request) -> None:
        if req.request_id in self.requests:
            raise InvalidRequestError(f"request id {req.request_id!r} is already in use")
        self.requests[req.request_id] = req
        req.times.arrival = time.monotonic()
        if req.params.use_beam_search:
            self.beams.start(req)
        else:
            self.scheduler.add(req)

    def add_request(
        self,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
        lora_request: LoRARequest | None = None,
        priority: int = 0,
    ) -> Request:
        params = params or SamplingParams()
        self.check_generates()
        self.check_priority(priority)
        prepared = self.prepare(prompt, params, lora_request)
        req = self.inputs.build_request(prepared, params, request_id)
        req.priority = priority
        self.add(req)
        return req

    def build_embed_request(
        self, prepared, request_id: str, dimensions: int | None = None, task: str = "embed"
    ) -> Request:
        """A pooling request for a prompt prepared with `embed_params()`: the model's pooling,
        `dimensions` (Matryoshka truncation before the normalisation) its own. `task`:
        "embed" (any model, next to generation on a generating one), "classify" (a model with
        a classifier head), "score" (a one-label head: the prompt is `score_prompt`'s pair)."""
        self.check_pooling_task(task)
        if dimensions is not None and task != "embed":
            raise InvalidRequestError("dimensions applies to embeddings only", "dimensions")
        if dimensions is not None:
            hidden = self.hf_config.hidden_size
            if isinstance(dimensions, bool) or not isinstance(dimensions, int) or dimensions < 1:
                raise InvalidRequestError(
                    f"dimensions must be an integer >= 1, got {dimensions!r}", "dimensions"
                )
            if dimensions > hidden:
                raise InvalidRequestError(
                    f"dimensions={dimensions} is larger than the model's {hidden}", "dimensions"
                )
        req = self.inputs.build_request(prepared, embed_params(prepared.truncate), request_id)
        params = dataclasses.replace(self.pooling, task=task, dimensions=dimensions)
        if task != "embed":  # the classifier head reads its own row
            params = dataclasses.replace(params, pooling_type=self.pooling_head.classifier_pooling)
        reuse = params.pooling_type == "last" and not getattr(self, "encoder", False)
        req.pooling = dataclasses.replace(params, reuse_prefix=reuse)
        return req

    def check_pooling_task(self, task: str) -> None:
        """InvalidRequestError unless this model can serve pooling `task`."""
        head = self.pooling_head
        if task == "embed":
            return
        if task not in ("classify", "score"):
            raise InvalidRequestError(f"unknown pooling task {task!r}")
        if head is None:
            raise InvalidRequestError(
                f"this model has no classifier head (TASK={self.task}): {task} needs a "
                "...ForSequenceClassification checkpoint"
                + (", or a causal LM reranker served with TASK=score" if task == "score" else "")
            )
        if task == "score" and head.num_labels != 1:
            raise InvalidRequestError(
                f"score needs a one-label head; this classifier has {head.num_labels} labels "
                "(use classify)"
            )

    @property
    def labels(self) -> list[str]:
        """The classifier head's label names (the config's id2label, else LABEL_i)."""
        head = self.pooling_head
        n = head.num_labels if head is not None else 0
        names = getattr(self.hf_config, "id2label", None) or {}
        return [str(names.get(i, names.get(str(i), f"LABEL_{i}"))) for i in range(n)]

    def score_prompt(self, text_1: str, text_2: str, instruction: str | None = None) -> list[int]:
        """The token ids of one (query, document) pair for a score request: a causal LM
        scorer's published reranker prompt (`reranker_prompt_ids`, `instruction` its task
        line), else the tokenizer's own pair encoding (a cross-encoder's [CLS] q [SEP] d)."""
        if isinstance(self.pooling_head, TokenPairHead):
            return reranker_prompt_ids(self.tokenizer, text_1, text_2, instruction)
        if instruction is not None:
            text_1 = instructed_text(text_1, instruction)
        return list(self.tokenizer(text_1, text_2)["input_ids"])

    def add_embed_request(
        self,
        prompt: str | list[int],
        request_id: str,
        dimensions: int | None = None,
        truncate_prompt_tokens: int | None = None,
    ) -> Request:
        params = embed_params(truncate_prompt_tokens)
        prepared = self.inputs.prepare(prompt, params)
        req = self.build_embed_request(prepared, request_id, dimensions)
        self.add(req)
        return req

    def check_generates(self) -> None:
        """InvalidRequestError unless this engine serves generation (TASK=embed, classify and
        score do not)."""
        if self.task != "generate":
            route = "/v1/embeddings" if self.task == "embed" else f"/{self.task}"
            other = (
                "(an encoder: it cannot generate)"
                if self.encoder
                else "or restart with TASK=generate"
            )
            raise InvalidRequestError(
                f"this model is served for {self.task} (TASK={self.task}): generation is off; "
                f"use {route}, {other}"
            )

    def check_priority(self, priority: int) -> None:
        """InvalidRequestError naming `priority` unless this engine can honour it: an integer,
        and not 0 only under the priority scheduling policy."""
        if isinstance(priority, bool) or not isinstance(priority, int):
            raise InvalidRequestError(
                f"priority must be an integer, got {type(priority).__name__}", "priority"
            )
        if priority != 0 and self.config.scheduling_policy != "priority":
            raise InvalidRequestError(
                f"priority={priority}: request priorities are served only under the priority "
                "scheduling policy (scheduling_policy='priority', SCHEDULING_POLICY=priority on "
                "the worker); this engine schedules first come, first served",
                "priority",
            )

    def prepare(
        self,
        prompt: str | list[int] | PreparedPrompt,
        params: SamplingParams,
        lora_request: LoRARequest | None = None,
    ) -> PreparedPrompt:
        """A prompt validated once for requests with `params` (input_processor.prepare), with
        its adapter read (LoRAError, a bad request, if it cannot be) and its grammar compiled.
        Blocking: the offline path's (the async engine compiles off the event loop)."""
        prepared = self.inputs.prepare(prompt, params)
        if params.structured is not None and prepared.grammar is None:
            grammar = self.inputs.compile_grammar(params.structured).result()
            prepared = dataclasses.replace(prepared, grammar=grammar)
        return self.with_adapter(prepared, lora_request)

    def with_adapter(
        self, prepared: PreparedPrompt, lora_request: LoRARequest | None
    ) -> PreparedPrompt:
        """`prepared` with its adapter, read now unless it has it."""
        if lora_request is None or prepared.lora == lora_request:
            return prepared
        if self.lora is None:
            raise InvalidRequestError(
                f"adapter {lora_request.lora_name!r} asked for, but LoRA is not enabled "
                "(enable_lora / ENABLE_LORA)",
                param="model",
            )
        adapter = self.lora.get(lora_request)
        return dataclasses.replace(prepared, lora=lora_request, adapter=adapter)

    def abort_request(self, request_id: str) -> EngineOutput | None:
        """Stops a request and frees its blocks now. Unknown or finished ids are ignored."""
        req = self.requests.pop(request_id, None)
        if req is None:
            return None
        if req.beam is None:
            self.scheduler.finish(req, FinishReason.ABORT)
        else:
            self.beams.abort(req.beam)
        if self._retiring_loras:
            self._drop_retired_loras()
        return make_output(req, [], "")

    def remove_lora(self, lora_int_id: int) -> None:
        """Forgets adapter `lora_int_id` once the requests using it have finished (now, when
        none does); until then they run with it as before. Naming it again reads it anew."""
        if self.lora is None:
            return
        self._retiring_loras.add(lora_int_id)
        self._drop_retired_loras()

    def _drop_retired_loras(self) -> None:
        in_use = {req.lora_id for req in self.requests.values()}
        for lid in self._retiring_loras - in_use:
            self.lora.remove(lid)
            self._retiring_loras.discard(lid)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished

    def stats(self) -> EngineStats:
        pool = self.block_pool
        return EngineStats(
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            num_requests=len(self.requests),
            num_kv_blocks=pool.num_blocks,
            num_free_kv_blocks=pool.num_free,
            num_preemptions=self.scheduler.num_preemptions,
            prefix_cache_queries=pool.queries,
            prefix_cache_hits=pool.hits,
            speculative=self.spec is not None,
            spec_drafts=self.spec_drafts,
            spec_draft_tokens=self.spec_draft_tokens,
            spec_accepted_tokens=self.spec_accepted_tokens,
            ranks=self.rank_state() if self.ranks is not None else [],
        )

    # -- one step ---------------------------------------------------------------------------

    def step(self) -> list[EngineOutput]:
        if self.ranks is not None and self.ranks.failed is not None:
            raise self.ranks.failed
        if self._threads is not None:
            self._threads.update()
        if self.drafter is not None:
            self._draft()
        batch = self.scheduler.schedule()
        if not batch.requests and self.beams.drop_waiting_blocks():
            batch = self.scheduler.schedule()
        if not batch.requests:
            if self.scheduler.has_unfinished:
                # Nothing fits (only possible if a single request outgrew the cache).
                raise RuntimeError("scheduler made no progress: the KV cache is too small")
            return []
        if self.lora is not None:
            loras = [r.lora_adapter for r in batch.requests if r.lora_adapter is not None]
            self.runner.lora_slots = self.lora.prepare(loras) if loras else {}
        if self.ranks is None:
            sample_reqs, logits = self.runner.execute(batch)
        else:
            try:
                sample_reqs, logits = self.runner.execute(batch)
            except Exception as e:  # the ranks are out of step now: the engine cannot go on
                raise self.ranks.failure(e) from e
        sampled: list[Sampled] = []
        beams: list[tuple[Request, object]] = []
        if sample_reqs:
            sb = SamplingBatch.build(
                sample_reqs, self.vocab_size, self.device, cache=self._sampling_cache
            )
            self._fill_grammar_masks(sample_reqs, sb)
            out = self.sampler(logits, sb)
            logprobs = out.logprobs or [None] * len(sample_reqs)
            for req, tok, lp in zip(sample_reqs, out.token_ids, logprobs):
                if req.beam is not None:
                    beams.append((req, lp))
                else:
                    sampled.append(Sampled(req, [tok], [lp]))
        pooled = self.runner.pooled
        if self.runner.verified:
            sampled.extend(self._verify(batch))
        updates = self.scheduler.update(batch, sampled, process_token)
        if self.runner.keep_hidden:  # after the update: only kept tokens' hidden states
            self.drafter.observe(self.runner)
        outputs = []
        now = time.monotonic()
        for req in batch.requests:
            if req.times.scheduled is None:
                req.times.scheduled = now
        for up in updates:
            req = up.request
            if up.error is not None:
                self._fail_request(req, up.error)
                continue
            if req.finished:
                self.requests.pop(req.request_id, None)
            if up.token_ids:
                req.times.mark_tokens(now)
            outputs.append(make_output(req, up.token_ids, up.text, up.logprobs or None))
        for req in pooled:  # prompt computed: the request ends, its blocks freed at once
            self.scheduler.finish(req, FinishReason.STOP)
            self.requests.pop(req.request_id, None)
            outputs.append(embedding_output(req))
        for req, lp in beams:
            try:
                out = self.beams.on_top_tokens(req, lp)
            except Exception as exc:  # this search's own fault: it fails, the others go on
                self._fail_request(req, exc)
                continue
            if out is not None:
                self.requests.pop(out.request_id, None)
                outputs.append(out)
        self.beams.end_step()
        if self._retiring_loras:
            self._drop_retired_loras()
        return outputs

    def _verify(self, batch) -> list[Sampled]:
        """The outcome of the step's verified drafts: plain-argmax requests keep the drafts
        matching the argmax (accept_greedy), the others go through rejection sampling with
        their own sampling parameters (sampling/verify.py); rejected drafts' KV rolls back."""
        out: list[Sampled] = []
        runs: list[DraftRun] = []
        rows: list[int] = []
        first = 0
        for req, targets in self.runner.verified:
            drafts = batch.drafts[req.request_id]
            if plain_argmax(req):
                out.append(self._verified(req, drafts, accept_greedy(drafts, targets), None))
            else:
                runs.append(DraftRun(req, drafts))
                rows.extend(range(first, first + len(targets)))
            first += len(targets)
        if runs:
            logits = self.runner.verify_logits
            if len(rows) < logits.shape[0]:
                logits = logits.index_select(0, torch.tensor(rows, device=logits.device))
            kept = verify_sampled(self.sampler, logits, runs, self.vocab_size, self.device)
            for run, (tokens, lps) in zip(runs, kept):
                out.append(self._verified(run.request, run.drafts, tokens, lps))
        return out

    def _verified(self, req: Request, drafts: list[int], tokens: list[int], lps) -> Sampled:
        self.spec_drafts += 1
        self.spec_draft_tokens += len(drafts)
        self.spec_accepted_tokens += len(tokens) - 1
        note_verified(req, len(drafts), len(tokens) - 1)
        return Sampled(req, tokens, lps, rollback=len(drafts) + 1 - len(tokens))

    def _fail_request(self, req: Request, exc: Exception) -> None:
        """Aborts the request that `req` serves (a beam search as a whole) and records why."""
        rid = req.beam.root.request_id if req.beam is not None else req.request_id
        logger.exception(
            "request %s failed in output processing; the others go on", rid, exc_info=exc
        )
        self.abort_request(rid)  # a no-op if it had already finished
        self.failed[rid] = exc

    def _fill_grammar_masks(self, reqs: list[Request], sb: SamplingBatch) -> None:
        rows = [i for i, r in enumerate(reqs) if r.grammar is not None and r.grammar_open]
        if not rows:
            return
        need = max(len(reqs), self.config.max_num_seqs)
        if self._bitmask is None or self._bitmask.shape[0] < need:
            self._bitmask = allocate_bitmask(need, self.vocab_size)
        fill_bitmasks([reqs[i].grammar for i in rows], self._bitmask, rows)
        sb.set_grammar(self._bitmask, rows)


def _off_rule(spec) -> str:
    """The start-up line's words for the speculative config's batch-size rule."""
    if spec.disable_by_batch_size is None:
        return "at every batch size (disable_by_batch_size null)"
    return f"off in steps of more than {spec.disable_by_batch_size} running requests"
