"""What the engine does for every model, done for hybrid models (issue 35): their recurrent
layers keep a state per request in a slot of the state pool, beside the paged KV cache of their
attention layers. Chunked prefill, preemption, prefix caching (turned off for them), beam search
(forks copy state slots), captured decodes (the replay twin) and the slot books, each against
transformers' own tokens on a tiny random model of each kind of recurrent layer."""

from __future__ import annotations

import pytest
import transformers

from serverless_llm import LLM, SamplingParams
from tests.engine.family_check import NEW_TOKENS, family_prompts, save_family_model, tiny_dims
from tests.engine.reference import hf_greedy
from tests.engine.test_families_jamba import CONFIGS as JAMBA_CONFIGS
from tests.engine.test_families_kimi import CONFIGS as KIMI_CONFIGS
from tests.engine.test_families_kimi import kimi_greedy
from tests.engine.test_families_linear import CONFIGS as LINEAR_CONFIGS
from tests.engine.test_families_mamba import CONFIGS as MAMBA_CONFIGS
from tests.tiny_models import build_tokenizer

HYBRIDS = {
    # short convolutions beside attention
    "lfm2": lambda tok: transformers.Lfm2Config(
        **tiny_dims(tok, num_hidden_layers=4),
        layer_types=["conv", "full_attention", "conv", "conv"],
        conv_L_cache=3,
        conv_bias=True,
        norm_eps=1e-5,
    ),
    # Granite 4.0-H: Mamba-2 layers beside attention, a MoE and a shared MLP, the multipliers
    "granitemoehybrid": lambda tok: MAMBA_CONFIGS["granitemoehybrid"](tok),
    # Mamba-2 layers alone: no attention layer, no KV block
    "mamba2": lambda tok: MAMBA_CONFIGS["mamba2"](tok),
    # Falcon-H1: attention and Mamba-2 side by side in every layer (KV and a state per layer)
    "falcon_h1": lambda tok: MAMBA_CONFIGS["falcon_h1"](tok),
    # Jamba: Mamba-1 layers beside attention, experts on an attention and a Mamba layer
    "jamba": lambda tok: JAMBA_CONFIGS["jamba"](tok),
    # Qwen3-Next: Gated DeltaNet layers beside gated attention, a MoE with a shared expert
    "qwen3_next": lambda tok: LINEAR_CONFIGS["qwen3_next"](tok),
    # Nemotron-H: one-kind blocks (Mamba-2, MoE, attention, MLP), the time step limited on
    # prompt tokens only (time_step_min 0.5, below which many fall): a preempted or chunked
    # request's generated tokens, computed again in a prompt chunk, must still skip the limit
    "nemotron_h": lambda tok: MAMBA_CONFIGS["nemotron_h"](tok),
    # Kimi Linear: Kimi Delta Attention layers alone (no MLA yet), a dense MLP and MoEs
    "kimi_linear": lambda tok: KIMI_CONFIGS["kimi_linear"](tok),
}

# By model_type, the families whose transformers `generate` cannot run them with a cache (an
# all-KDA Kimi Linear: its cache asks an attention layer for the length), and the reference that
# steps transformers' model by hand instead.
BY_HAND = {"kimi_linear": kimi_greedy}


def want(path: str, prompt: list[int]) -> list[int]:
    """transformers' greedy tokens for `prompt`."""
    by_hand = BY_HAND.get(transformers.AutoConfig.from_pretrained(path).model_type)
    return by_hand(path, tuple(prompt)) if by_hand else hf_greedy(path, prompt, NEW_TOKENS)


@pytest.fixture(scope="module", params=list(HYBRIDS))
def hybrid(request, tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp(request.param))
    return save_family_model(path, HYBRIDS[request.param](build_tokenizer()))


@pytest.fixture(scope="module")
def prompts(hybrid) -> list[list[int]]:
    vocab = transformers.AutoConfig.from_pretrained(hybrid).vocab_size
    return family_prompts(vocab)


@pytest.fixture(scope="module")
def reference(hybrid, prompts) -> list[list[int]]:
    return [want(hybrid, p) for p in prompts]


def engine(path: str, **kw) -> LLM:
    args = dict(block_size=8, num_kv_blocks=160, max_model_len=256, dtype="float32")
    args.update(kw)
    return LLM(path, **args)


def greedy(llm: LLM, prompts) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params)]


def assert_books_whole(llm: LLM) -> None:
    """Every block and state slot is back in its pool (a slot keeping a cached prefix's state
    counts as free, like a cached block) and the manager's books balance."""
    e = llm.engine
    e.kv.check()
    assert e.block_pool.num_free == e.block_pool.num_blocks, "KV blocks leaked"
    assert e.state_pool.num_free == e.state_pool.num_slots - 1, "state slots leaked"


def space_for_slots(path: str, slots: int) -> float:
    """The kv_cache_space_gib that holds `slots` state slots (the scratch slot included): states
    get half of the space when the model also attends, all of it when it does not."""
    probe = engine(path).engine
    slot_bytes = sum(
        t[0].numel() * t.element_size()
        for c in probe.kv_caches
        if hasattr(c, "tensors")
        for t in c.tensors
    )
    share = 2 if probe.cache_layout.num_groups else 1
    return share * slots * slot_bytes / 2**30


def test_state_slots_beside_the_kv_cache(hybrid):
    llm = engine(hybrid, max_num_seqs=5)
    e = llm.engine
    assert e.cache_layout.has_state and e.state_pool is not None
    # max_num_seqs requests' states, plus the scratch slot
    assert e.state_pool.num_slots == 6
    assert e.block_pool.enable_prefix_caching  # with the states of prefixes kept beside


