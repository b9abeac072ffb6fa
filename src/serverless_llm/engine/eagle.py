"""Speculative decoding's proposers that draft from the target's hidden states: `eagle` (an
EAGLE-1 head, its own small checkpoint), `eagle3` (an EAGLE-3 head: `load_eagle3`, `AuxTap`) and
`mtp` (the multi-token-prediction layer a DeepSeek-V3 style checkpoint ships beside its decoder
layers).

Both are one decoder layer over a fused input: the row at position p fuses the embedding of token
p + 1 (the target's embedding table, shared) with the target's final hidden state at p (what its
LM head reads: after the final norm, as EAGLE's published code and vLLM take it), and its output
scores token p + 2:

- eagle (EAGLE-1, e.g. yuhuili/EAGLE-LLaMA3-Instruct-8B): `fc` Linear(2h -> h, with a bias in
  some checkpoints) over concat(embedding, hidden), one Llama decoder layer without its
  input_layernorm (the published heads drop it), no final norm; the target's LM head reads the
  layer's output directly.
- mtp (DeepSeek V3, GLM-4.5): the embedding zeroed at position 0, `eh_proj` Linear(2h -> h) over
  concat(enorm(embedding), hnorm(hidden)), one decoder block of the model's own kind (layer N of
  `model.layers.N.`, N = num_hidden_layers: MLA and MoE for DeepSeek V3), then
  `shared_head.norm` and `shared_head.head` (or the target's head when the checkpoint has none).
- mtp (Qwen3-Next, Qwen3.5: `mtp.`): `fc` Linear(2h -> h) over concat(pre_fc_norm_embedding(
  embedding), pre_fc_norm_hidden(hidden)) (no zeroed position 0), `layers.0` (a full-attention
  layer of the model's own kind), `norm`, the target's LM head; the normed output is also what
  the next draft step fuses (`DraftHead.qwen`). Every norm is zero-centred (1 + w).
- mtp (MiMo: `model.mtp_layers.0.`): the embedding zeroed at position 0 (as vLLM and SGLang
  run it), `input_proj` Linear(2h -> h) over concat(hidden_layernorm(hidden),
  token_layernorm(embedding)) (the hidden state first: the reverse of DeepSeek's order), one
  Qwen2 decoder block (input_layernorm, self_attn with q/k/v bias, post_attention_layernorm,
  mlp), `final_layernorm`, the target's LM head; the normed output is what the next draft step
  fuses, as Qwen3-Next's (`DraftHead.mimo`).

EAGLE-3 reads the residual streams entering three target layers instead (fc over their concat,
3h -> h), attends over [input_layernorm(embedding), hidden_norm(hidden)] (2h wide) with the
hidden state as residual, and scores a reduced vocabulary mapped to the target's ids (`d2t`).

Drafting k tokens: the first pass feeds the rows the target computed since the last drafting and
takes the argmax at the last one (position n - 2, token n - 1: draft 1); each further pass feeds
one row: the previous draft and the layer's own output at the previous row as its hidden state
(EAGLE's and DeepSeek's recurrence).

The head keeps its own paged KV cache for its one layer, split from the target's budget like
draft_model's (`DraftModel`, whose pool, block manager, runner and free/take it reuses). Its
entries follow the target lazily (`Track`): after each target step (`observe`) the rows of the
tokens it kept (prompt chunks, decodes, the accepted part of a verification) wait in the track;
the next drafting feeds them, rolling the draft cache back first to the last entry made from the
target's own hidden state (draft rows are made from the head's own outputs, so even an accepted
draft's entry is fed again from the target's row). The last fed row is kept and fed again next
time (its output gives draft 1 when nothing new came). A request whose target prefix came from the
prefix cache (or that lost its draft blocks) has no hidden states before some position: its
track starts there (`base`, cache index = position - base), the head then attends to the tokens
from there on only (rotary positions stay absolute). That costs acceptance, never correctness:
the target verifies every draft.

On a model with recurrent layers a partly rejected verification sends the request back to the
state copied before the step (kv_cache_manager.snapshot_state): no row of that step is kept
(`observe` keeps only rows below num_computed_tokens), and the kept tokens come again as a chunk
in the next step, whose rows continue the track; the head's draft entries past the track are
rolled back at its next feeding, as always.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .config import ConfigError, EngineConfig
from .draft_model import DraftModel, draft_batch
from .layers.norm import RMSNorm
from .layers.rotary import rotary_step
from .loader import ModelLoadError, iter_weights, load_hf_config, resolve_model
from .model_builder import LoadedModel, make_attention_backend
from .model_runner import ModelRunner
from .models import DecoderModel, DecoderSpec, describe_model
from .request import Request

logger = logging.getLogger(__name__)

# Architectures a published EAGLE-1 head's config.json names (its layer is Llama's).
EAGLE_ARCHS = ("LlamaForCausalLM", "EagleLlamaForCausalLM")
# ... and an EAGLE-3 head's (yuhuili/EAGLE3-LLaMA3.1-Instruct-8B: LlamaForCausalLMEagle3).
EAGLE3_ARCHS = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM")
# Targets whose MTP layers are stored DeepSeek-V3's way (`model.layers.<num_hidden_layers>.`).
MTP_ARCHS = ("DeepseekV3ForCausalLM", "Glm4MoeForCausalLM")
# ... and Qwen3-Next's way (`mtp.`: pre_fc_norm_embedding, pre_fc_norm_hidden, fc, layers.0, norm).
QWEN_MTP_ARCHS = ("Qwen3NextForCausalLM", "Qwen3_5ForCausalLM", "Qwen3_5MoeForCausalLM")
# ... and MiMo's (`model.mtp_layers.<i>.`: token_layernorm, hidden_layernorm, input_proj, a Qwen2
# decoder block, final_layernorm).
MIMO_MTP_ARCHS = ("MiMoForCausalLM",)
# Per-layer fields of a DecoderSpec (tuples over its layers).
_PER_LAYER = (
    "windows",
    "chunks",
    "qk_norm_layers",
    "layer_heads",
    "k_eq_v",
    "kv_source",
    "mlp_sizes",
    "rope",
    "moe_layers",
    "mixers",
    "mlp_layers",
)


class DraftCore(DecoderModel):
    """The head's decoder layer as a one-layer DecoderModel whose "embedding" is the fused input
    set in `fused` before each call (no vocabulary of its own: the target's is used)."""

    fused: torch.Tensor | None = None

    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.fused

    def _complete(self, pname, param, loaded) -> bool:
        return pname == "embed_tokens.weight" or super()._complete(pname, param, loaded)


class AuxTap:
    """EAGLE-3's input: the residual stream entering each of the target's `layers` (the output
    of the layer before), caught by forward pre-hooks in every eager forward of the target
    (decode capture is off with eagle3: a replayed graph runs no hook)."""

    def __init__(self, target: DecoderModel, layers: tuple[int, ...]):
        self.layers = layers
        self.rows: dict[int, torch.Tensor] = {}
        for i in sorted(set(layers)):
            target.layers[i].register_forward_pre_hook(self._hook(i))

    def _hook(self, i: int):
        def take(module, args):
            x, residual = args[0], args[1]
            self.rows[i] = x if residual is None else x + residual

        return take

    def take(self) -> torch.Tensor | None:
        """The last forward's [T, 3 * hidden] rows (low, mid, high), forgotten here."""
        if len(self.rows) < len(set(self.layers)):
            return None
        out = torch.cat([self.rows[i] for i in self.layers], dim=-1)
        self.rows = {}
        return out


class DraftHead(nn.Module):
    """The input fusion around the core and the output's logits (`method` eagle, eagle3 or
    mtp)."""

    def __init__(
        self,
        method: str,
        core: DraftCore,
        target: DecoderModel,
        fc_bias: bool,
        qwen: bool = False,
        mimo: bool = False,
    ):
        super().__init__()
        h = target.full_spec.hidden_size
        eps = target.full_spec.norm.eps
        self.method = method
        # mtp stored Qwen3-Next's way: no zeroed embedding at position 0, and the layer's output
        # normed (mtp.norm) before the LM head and before the next draft step fuses it
        self.qwen = qwen
        # mtp stored MiMo's way: position 0 zeroed as DeepSeek's, the hidden state first in the
        # concat, and the output normed (final_layernorm) as Qwen3-Next's
        self.mimo = mimo
        self.normed_out = qwen or mimo
        self.core = core
        self._target = [target]  # not a submodule: its weights are the target's
        self.tap: AuxTap | None = None  # eagle3's
        self.d2t: torch.Tensor | None = None  # eagle3's draft id -> target id offsets
        if method == "eagle":
            self.fc = nn.Linear(2 * h, h, bias=fc_bias)
        elif method == "eagle3":
            uk = target.use_kernels
            self.fc = nn.Linear(3 * h, h, bias=False)
            self.hidden_norm = RMSNorm(h, core.spec.norm.eps, uk)
            self.norm = RMSNorm(h, core.spec.norm.eps, uk)
        else:
            uk = target.use_kernels
            self.enorm = RMSNorm(h, eps, uk)
            self.hnorm = RMSNorm(h, eps, uk)
            self.eh_proj = nn.Linear(2 * h, h, bias=False)
            self.head_norm = RMSNorm(h, eps, uk)
        self.head: nn.Linear | None = None  # mtp's own shared_head.head, when it has one
        # With tensor parallelism the target's ranks hold its embedding and LM head in vocab
        # shares: the head (on rank 0 alone) reads whole copies of both (`vocab_tables`).
        self.vocab: tuple[torch.Tensor, torch.Tensor] | None = None

    @property
    def target(self) -> DecoderModel:
        return self._target[0]

    def forward(self, ids, positions, kv_caches, meta, hidden: torch.Tensor) -> torch.Tensor:
        """The layer's output [T, h] for rows (token ids, positions, the hidden state each row
        fuses: the target's or the head's own previous output)."""
        target = self.target
        e = target._embed(ids) if self.vocab is None else F.embedding(ids, self.vocab[0])
        if target.spec.embed_scale is not None:
            e = e * torch.tensor(target.spec.embed_scale, dtype=e.dtype)
        hidden = hidden.to(e.dtype)
        if self.method == "eagle3":
            return self._eagle3(e, positions, kv_caches, meta, hidden)
        if self.method == "eagle":
            x = self.fc(torch.cat([e, hidden], dim=-1))
        else:
            if not self.qwen:
                e = e.masked_fill((positions == 0).unsqueeze(-1), 0.0)  # DeepSeek's MTP does
            parts = [self.enorm(e), self.hnorm(hidden)]
            x = self.eh_proj(torch.cat(parts[::-1] if self.mimo else parts, dim=-1))
        self.core.fused = x
        try:
            out = self.core(ids, positions, kv_caches, meta)
        finally:
            self.core.fused = None
        return self.head_norm(out) if self.normed_out else out

    def _eagle3(self, e, positions, kv_caches, meta, hidden) -> torch.Tensor:
        """EAGLE-3's midlayer: attention over [input_layernorm(embedding), hidden_norm(hidden)]
        (2h wide), the hidden state as the residual, the MLP; returns the stream before the
        final norm (what the next draft step fuses; `logits` norms it)."""
        core = self.core
        layer = core.layers[0]
        r = core.rope_specs[0]
        gather = r.is_neox and r.rot_dim == core.spec.head_dim and not core.native_rotary
        rope = rotary_step(core.rope_caches[0], positions, e.dtype, core.use_kernels, gather)
        meta = meta[0] if isinstance(meta, list) else meta
        x = torch.cat([layer.in_norm(e), self.hidden_norm(hidden)], dim=-1)
        a = layer.self_attn(x, rope, kv_caches[0], meta)
        x, residual = layer.mlp_norm(a, hidden)
        return layer.mlp(x) + residual

    def target_rows(self, runner: ModelRunner) -> torch.Tensor | None:
        """The rows of the target's last step this head drafts from: its final hidden states,
        or (eagle3) its three layers' streams."""
        if self.tap is not None:
            runner.hidden = None
            return self.tap.take()
        hidden, runner.hidden = runner.hidden, None
        return hidden

    def project(self, rows: torch.Tensor) -> torch.Tensor:
        """Target rows as the layer's hidden input: eagle3's fc over its three streams."""
        return self.fc(rows.to(self.fc.weight.dtype)) if self.method == "eagle3" else rows

    def logits(self, out: torch.Tensor) -> torch.Tensor:
        if self.method == "eagle":
            return self.target_logits(out)
        if self.method == "eagle3":
            return self.head(self.norm(out))
        x = out if self.normed_out else self.head_norm(out)
        return self.head(x) if self.head is not None else self.target_logits(x)

    def target_logits(self, x: torch.Tensor) -> torch.Tensor:
        """The target's LM head over `x` (its whole copy with tensor parallelism)."""
        if self.vocab is None:
            return self.target.compute_logits(x)
        s = self.target.full_spec
        logits = F.linear(x, self.vocab[1])
        if s.logit_scale != 1.0:
            logits = logits * s.logit_scale
        if s.final_softcap is not None:
            logits = torch.tanh(logits / s.final_softcap) * s.final_softcap
        return logits

    def propose(self, out: torch.Tensor) -> list[int]:
        """The greedy draft of each row: the argmax, mapped to the target's ids (eagle3's
        reduced vocabulary: id + d2t[id])."""
        ids = self.logits(out).argmax(dim=-1)
        if self.d2t is not None:
            ids = ids + self.d2t[ids]
        return ids.tolist()


@dataclass
class HeadLoad:
    """A loaded head: its core as a LoadedModel (cache layout, KV bytes, allocation), the head
    module, and what the start-up line says."""

    method: str
    loaded: LoadedModel
    head: DraftHead
    source: str

    def kv_bytes_per_token(self) -> int:
        return self.loaded.kv_bytes_per_token()


@dataclass
class Track:
    """One request's draft cache: positions `base` .. `done` - 1 hold entries fed from the
    target's hidden states (cache index = position - base); `rows` are the target's hidden
    states at positions `done`, `done` + 1, ... not fed yet."""

    base: int
    done: int
    rows: torch.Tensor


def may_track(req: Request) -> bool:
    """Whether `req` may ever speculate (speculative.can_speculate, a grammar waiting for
    `structured_after` included): its hidden states are kept for the head."""
    if req.sampling is None or req.beam is not None or req.mm is not None:
        return False
    return getattr(req, "pooling", None) is None


class HiddenDraft(DraftModel):
    """Drafts for every requesting request in one batch (`propose_for`) from the target's hidden
    states, which `observe` takes after each step; `take`, `free` and `check` are
    DraftModel's (`fed` holds Tracks here)."""

    def __init__(self, load: HeadLoad, num_blocks: int, block_size: int, max_step_tokens: int):
        super().__init__(load.loaded, num_blocks, block_size, max_step_tokens)
        self.source = load.source
        self.method = load.method
        self.head = load.head

    # -- the target's side ----------------------------------------------------------------------

    def observe(self, runner: ModelRunner) -> None:
        """Keeps the hidden states of the tokens the last step computed and kept (after its
        update: a verification's rejected rows are not kept) for each request that may
        speculate; a request whose rows do not continue its track starts a new one there."""
        hidden = self.head.target_rows(runner)
        if hidden is None:
            return
        idx: list[int] = []
        kept: list[tuple[Request, int, int]] = []
        for req, first, start, n in runner.hidden_spans:
            if req.finished or not may_track(req):
                continue
            valid = min(n, req.num_computed_tokens - start)
            if valid < 1:
                continue
            idx.extend(range(first, first + valid))
            kept.append((req, start, valid))
        runner.hidden_spans = []
        if not kept:
            return
        rows = hidden.index_select(0, torch.tensor(idx, dtype=torch.int64, device=hidden.device))
        rows = self.head.project(rows)
        at = 0
        for req, start, valid in kept:
            part = rows[at : at + valid]
            at += valid
            t = self.fed.get(req)
            if t is not None and t.done + t.rows.shape[0] == start:
                t.rows = torch.cat([t.rows, part])
                continue
            if t is not None:  # a gap (it should not happen): start again from here
                self.free(req)
            self.fed[req] = Track(start, start, part)

    # -- drafting -------------------------------------------------------------------------------

    @torch.inference_mode()
    def propose_for(self, wanted: list[tuple[Request, int]]) -> None:
        """Feeds every track's waiting rows, and drafts up to k tokens for each (request, k) of
        `wanted` whose track reaches its last computed token, all in one batch per pass."""
        self.proposals.clear()
        want = dict(wanted)
        feeds: list[tuple[Request, Track, int]] = []  # (request, track, k drafting or 0)
        for req, t in list(self.fed.items()):
            m = t.rows.shape[0]
            end = t.done + m  # entries done .. end - 1 are fed now
            k = want.get(req, 0)
            if end != req.num_tokens - 1:
                k = 0  # not caught up (a prompt still in chunks)
            if k == 0 and m <= 1:
                continue  # nothing new: its last row waits for the next drafting
            held, _ = self.kv.rollback(req, t.done - t.base)
            last = end - 1 + max(k - 1, 0)  # draft entries after the target's
            if held < t.done - t.base or not self.kv.allocate(req, held, last + 1 - t.base):
                self.free(req)  # no room: no drafts; a new track starts at its next rows
                continue
            feeds.append((req, t, k))
        if not feeds:
            return
        rows = []
        for req, t, _ in feeds:
            end = t.done + t.rows.shape[0]
            rows.append((req, t, t.done, req.token_slice(t.done + 1, end + 1), t.rows))
        outs = self._run(rows)
        step: list[tuple[Request, Track, int]] = []
        last_out: dict[Request, torch.Tensor] = {}
        for (req, t, k), out in zip(feeds, outs):
            end = t.done + t.rows.shape[0]
            t.done, t.rows = end - 1, t.rows[-1:]  # the last row is fed again next time
            if k > 0:
                step.append((req, t, k))
                last_out[req] = out[-1:]
        if not step:
            return
        drafts = self._argmax([last_out[req] for req, _, _ in step])
        got = {req: [tok] for (req, _, _), tok in zip(step, drafts)}
        for j in range(1, max(k for _, _, k in step)):
            step = [(req, t, k) for req, t, k in step if k > j]
            if not step:
                break
            rows = [(req, t, t.done + j, [got[req][-1]], last_out[req]) for req, t, _ in step]
            outs = self._run(rows)
            for (req, _, _), out in zip(step, outs):
                last_out[req] = out
            for (req, _, _), tok in zip(step, self._argmax(outs)):
                got[req].append(tok)
        self.proposals.update(got)

    def _argmax(self, outs: list[torch.Tensor]) -> list[int]:
        return self.head.propose(torch.cat(outs))

    def _run(self, rows) -> list[torch.Tensor]:
        """One pass of the head over `rows` (request, track, first position, tokens, hidden
        rows [len(tokens), h]); each row's outputs [len(tokens), h], in the order of `rows`."""
        h, first = draft_batch(
            self.kv, self.block_size,
            [(req, start - t.base, start, ids) for req, t, start, ids, _ in rows], [],
        )  # fmt: skip
        hidden = [rows[i][4] for i in sorted(range(len(rows)), key=lambda i: first[i])]
        runner = self.runner
        ids_t, pos_t, metas = runner.device_inputs(h)
        for meta in metas:
            runner.backend.prepare(meta)
        out = self.head(ids_t, pos_t, runner.kv_caches, runner.layout.per_layer(metas),
                        torch.cat(hidden))  # fmt: skip
        return [out[first[i] : first[i] + len(rows[i][3])] for i in range(len(rows))]


# -- loading ------------------------------------------------------------------------------------


def _one_layer(spec: DecoderSpec, i: int, **changes) -> DecoderSpec:
    """`spec` cut to its layer i alone, then `changes`."""
    per_layer = {f: (getattr(spec, f)[i],) for f in _PER_LAYER}
    return dataclasses.replace(spec, num_layers=1, **per_layer, **changes)


def _core_spec(spec: DecoderSpec, i: int, **changes) -> DecoderSpec:
    """The head's core: layer i of `spec`, no vocabulary, final norm or LM head of its own."""
    if spec.kv_source[i] is not None or spec.mixers[i] != "attention":
        raise ConfigError(f"{spec.arch}: a draft layer must attend with its own KV cache")
    names = dataclasses.replace(spec.names, skip_prefixes=(), top={})
    return _one_layer(
        spec,
        i,
        vocab_size=1,
        final_norm=False,
        tied=True,
        lm_head_bias=False,
        embed_scale=None,
        per_layer_input=None,
        names=names,
        **changes,
    )


def _build(
    method,
    spec,
    hf_config,
    config: EngineConfig,
    target: LoadedModel,
    layer_weights,
    fc_bias,
    qwen: bool = False,
    mimo: bool = False,
):
    """The head on the target's device and dtype, its core's layer loaded from
    `layer_weights` ((name inside the layer, tensor))."""
    backend = make_attention_backend(config.attention_backend, target.device)
    with torch.device("meta"):
        core = DraftCore(spec, hf_config, backend, max_position=target.max_model_len)
        if method == "eagle3":  # the midlayer's attention reads [embedding | hidden]: 2h wide
            qkv = core.layers[0].self_attn.qkv_proj
            core.layers[0].self_attn.qkv_proj = nn.Linear(
                2 * spec.hidden_size, qkv.out_features, bias=qkv.bias is not None
            )
    core = core.to(target.dtype).materialize(target.device)
    core.backend = backend
    core.load_weights((f"{spec.names.layers_prefix}.0.{k}", v) for k, v in layer_weights)
    core = core.to(target.dtype).eval()
    head = DraftHead(method, core, target.model, fc_bias, qwen, mimo)
    return core, head


def _finish(core: DraftCore, head: DraftHead, target: LoadedModel) -> None:
    head.to(device=target.device, dtype=target.dtype).eval()
    if target.model.tp.enabled:
        embed, lm_head = vocab_tables(target)
        head.vocab = (
            embed.to(target.device, target.dtype),
            lm_head.to(target.device, target.dtype),
        )
    if target.device.type == "cpu":
        core.packed_lm_head = nn.Identity()  # never read: the logits are the head's
        core.optimize_for_cpu()


def _copy(param: torch.Tensor, tensor: torch.Tensor, name: str, where: str) -> None:
    if tuple(param.shape) != tuple(tensor.shape):
        raise ConfigError(
            f"speculative_config {where}: {name} is {tuple(tensor.shape)}, expected "
            f"{tuple(param.shape)}"
        )
    with torch.no_grad():
        param.copy_(tensor.to(param.dtype))


def load_eagle(config: EngineConfig, spec, target: LoadedModel) -> HeadLoad:
    """An EAGLE-1 head from speculative_config `model` (a local directory or hub id), checked
    against the target (hidden size, vocabulary, one layer, the tensors of EAGLE-1's layout)."""
    where = f"eagle model {spec.model!r}"
    resolved, hf, weights = _read_head(config, spec, where)
    arch = (getattr(hf, "architectures", None) or ["(none)"])[0]
    if arch not in EAGLE_ARCHS:
        hint = " (an EAGLE-3 head: method 'eagle3')" if "eagle3" in arch.lower() else ""
        raise ConfigError(
            f"speculative_config {where}: architecture {arch}{hint} is not an EAGLE-1 head "
            f"({', '.join(EAGLE_ARCHS)}: fc over [embedding, hidden state] and one Llama layer)"
        )
    t = target.model.full_spec
    if hf.hidden_size != t.hidden_size:
        raise ConfigError(
            f"speculative_config {where}: hidden_size {hf.hidden_size}, the target's "
            f"{t.hidden_size}: an EAGLE head reads the target's hidden states"
        )
    if hf.vocab_size != t.vocab_size:
        raise ConfigError(
            f"speculative_config {where}: a vocabulary of {hf.vocab_size} tokens, the target "
            f"{t.vocab_size}: an EAGLE head uses the target's embedding and LM head"
        )
    if hf.num_hidden_layers != 1:
        raise ConfigError(
            f"speculative_config {where}: {hf.num_hidden_layers} layers; EAGLE-1 heads of one "
            "layer are served"
        )
    described = copy.deepcopy(hf)
    described.architectures = ["LlamaForCausalLM"]
    base = describe_model(described)
    if "fc.weight" not in weights:
        raise ConfigError(f"speculative_config {where}: no fc.weight (not an EAGLE-1 head)")
    layer, other = [], []
    for name, tensor in weights.items():
        if name.startswith("layers.0."):
            layer.append((name.removeprefix("layers.0."), tensor))
        elif name not in ("fc.weight", "fc.bias", "embed_tokens.weight", "lm_head.weight"):
            other.append(name)
    if other:
        raise ConfigError(
            f"speculative_config {where}: tensors outside EAGLE-1's layout, e.g. {other[:3]}"
        )
    in_norm = any(k.startswith("input_layernorm.") for k, _ in layer)
    core_spec = _core_spec(base, 0, layer_norms=("in", "mlp") if in_norm else ("mlp",))
    try:
        core, head = _build("eagle", core_spec, hf, config, target, layer, "fc.bias" in weights)
    except KeyError as e:
        raise ConfigError(f"speculative_config {where}: {e}") from e
    _copy(head.fc.weight, weights["fc.weight"], "fc.weight", where)
    if "fc.bias" in weights:
        _copy(head.fc.bias, weights["fc.bias"], "fc.bias", where)
    _finish(core, head, target)
    loaded = _core_loaded(resolved, hf, head, target)
    return HeadLoad("eagle", loaded, head, resolved.source)


def _read_head(config: EngineConfig, spec, where: str):
    """(resolved, transformers config, tensors with a leading `model.` dropped) of the head
    speculative_config `model` names."""
    head_config = dataclasses.replace(
        config,
        model=spec.model,
        revision=spec.revision,
        tokenizer=None,
        tokenizer_revision=None,
        quantization=None,
        hf_overrides=None,
        speculative_config=None,
    )
    try:
        resolved = resolve_model(head_config)
        hf = load_hf_config(resolved, trust_remote_code=config.trust_remote_code)
        weights = {
            k.removeprefix("model."): v for k, v in iter_weights(resolved, show_progress=False)
        }
    except (ConfigError, ModelLoadError) as e:
        raise type(e)(f"speculative_config {where}: {e}") from e
    return resolved, hf, weights


def aux_layers(hf, num_layers: int, where: str) -> tuple[int, ...]:
    """The three target layers whose incoming streams EAGLE-3 reads: the head config's
    eagle_aux_hidden_state_layer_ids, else (2, L // 2, L - 3) as EAGLE-3 and vLLM take them."""
    ids = getattr(hf, "eagle_aux_hidden_state_layer_ids", None)
    ids = tuple(ids) if ids else (2, num_layers // 2, num_layers - 3)
    if len(ids) != 3 or not all(isinstance(i, int) and 0 <= i < num_layers for i in ids):
        raise ConfigError(
            f"speculative_config {where}: target layers {ids} for EAGLE-3's three hidden states; "
            f"the target has {num_layers} layers (at least 4 without "
            "eagle_aux_hidden_state_layer_ids)"
        )
    return ids


def load_eagle3(config: EngineConfig, spec, target: LoadedModel) -> HeadLoad:
    """An EAGLE-3 head: fc over the streams entering three target layers (3h -> h), a midlayer
    whose attention reads [input_layernorm(embedding), hidden_norm(hidden)] (2h), the hidden
    state as its residual, a final norm, its own LM head over a reduced vocabulary mapped to the
    target's ids by `d2t`."""
    where = f"eagle3 model {spec.model!r}"
    resolved, hf, weights = _read_head(config, spec, where)
    arch = (getattr(hf, "architectures", None) or ["(none)"])[0]
    if arch not in EAGLE3_ARCHS:
        raise ConfigError(
            f"speculative_config {where}: architecture {arch} is not an EAGLE-3 head "
            f"({', '.join(EAGLE3_ARCHS)})"
        )
    t = target.model.full_spec
    th = getattr(hf, "target_hidden_size", None) or hf.hidden_size
    if hf.hidden_size != t.hidden_size or th != t.hidden_size:
        raise ConfigError(
            f"speculative_config {where}: hidden_size {hf.hidden_size} (target_hidden_size "
            f"{th}), the target's {t.hidden_size}: heads of the target's width are served"
        )
    if hf.vocab_size != t.vocab_size:
        raise ConfigError(
            f"speculative_config {where}: a vocabulary of {hf.vocab_size} tokens, the target "
            f"{t.vocab_size}: an EAGLE-3 head embeds with the target's table"
        )
    if hf.num_hidden_layers != 1:
        raise ConfigError(f"speculative_config {where}: {hf.num_hidden_layers} layers (1 served)")
    layers = aux_layers(hf, t.num_layers, where)
    need = ("fc.weight", "norm.weight", "lm_head.weight", "midlayer.hidden_norm.weight")
    lacking = [k for k in need if k not in weights]
    if lacking:
        raise ConfigError(f"speculative_config {where}: no {lacking} (not an EAGLE-3 head)")
    layer, other = [], []
    for name, tensor in weights.items():
        if name.startswith("midlayer.") and name != "midlayer.hidden_norm.weight":
            layer.append((name.removeprefix("midlayer."), tensor))
        elif name not in (*need, "d2t", "t2d", "embed_tokens.weight"):
            other.append(name)
    if other:
        raise ConfigError(
            f"speculative_config {where}: tensors outside EAGLE-3's layout, e.g. {other[:3]}"
        )
    described = copy.deepcopy(hf)
    described.architectures = ["LlamaForCausalLM"]
    core_spec = _core_spec(describe_model(described), 0)
    try:
        core, head = _build("eagle3", core_spec, hf, config, target, layer, False)
    except KeyError as e:
        raise ConfigError(f"speculative_config {where}: {e}") from e
    _copy(head.fc.weight, weights["fc.weight"], "fc.weight", where)
    _copy(head.norm.weight, weights["norm.weight"], "norm.weight", where)
    hn = weights["midlayer.hidden_norm.weight"]
    _copy(head.hidden_norm.weight, hn, "midlayer.hidden_norm.weight", where)
    lm = weights["lm_head.weight"]
    head.head = nn.Linear(lm.shape[1], lm.shape[0], bias=False)
    _copy(head.head.weight, lm, "lm_head.weight", where)
    d2t = weights.get("d2t")
    if d2t is None and lm.shape[0] != t.vocab_size:
        raise ConfigError(
            f"speculative_config {where}: a head of {lm.shape[0]} tokens without d2t (the map "
            "to the target's ids)"
        )
    _finish(core, head, target)
    if d2t is not None:
        d2t = d2t.to(torch.int64).reshape(-1)
        ids = torch.arange(d2t.shape[0]) + d2t
        if d2t.shape[0] != lm.shape[0] or int(ids.min()) < 0 or int(ids.max()) >= t.vocab_size:
            raise ConfigError(
                f"speculative_config {where}: d2t ({d2t.shape[0]} entries) does not map the "
                f"head's {lm.shape[0]} tokens into the target's {t.vocab_size}"
            )
        head.d2t = d2t.to(target.device)
    head.tap = AuxTap(target.model, layers)
    loaded = _core_loaded(resolved, hf, head, target)
    return HeadLoad("eagle3", loaded, head, resolved.source)


def check_mtp_target(target: LoadedModel) -> None:
    """ConfigError unless the target ships MTP layers in a layout served here."""
    hf = target.hf_config
    arch = (getattr(hf, "architectures", None) or ["(none)"])[0]
    if arch not in MTP_ARCHS + QWEN_MTP_ARCHS + MIMO_MTP_ARCHS:
        raise ConfigError(
            f"speculative_config method 'mtp': {arch} is not served with its multi-token-"
            f"prediction layers here (DeepSeek-V3's layout, model.layers.<N>.: "
            f"{', '.join(MTP_ARCHS)}; Qwen3-Next's, mtp.: {', '.join(QWEN_MTP_ARCHS)}; "
            f"MiMo's, model.mtp_layers.<i>.: {', '.join(MIMO_MTP_ARCHS)})"
        )
    key = "mtp_num_hidden_layers" if arch in QWEN_MTP_ARCHS else "num_nextn_predict_layers"
    count = getattr(hf, key, None) or getattr(hf, "num_nextn_predict_layers", None) or 0
    if count < 1:
        raise ConfigError(
            f"speculative_config method 'mtp': {target.resolved.source} ({arch}) has no "
            f"multi-token-prediction layers ({key} is 0)"
        )
    if getattr(hf, "mtp_use_dedicated_embeddings", False):
        raise ConfigError(
            f"speculative_config method 'mtp': {target.resolved.source}'s MTP layer has an "
            "embedding of its own (mtp_use_dedicated_embeddings): not served yet"
        )
    if getattr(target.model, "quantization", "none") != "none":
        raise ConfigError(
            f"speculative_config method 'mtp': a quantized target's MTP layer "
            f"({target.model.quantization}) is not run yet"
        )
    if target.resolved.load_format not in ("safetensors", "pt", "auto"):
        raise ConfigError(
            f"speculative_config method 'mtp': {target.resolved.load_format} checkpoints hold "
            "no MTP layers"
        )


def load_mtp(config: EngineConfig, target: LoadedModel) -> HeadLoad:
    """The target's first multi-token-prediction layer (DeepSeek-V3's layout), read from its
    own checkpoint (`check_mtp_target` first)."""
    check_mtp_target(target)
    hf = target.hf_config
    if hf.architectures[0] in QWEN_MTP_ARCHS:
        return _load_qwen_mtp(config, target)
    if hf.architectures[0] in MIMO_MTP_ARCHS:
        return _load_mimo_mtp(config, target)
    count = hf.num_nextn_predict_layers
    n = hf.num_hidden_layers
    prefix = f"model.layers.{n}."
    head_parts = ("enorm.", "hnorm.", "eh_proj.", "shared_head.", "embed_tokens.")
    layer, extra = [], {}
    try:
        for name, lazy in iter_weights(target.resolved, show_progress=False, lazy=True):
            if not name.startswith(prefix):
                continue
            local = name.removeprefix(prefix)
            tensor = lazy.full() if hasattr(lazy, "full") else lazy
            if local.startswith(head_parts):
                extra[local] = tensor
            else:
                layer.append((local, tensor))
    except ModelLoadError as e:
        raise ModelLoadError(f"speculative_config method 'mtp': {e}") from e
    missing = [k for k in ("enorm.weight", "hnorm.weight", "eh_proj.weight") if k not in extra]
    if not layer or missing:
        raise ConfigError(
            f"speculative_config method 'mtp': {target.resolved.source} says "
            f"num_nextn_predict_layers={count}, but its checkpoint lacks the layer's tensors "
            f"under {prefix} (e.g. {(missing or ['the decoder block'])[:2]})"
        )
    full = copy.deepcopy(hf)
    full.num_hidden_layers = n + 1
    core_spec = _core_spec(describe_model(full), n)
    try:
        core, head = _build("mtp", core_spec, hf, config, target, layer, False)
    except KeyError as e:
        raise ConfigError(f"speculative_config method 'mtp': {prefix}: {e}") from e
    where = f"method 'mtp' ({prefix})"
    _copy(head.enorm.weight, extra["enorm.weight"], "enorm.weight", where)
    _copy(head.hnorm.weight, extra["hnorm.weight"], "hnorm.weight", where)
    _copy(head.eh_proj.weight, extra["eh_proj.weight"], "eh_proj.weight", where)
    if "shared_head.norm.weight" in extra:
        _copy(head.head_norm.weight, extra["shared_head.norm.weight"], "shared_head.norm", where)
    else:  # the target's final norm
        _copy(head.head_norm.weight, target.model.norm.weight.detach(), "norm", where)
    own = extra.get("shared_head.head.weight")
    if own is not None:
        head.head = nn.Linear(own.shape[1], own.shape[0], bias=False)
        _copy(head.head.weight, own, "shared_head.head.weight", where)
    _finish(core, head, target)
    loaded = _core_loaded(target.resolved, hf, head, target)
    return HeadLoad("mtp", loaded, head, f"{target.resolved.source} {prefix}")


def _load_qwen_mtp(config: EngineConfig, target: LoadedModel) -> HeadLoad:
    """Qwen3-Next's (and Qwen3.5's) first MTP layer, stored under `mtp.`: fc (2h -> h) over
    concat(pre_fc_norm_embedding(embedding), pre_fc_norm_hidden(hidden)), layers.0 (a full-
    attention layer of the model's own kind: gated attention, partial rotary, a MoE or a dense
    MLP as its tensors say), norm, then the target's LM head; every norm zero-centred (1 + w)."""
    hf = target.hf_config
    n = hf.num_hidden_layers
    prefix, where = "mtp.", "method 'mtp' (mtp.)"
    head_names = ("fc.weight", "pre_fc_norm_embedding.weight", "pre_fc_norm_hidden.weight",
                  "norm.weight")  # fmt: skip
    layer, extra, other = [], {}, []
    try:
        for name, lazy in iter_weights(target.resolved, show_progress=False, lazy=True):
            if not name.startswith(prefix):
                continue
            local = name.removeprefix(prefix)
            if local.startswith("layers.0."):
                tensor = lazy.full() if hasattr(lazy, "full") else lazy
                layer.append((local.removeprefix("layers.0."), tensor))
            elif local in head_names:
                extra[local] = lazy.full() if hasattr(lazy, "full") else lazy
            elif not local.startswith("layers."):  # later MTP layers are not run
                other.append(name)
    except ModelLoadError as e:
        raise ModelLoadError(f"speculative_config method 'mtp': {e}") from e
    missing = [k for k in head_names if k not in extra]
    if not layer or missing:
        raise ConfigError(
            f"speculative_config method 'mtp': {target.resolved.source} says it has MTP "
            f"layers, but its checkpoint lacks the layer's tensors under {prefix} (e.g. "
            f"{(missing or ['layers.0'])[:2]})"
        )
    if other:
        raise ConfigError(
            f"speculative_config {where}: tensors outside Qwen3-Next's MTP layout, e.g. {other[:3]}"
        )
    full = copy.deepcopy(hf)
    full.num_hidden_layers = n + 1
    full.layer_types = [*hf.layer_types[:n], "full_attention"]
    if getattr(hf, "num_experts", 0) and hasattr(hf, "mlp_only_layers"):  # Qwen3-Next
        # the MTP layer's MLP is what its tensors hold (a MoE or a dense MLP); the others' stay
        moe = any(k.startswith("mlp.experts.") for k, _ in layer)
        full.decoder_sparse_step = 1
        full.mlp_only_layers = [i for i in range(n) if not _sparse(hf, i)] + ([] if moe else [n])
    core_spec = _core_spec(describe_model(full), n)
    try:
        core, head = _build("mtp", core_spec, hf, config, target, layer, False, qwen=True)
    except KeyError as e:
        raise ConfigError(f"speculative_config {where}: layers.0: {e}") from e
    offset = core_spec.norm_weight_offset
    for param, name in (
        (head.enorm.weight, "pre_fc_norm_embedding.weight"),
        (head.hnorm.weight, "pre_fc_norm_hidden.weight"),
        (head.head_norm.weight, "norm.weight"),
    ):
        _copy(param, extra[name].float() + offset, name, where)
    _copy(head.eh_proj.weight, extra["fc.weight"], "fc.weight", where)
    _finish(core, head, target)
    loaded = _core_loaded(target.resolved, hf, head, target)
    return HeadLoad("mtp", loaded, head, f"{target.resolved.source} {prefix}")


def _load_mimo_mtp(config: EngineConfig, target: LoadedModel) -> HeadLoad:
    """MiMo's first MTP layer, stored under `model.mtp_layers.0.`: token_layernorm and
    hidden_layernorm, input_proj (2h -> h) over [normed hidden, normed embedding], one Qwen2
    decoder block of the target's shape (its input_layernorm, self_attn, post_attention_layernorm
    and mlp under Qwen2's names), final_layernorm, then the target's LM head."""
    hf = target.hf_config
    prefix, where = "model.mtp_layers.0.", "method 'mtp' (model.mtp_layers.0.)"
    head_names = ("token_layernorm.weight", "hidden_layernorm.weight", "input_proj.weight",
                  "final_layernorm.weight")  # fmt: skip
    layer, extra = [], {}
    try:
        for name, lazy in iter_weights(target.resolved, show_progress=False, lazy=True):
            if not name.startswith(prefix):
                continue  # later MTP layers are not run
            local = name.removeprefix(prefix)
            tensor = lazy.full() if hasattr(lazy, "full") else lazy
            if local in head_names:
                extra[local] = tensor
            else:
                layer.append((local, tensor))
    except ModelLoadError as e:
        raise ModelLoadError(f"speculative_config method 'mtp': {e}") from e
    missing = [k for k in head_names if k not in extra]
    if not layer or missing:
        raise ConfigError(
            f"speculative_config method 'mtp': {target.resolved.source} says "
            f"num_nextn_predict_layers={hf.num_nextn_predict_layers}, but its checkpoint lacks "
            f"the layer's tensors under {prefix} (e.g. {(missing or ['the decoder block'])[:2]})"
        )
    core_spec = _core_spec(describe_model(hf), 0)  # a Qwen2 layer like each of MiMo's
    try:
        core, head = _build("mtp", core_spec, hf, config, target, layer, False, mimo=True)
    except KeyError as e:
        raise ConfigError(f"speculative_config {where}: {e}") from e
    for param, name in (
        (head.enorm.weight, "token_layernorm.weight"),
        (head.hnorm.weight, "hidden_layernorm.weight"),
        (head.head_norm.weight, "final_layernorm.weight"),
        (head.eh_proj.weight, "input_proj.weight"),
    ):
        _copy(param, extra[name], name, where)
    _finish(core, head, target)
    loaded = _core_loaded(target.resolved, hf, head, target)
    return HeadLoad("mtp", loaded, head, f"{target.resolved.source} {prefix}")


def _sparse(hf, i: int) -> bool:
    """Whether Qwen3-Next's layer i has a MoE (families_moe._qwen_sparse_layers' rule)."""
    step = getattr(hf, "decoder_sparse_step", 1) or 1
    return i not in (hf.mlp_only_layers or ()) and (i + 1) % step == 0


def vocab_tables(target: LoadedModel) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's whole embedding and LM head weights, read again from its checkpoint: with
    tensor parallelism each rank holds a vocab share of them, and the head runs on rank 0
    alone (no collective in its steps)."""
    model = target.model
    names = model.full_spec.names
    where = "with tensor parallelism"
    if (
        getattr(model, "quantization", "none") != "none"
        or getattr(model, "lm_head_bias", None) is not None
    ):
        raise ConfigError(
            f"speculative_config {where}: a head for a quantized target or one whose LM head "
            "has a bias is not run yet (ngram and draft_model run)"
        )
    found: dict[str, torch.Tensor] = {}
    try:
        for name, lazy in iter_weights(target.resolved, show_progress=False, lazy=True):
            module, _, kind = name.rpartition(".")
            if kind != "weight":
                continue
            if names.base_prefix and not module.startswith(names.base_prefix):
                if not any(module == t or module.startswith(t + ".") for t in names.top):
                    module = names.base_prefix + module
            internal = names.top.get(module)
            if internal in ("embed_tokens", "lm_head"):
                found[internal] = lazy.full() if hasattr(lazy, "full") else lazy
    except ModelLoadError as e:
        raise ModelLoadError(f"speculative_config {where}: {e}") from e
    embed = found.get("embed_tokens")
    head = embed if model.tied else found.get("lm_head")
    vocab = model.full_spec.vocab_size
    if embed is None or head is None or embed.shape[0] < vocab or head.shape[0] < vocab:
        raise ConfigError(
            f"speculative_config {where}: {target.resolved.source} has no whole embedding and "
            "LM head in a form a head on one rank can read"
        )
    return embed[:vocab], head[:vocab]


def _core_loaded(resolved, hf, head: DraftHead, target: LoadedModel) -> LoadedModel:
    """The head's core as a LoadedModel (its cache layout and allocation), holding the bytes
    of the whole head (the target's shared embedding and LM head not counted)."""
    core = head.core
    held = sum(t.numel() * t.element_size() for t in head.state_dict().values())
    if head.vocab is not None:  # whole copies of the target's embedding and LM head
        held += sum(t.numel() * t.element_size() for t in {id(t): t for t in head.vocab}.values())
    return LoadedModel(
        resolved,
        hf,
        target.device,
        target.dtype,
        target.max_model_len,
        core.backend,
        core,
        target.cache_dtype,
        held,
    )
