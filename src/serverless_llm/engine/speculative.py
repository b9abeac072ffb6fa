"""Speculative decoding, first slice: the `ngram` proposer (prompt lookup) with greedy
verification.

Each step, a request whose next token is a decode gets up to k draft tokens from its own
prompt and output: the longest n-gram (n from `prompt_lookup_max` down to `prompt_lookup_min`)
ending its sequence that also occurs earlier proposes the tokens that followed its most recent
earlier occurrence. The scheduler grants it 1 + k query tokens (its last token and the drafts),
the model scores them in the same ragged pass as everything else, and the argmax at each row is
what plain greedy decoding would have produced there: drafts are accepted while they equal it,
and the first row that disagrees (or the row after the last draft) gives one more token of the
model's own. The KV of rejected drafts is rolled back (Scheduler.rollback), so only computed,
accepted tokens stay in the cache or get a prefix-cache key.

Requests whose next token is a plain argmax (`plain_argmax`: temperature 0, nothing changing
the logits, no logprobs) accept drafts that equal the argmax. Every other request that samples
one sequence verifies by rejection sampling (sampling/verify.py): each draft row is sampled with
the request's own parameters and penalties as if the drafts before it were accepted, a draft is
kept when that row's draw is the draft (probability p(draft)), else the draw is kept (the
residual), so temperature, top-k/p, min-p, penalties, logit bias, min_tokens, seeds and logprobs
keep their meaning; a guided request's draft rows carry its grammar's mask with the matcher
advanced through the drafts before each row, then rolled back. Beam search, images and pooling
do not speculate (`can_speculate`); they decode one token a step in the same batch.

The `draft_model` proposer (draft_model.py) proposes the same way for the same requests: a
smaller model of the same tokenizer, with its own paged KV cache, run for k greedy steps.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass

import numpy as np

from .config import ConfigError
from .request import Request

METHODS = ("ngram", "draft_model", "eagle", "eagle3", "mtp")
# Methods vLLM knows that this engine does not run yet (refused by name, not as a typo).
LATER_METHODS = ("medusa", "mlp_speculator")
# vLLM's older per-model names of the `mtp` method.
MTP_ALIASES = ("deepseek_mtp", "glm4_moe_mtp", "mimo_mtp", "ernie_mtp", "qwen3_next_mtp")
# Steps with more running requests than this do not speculate unless the config says otherwise
# (`disable_by_batch_size`): past it, verifying k + 1 rows for each request costs more than the
# accepted drafts save, measured on CPU by bench/speculative_batch.py (docs/benchmarks.md).
DISABLE_BY_BATCH_SIZE = 16
# Backoff: a request whose running share of kept drafts (each verification weighs SPEC_RATE_WEIGHT;
# it starts at SPEC_RATE_START, so one fully rejected run is enough) falls below BACKOFF_RATE
# proposes nothing for its next BACKOFF_TOKENS tokens, twice as many after each further poor run
# in a row (up to BACKOFF_MAX), then tries again: free text, where prompt lookup proposes now and
# then and is rarely right, stops paying for the rejected drafts' rows, while text that copies
# its prompt keeps speculating. Out of a backoff, a request probes with one draft (probe_drafts)
# until a verification keeps its share above BACKOFF_RATE.
SPEC_RATE_START = 0.5
SPEC_RATE_WEIGHT = 0.5
BACKOFF_RATE = 0.3
BACKOFF_TOKENS = 16
BACKOFF_MAX = 256


def note_verified(req: Request, drafted: int, kept: int) -> None:
    """Counts a verification of `drafted` drafts, `kept` of them kept, in `req`'s speculative
    counts, updates its running share of kept drafts, and starts a backoff when it is poor
    (longer for each poor run in a row)."""
    if drafted < 1:
        return
    counts = req.spec_counts
    counts.verifications += 1
    counts.draft_tokens += drafted
    counts.accepted_tokens += kept
    req.spec_rate += SPEC_RATE_WEIGHT * (kept / drafted - req.spec_rate)
    if req.spec_rate < BACKOFF_RATE:
        span = min(BACKOFF_TOKENS << req.spec_misses, BACKOFF_MAX)
        req.spec_skip_until = len(req.output_token_ids) + span
        req.spec_misses += 1
    else:
        req.spec_misses = 0


def backing_off(req: Request) -> bool:
    """Whether `req` is in a backoff (proposes no drafts this step)."""
    return len(req.output_token_ids) < req.spec_skip_until


def probe_drafts(req: Request, k: int) -> int:
    """How many drafts `req` may propose once out of a backoff: one while its last verification
    was poor (a probe: whether its drafts are right again costs one row, not k; a kept probe
    lifts its share past BACKOFF_RATE and the next step proposes k again), else `k`."""
    return 1 if req.spec_misses else k


IMPLEMENTED = (
    "only 'ngram' (prompt lookup), 'draft_model' (a smaller model of the same tokenizer, named "
    "by `model`), 'eagle' and 'eagle3' (an EAGLE-1 or EAGLE-3 head named by `model`) and 'mtp' "
    "(the target's own multi-token-prediction layer) are implemented in this engine"
)


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str
    num_speculative_tokens: int
    prompt_lookup_min: int = 0  # ngram's
    prompt_lookup_max: int = 0
    model: str | None = None  # draft_model's: a local directory, .gguf file or hub id
    revision: str | None = None  # the draft's hub revision
    # vLLM's key: no request speculates in a step with more running requests than this (None:
    # always). The default is measured (DISABLE_BY_BATCH_SIZE).
    disable_by_batch_size: int | None = None


def speculative_method(value: dict) -> str | None:
    """The method a speculative config dict names, vLLM's older spellings read: `model` alone
    is "ngram" when it says so, else a draft model's path or hub id (None: neither given)."""
    method = value.get("method")
    model = value.get("model")
    if method is None and model in ("ngram", "[ngram]"):
        return "ngram"  # vLLM's older spelling: the proposer named as the model
    if method is None and model is not None:
        return "draft_model"
    if method in MTP_ALIASES:
        return "mtp"
    return method