@pytest.mark.parametrize("budget", [1, 7, 64])
def test_chunked_prefill_gives_the_same_tokens(hybrid, prompts, reference, budget):
    """A step budget of 1, 7 or 64 tokens cuts prompts into chunks of that size or less (less
    where running requests take their decode tokens first): the state carried across chunks
    gives transformers' tokens."""
    llm = engine(hybrid, max_num_batched_tokens=budget, max_num_seqs=4)
    assert greedy(llm, prompts) == reference
    assert_books_whole(llm)


def test_preemption_gives_the_same_tokens(hybrid, prompts, reference):
    """Too few KV blocks for every request: the newest are preempted (their state slot freed,
    their tokens recomputed from zeros later) and still give transformers' tokens."""
    llm = engine(hybrid, num_kv_blocks=20, max_model_len=128, max_num_batched_tokens=32)
    assert greedy(llm, prompts) == reference
    if llm.engine.cache_layout.num_groups:  # a model without attention has no block to run short of
        assert llm.engine.scheduler.num_preemptions > 0
    assert_books_whole(llm)


def test_shared_prefixes_with_prefix_caching_on_and_off(hybrid, prompts):
    """Two requests sharing a long prefix give transformers' tokens with prefix caching on
    (the second starts from the first's blocks and the state cached at its prompt's last block
    boundary) and off; a conversation's next turn starts after the previous turn's prompt and
    answer (states cached where decode steps crossed block boundaries)."""
    base = prompts[-1]
    pair = [base + [7, 8, 9], base + [10, 11]]
    wanted = [want(hybrid, p) for p in pair]
    for caching in (True, False):
        llm = engine(hybrid, enable_prefix_caching=caching)
        assert greedy(llm, pair[:1]) == wanted[:1]  # the first fills the cache
        hits = llm.engine.block_pool.hits
        assert greedy(llm, pair) == wanted
        assert (llm.engine.block_pool.hits > hits) is caching
        assert bool(llm.engine.state_pool.cached) is caching
        assert_books_whole(llm)
    llm = engine(hybrid, enable_prefix_caching=True)
    turn = greedy(llm, pair[:1])[0]
    follow = pair[0] + turn + [12, 13]
    hits = llm.engine.block_pool.hits
    assert greedy(llm, [follow]) == [want(hybrid, follow)]
    assert llm.engine.block_pool.hits - hits > len(pair[0]) // 8  # past the first prompt
    assert_books_whole(llm)


def test_more_requests_than_slots_queue(hybrid, prompts, reference):
    """Memory for 2 requests' states with max_num_seqs 8: the others wait for a slot, none
    fails, and at most 2 run at once."""
    llm = engine(hybrid, kv_cache_space_gib=space_for_slots(hybrid, 3), max_num_seqs=8)
    assert llm.engine.state_pool.num_slots == 3
    most = 0
    step = llm.engine.step

    def watching():
        nonlocal most
        out = step()
        most = max(most, len(llm.engine.scheduler.running))
        return out

    llm.engine.step = watching
    assert greedy(llm, prompts) == reference
    assert most == 2
    assert_books_whole(llm)


def test_aborted_and_finished_requests_leave_no_slot(hybrid, prompts):
    llm = engine(hybrid, max_num_seqs=4)
    e = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    reqs = [e.add_request(p, params) for p in prompts]
    for _ in range(6):
        e.step()
    assert e.state_pool.num_free < e.state_pool.num_slots - 1
    for r in reqs[::2]:
        e.abort_request(r.request_id)
    while e.has_unfinished_requests():
        e.step()
    assert_books_whole(llm)


def test_captured_decodes_give_the_same_tokens(hybrid, prompts, reference):
    """The replay twin of CUDA-graph decodes: padded rows start a state in the scratch slot and
    its self-check restores the states it advanced."""
    llm = engine(hybrid, decode_capture="replay", max_num_seqs=4)
    captured = llm.engine.runner.captured
    assert captured is not None and captured.enabled
    assert greedy(llm, prompts) == reference
    assert captured.replays > 0
    assert_books_whole(llm)


def test_torch_attention_backend_gives_the_same_tokens(hybrid, prompts, reference):
    """The torch reference backend (the CPU default is the native one) beside the recurrent
    layers' torch paths."""
    llm = engine(hybrid, attention_backend="torch")
    assert llm.engine.backend.name == "torch"
    assert greedy(llm, prompts) == reference
    assert_books_whole(llm)


def test_beam_search_forks_copy_state_slots(hybrid, prompts):
    """Beams forked with a copy of their parent's state give the same sequences as beams that
    cannot fork (one state slot: every child recomputes its prefix from zeros)."""
    params = SamplingParams(
        use_beam_search=True, temperature=0.0, best_of=3, n=3, max_tokens=10, ignore_eos=True
    )
    runs = []
    for space in (None, "one slot"):
        kw = {}
        if space is not None:
            kw["kv_cache_space_gib"] = space_for_slots(hybrid, 2)
        llm = engine(hybrid, **kw)
        if space is not None:
            assert llm.engine.state_pool.num_slots == 2  # one slot and the scratch slot
        outs = llm.generate(prompts[2:5], params)
        runs.append([[s.token_ids for s in o.outputs] for o in outs])
        assert_books_whole(llm)
    assert runs[0] == runs[1]