def parse_speculative_config(value) -> SpeculativeConfig | None:
    """vLLM's speculative config (a dict, or its JSON text) checked; None when empty. `ngram`
    and `draft_model` run here; any other method is refused with a ConfigError that says so.
    The draft model itself is checked when the engine loads it (llm_engine.py)."""
    if value is None or value == "" or value == {}:
        return None
    if isinstance(value, SpeculativeConfig):
        return value
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise ConfigError(f"speculative_config is not valid JSON: {e}") from e
    if not isinstance(value, dict):
        raise ConfigError(f"speculative_config must be a JSON object, got {type(value).__name__}")
    method = speculative_method(value)
    if method is None:
        raise ConfigError(f"speculative_config needs a method (or a draft `model`): {IMPLEMENTED}")
    if method not in METHODS:
        known = "a method not implemented here" if method in LATER_METHODS else "unknown"
        raise ConfigError(f"speculative_config method={method!r}: {known}; {IMPLEMENTED}")
    k = _int(value, "num_speculative_tokens", None)
    if k is None or k < 1:
        raise ConfigError(f"speculative_config num_speculative_tokens={k!r}: must be >= 1")
    off = _int(value, "disable_by_batch_size", DISABLE_BY_BATCH_SIZE)
    if "disable_by_batch_size" in value and value["disable_by_batch_size"] is None:
        off = None  # null: speculate at every batch size
    if off is not None and off < 1:
        raise ConfigError(
            f"speculative_config disable_by_batch_size={off}: must be >= 1 (or null: never off)"
        )
    return dataclasses.replace(_method_config(value, method, k), disable_by_batch_size=off)


def _method_config(value: dict, method: str, k: int) -> SpeculativeConfig:
    if method in ("draft_model", "eagle", "eagle3"):
        return _draft_model_config(value, k, method)
    if method == "mtp":  # the target's own layers: a `model` (vLLM lets it name the target) unused
        return SpeculativeConfig("mtp", k)
    hi = _int(value, "prompt_lookup_max", None)
    lo = _int(value, "prompt_lookup_min", None)
    if hi is None and lo is None:
        raise ConfigError(
            "speculative_config method 'ngram' needs prompt_lookup_max (and optionally "
            "prompt_lookup_min)"
        )
    hi = lo if hi is None else hi
    lo = hi if lo is None else lo
    if lo < 1 or hi < lo:
        raise ConfigError(
            f"speculative_config prompt_lookup_min={lo}, prompt_lookup_max={hi}: need "
            "1 <= prompt_lookup_min <= prompt_lookup_max"
        )
    return SpeculativeConfig(method, k, lo, hi)


def _draft_model_config(value: dict, k: int, method: str = "draft_model") -> SpeculativeConfig:
    model = value.get("model")
    if not isinstance(model, str) or not model.strip() or model in ("ngram", "[ngram]"):
        what = "directory, .gguf file" if method == "draft_model" else "directory"
        raise ConfigError(
            f"speculative_config method {method!r} needs `model`: the draft's local "
            f"{what} or hub id (got {model!r})"
        )
    tp = _int(value, "draft_tensor_parallel_size", 1)
    if tp != 1:
        raise ConfigError(
            f"speculative_config draft_tensor_parallel_size={tp}: the draft model runs on one "
            "device here (1 only)"
        )
    revision = value.get("revision")
    if revision is not None and not isinstance(revision, str):
        raise ConfigError(f"speculative_config revision={revision!r}: must be a string")
    return SpeculativeConfig(method, k, model=model.strip(), revision=revision)


def _int(d: dict, key: str, default):
    v = d.get(key, default)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int):
        raise ConfigError(f"speculative_config {key}={v!r}: must be an integer")
    return v


def propose_ngram(tokens: list[int], lo: int, hi: int, k: int) -> list[int]:
    """Up to `k` tokens that followed the most recent earlier occurrence of the longest n-gram
    (lo <= n <= hi) ending `tokens`; [] when none of them occurs earlier."""
    length = len(tokens)
    if k < 1 or length < lo + 1:
        return []
    arr = np.asarray(tokens, dtype=np.int64)
    for n in range(min(hi, length - 1), lo - 1, -1):
        suffix = arr[length - n :]
        # Windows starting at 0 .. length - n - 1: every occurrence but the suffix itself.
        windows = np.lib.stride_tricks.sliding_window_view(arr[: length - 1], n)
        hits = np.flatnonzero((windows == suffix).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n
            return arr[start : start + k].tolist()
    return []


def snapshot_slots(value, max_num_seqs: int) -> int:
    """Spare state slots a model with recurrent layers gets for speculation (`value`: the
    speculative config): one for each request that may speculate in a step (its state copied
    aside before verification, kv_cache_manager.snapshot_state), so max_num_seqs requests can
    all speculate; 0 without speculation."""
    spec = parse_speculative_config(value)
    if spec is None:
        return 0
    off = spec.disable_by_batch_size
    return max_num_seqs if off is None else min(max_num_seqs, off)


def verify_rows(spec: SpeculativeConfig | None) -> int:
    """The most rows one request brings to a step while speculating: its last token and k drafts
    (a verification), or, on a model with recurrent layers after a rollback, the kept tokens
    computed again (the last token and up to k drafts) and the new one; 0 without speculation.
    What a captured verification step of such a model must hold (decode_capture.py)."""
    return 0 if spec is None else spec.num_speculative_tokens + 2


def can_speculate(req: Request) -> bool:
    """Whether `req` may verify drafts: any request that samples one sequence, whatever its
    sampling parameters (greedy ones through `accept_greedy`, the others through rejection
    sampling, sampling/verify.py, guided ones with their grammar's mask at each draft row).
    Not beam search, images, pooling, nor a grammar still waiting for `structured_after`."""
    if req.sampling is None or req.beam is not None or req.mm is not None:
        return False
    if req.grammar is not None and not req.grammar_open:
        return False
    return getattr(req, "pooling", None) is None


def plain_argmax(req: Request) -> bool:
    """Whether `req`'s next token is the plain argmax of the model's logits (greedy, nothing
    changing the logits, no logprobs), so its drafts are checked against the argmax alone;
    others go through the sampler (sampling/verify.py)."""
    s = req.sampling
    if s.mode != "greedy" or s.allowed_ids is not None or s.bias_ids is not None:
        return False
    if req.grammar is not None:
        return False
    if s.min_tokens_ids is not None and len(req.output_token_ids) < req.params.min_tokens:
        return False
    p = req.params
    if p.logprobs is not None or p.repetition_penalty != 1.0:
        return False
    return p.frequency_penalty == 0.0 and p.presence_penalty == 0.0


def accept_greedy(drafts: list[int], targets: list[int]) -> list[int]:
    """The tokens a verified run yields: the drafts up to the first that differs from the
    model's argmax at its row, then the model's own token at that row (len(targets) is
    len(drafts) + 1)."""
    a = 0
    while a < len(drafts) and drafts[a] == targets[a]:
        a += 1
    return targets[: a + 1]
