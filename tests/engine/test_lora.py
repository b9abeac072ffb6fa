"""LoRA adapters (issue 18) on CPU against transformers + peft: random adapters made with peft on
a tiny Llama (two, of different ranks and target modules, one on the MLP too, one with rsLoRA)
and a tiny Qwen2; each adapter's greedy tokens equal peft's `merge_and_unload` model's, and the
base model and both adapters mixed in one `generate` call give the same tokens as run apart.
Also: more adapters than slots (eviction and reload), prefix caching kept apart per adapter,
and each bad adapter refused with its reason while the engine goes on serving."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
import transformers

from serverless_llm import LLM, LoRARequest, SamplingParams
from serverless_llm.engine import LoRAError
from tests.engine.family_check import family_prompts, save_family_model, tiny_dims
from tests.engine.reference import hf_greedy
from tests.lora_adapters import make_adapter
from tests.tiny_models import build_tokenizer

pytest.importorskip("peft")

NEW = 32
ADAPTERS = {
    # name: (base, r, alpha, target modules, rslora)
    "attn8": ("llama", 8, 16, ["q_proj", "v_proj", "o_proj"], False),
    "all4": ("llama", 4, 8, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                             "down_proj"], True),
    "qwen16": ("qwen2", 16, 8, ["q_proj", "k_proj", "gate_proj", "down_proj"], False),
    # a hybrid (issue 35): attention and MLP projections of LFM2, beside its short convolutions
    "lfm2_attn_mlp": ("lfm2", 8, 16, ["q_proj", "v_proj", "w1", "w2"], False),
}  # fmt: skip
IDS = {name: i + 1 for i, name in enumerate(ADAPTERS)}


@pytest.fixture(scope="module")
def lora_env(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora")
    tok = build_tokenizer()
    bases = {
        "llama": save_family_model(str(root / "llama"), transformers.LlamaConfig(**tiny_dims(tok))),
        "qwen2": save_family_model(
            str(root / "qwen2"),
            transformers.Qwen2Config(**tiny_dims(tok), tie_word_embeddings=True),
        ),
        "lfm2": save_family_model(
            str(root / "lfm2"),
            transformers.Lfm2Config(
                **tiny_dims(tok, num_hidden_layers=3),
                layer_types=["conv", "full_attention", "conv"],
            ),
        ),
    }
    adapters = {}
    for i, (name, (base, r, alpha, targets, rslora)) in enumerate(ADAPTERS.items()):
        out = str(root / name)
        make_adapter(bases[base], out, r, alpha, targets, rslora, seed=10 + i)
        adapters[name] = out
    return bases, adapters


def _req(adapters, name):
    return LoRARequest(name, IDS[name], adapters[name])


def _llm(path, **kw):
    args = dict(
        block_size=8, num_kv_blocks=160, max_model_len=256, dtype="float32", enable_lora=True,
        max_loras=2, max_lora_rank=16,
    )  # fmt: skip
    args.update(kw)
    return LLM(path, **args)


GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True)


@pytest.mark.parametrize("name", list(ADAPTERS))
def test_adapter_matches_peft_merged(lora_env, name):
    bases, adapters = lora_env
    base = ADAPTERS[name][0]
    prompts = family_prompts(len(build_tokenizer()))
    llm = _llm(bases[base])
    outs = llm.generate(prompts, GREEDY, lora_request=_req(adapters, name))
    merged = adapters[name] + "-merged"
    base_outs = []
    for prompt, out in zip(prompts, outs):
        want = hf_greedy(merged, prompt, NEW)
        assert out.outputs[0].token_ids == want, f"prompt of {len(prompt)} tokens"
        base_outs.append(hf_greedy(bases[base], prompt, NEW))
    # the adapter changes the output (else the test would prove nothing)
    assert [o.outputs[0].token_ids for o in outs] != base_outs
    pool = llm.engine.block_pool
    assert pool.num_free == pool.num_blocks


def _count_forms(monkeypatch) -> dict[str, int]:
    """Counts the CPU's two LoRA forms as layers run them: slot-major padded (small steps) and
    all-slots masked (large ones, plain or through the packed matrices)."""
    from serverless_llm.engine.layers import lora_linear as lora_layer

    calls = {"padded": 0, "masked": 0}

    def counted(name, fn):
        def wrapper(*args, **kw):
            calls[name] += 1
            return fn(*args, **kw)

        return wrapper

    monkeypatch.setattr(
        lora_layer, "add_lora_padded", counted("padded", lora_layer.add_lora_padded)
    )
    monkeypatch.setattr(
        lora_layer, "add_lora_masked", counted("masked", lora_layer.add_lora_masked)
    )
    packed = lora_layer.LoRALinear._packed_delta
    monkeypatch.setattr(lora_layer.LoRALinear, "_packed_delta", counted("masked", packed))
    return calls


def test_base_and_two_adapters_mixed_in_one_call(lora_env, monkeypatch):
    """Both CPU forms run in the mixed call (the prefill's many tokens masked, the decodes
    padded, with base rows among them) and give the tokens each request gets alone."""
    bases, adapters = lora_env
    prompts = family_prompts(len(build_tokenizer()))
    llm = _llm(bases["llama"])
    forms = _count_forms(monkeypatch)
    a1, a2 = _req(adapters, "attn8"), _req(adapters, "all4")
    apart = {
        None: llm.generate(prompts, GREEDY),
        a1: llm.generate(prompts, GREEDY, lora_request=a1),
        a2: llm.generate(prompts, GREEDY, lora_request=a2),
    }
    choice = [None, a1, a2, a1, None, a2, a2, a1]
    mixed = llm.generate(prompts, GREEDY, lora_request=choice)
    for i, (lora, out) in enumerate(zip(choice, mixed)):
        assert out.outputs[0].token_ids == apart[lora][i].outputs[0].token_ids
    assert forms["padded"] > 0 and forms["masked"] > 0, forms


def test_more_adapters_than_slots(lora_env):
    """Three adapters on the base model (two copies of one under other ids) with one slot:
    every request finishes with its adapter's tokens; slots were reloaded."""
    bases, adapters = lora_env
    prompts = family_prompts(len(build_tokenizer()))[:6]
    ref = _llm(bases["llama"])
    want = {
        n: ref.generate(prompts, GREEDY, lora_request=_req(adapters, n)) for n in ("attn8", "all4")
    }
    llm = _llm(bases["llama"], max_loras=1, max_cpu_loras=1)
    a3 = LoRARequest("attn8-again", 7, adapters["attn8"])
    choice = [_req(adapters, "attn8"), _req(adapters, "all4"), a3] * 2
    outs = llm.generate(prompts, GREEDY, lora_request=choice)
    for i, (lora, out) in enumerate(zip(choice, outs)):
        name = "all4" if lora.lora_name == "all4" else "attn8"
        assert out.outputs[0].token_ids == want[name][i].outputs[0].token_ids
    assert llm.engine.lora.slot_loads >= 3
    assert llm.engine.lora.adapter_reads >= 3  # one host slot: read again after eviction


def test_prefix_cache_is_kept_apart_per_adapter(lora_env):
    bases, adapters = lora_env
    prompt = family_prompts(len(build_tokenizer()), lengths=(40,))[0]
    llm = _llm(bases["llama"])
    a1 = _req(adapters, "attn8")
    base_first = llm.generate([prompt], GREEDY)[0].outputs[0].token_ids
    hits = llm.engine.block_pool.hits
    with_adapter = llm.generate([prompt], GREEDY, lora_request=a1)[0].outputs[0].token_ids
    assert llm.engine.block_pool.hits == hits  # the base model's blocks were not reused
    again = llm.generate([prompt], GREEDY, lora_request=a1)[0].outputs[0].token_ids
    assert llm.engine.block_pool.hits > hits  # the adapter's own blocks were
    assert again == with_adapter != base_first


def test_a_reused_id_with_other_weights_shares_no_cache(lora_env):
    """Once the host LRU forgot an adapter, its id may come back with another path: the prefix
    cache keys include the path, so the old adapter's blocks are not reused."""
    bases, adapters = lora_env
    prompt = family_prompts(len(build_tokenizer()), lengths=(40,))[0]
    llm = _llm(bases["llama"], max_loras=1, max_cpu_loras=1)
    first = LoRARequest("a", 1, adapters["attn8"])
    llm.generate([prompt], GREEDY, lora_request=first)
    llm.generate([prompt], GREEDY, lora_request=_req(adapters, "all4"))  # evicts id 1
    hits = llm.engine.block_pool.hits
    again = LoRARequest("a", 1, adapters["all4"])  # id 1 and its name, other weights
    got = llm.generate([prompt], GREEDY, lora_request=again)[0].outputs[0].token_ids
    assert llm.engine.block_pool.hits == hits
    want = llm.generate([prompt], GREEDY, lora_request=_req(adapters, "all4"))
    assert got == want[0].outputs[0].token_ids


def _broken(adapters, tmp_path, change) -> str:
    out = str(tmp_path / "broken")
    shutil.copytree(adapters["attn8"], out)
    change(out)
    return out


def _edit_config(**kv):
    def change(path):
        p = os.path.join(path, "adapter_config.json")
        cfg = json.load(open(p))
        cfg.update(kv)
        json.dump(cfg, open(p, "w"))

    return change


def _edit_tensors(fn):
    def change(path):
        from safetensors.torch import load_file, save_file

        p = os.path.join(path, "adapter_model.safetensors")
        state = load_file(p)
        fn(state)
        save_file(state, p)

    return change


def _first(state, part):
    return next(k for k in sorted(state) if part in k)


BAD = {
    "dora": (_edit_config(use_dora=True), "DoRA is not supported"),
    "modules_to_save": (_edit_config(modules_to_save=["lm_head"]), "modules_to_save"),
    "embedding": (
        _edit_tensors(
            lambda s: s.update(
                {"base_model.model.model.embed_tokens.lora_embedding_A": torch.zeros(8, 10)}
            )
        ),
        "not a LoRA A or B weight",
    ),
    "lm_head": (
        _edit_tensors(
            lambda s: s.update(
                {
                    "base_model.model.lm_head.lora_A.weight": torch.zeros(8, 64),
                    "base_model.model.lm_head.lora_B.weight": torch.zeros(100, 8),
                }
            )
        ),
        "module 'lm_head'",
    ),
    "rank": (
        _edit_tensors(
            lambda s: [
                s.update({k: torch.zeros(32, v.shape[1]) if "lora_A" in k else torch.zeros(v.shape[0], 32)})
                for k, v in list(s.items())
            ]
        ),
        "above max_lora_rank 16",
    ),
    "shape": (
        _edit_tensors(lambda s: s.update({_first(s, "lora_A"): torch.zeros(8, 63)})),
        "do not fit the base layer",
    ),
    "missing_b": (
        _edit_tensors(lambda s: s.pop(_first(s, "lora_B"))),
        "lacks its lora_A or lora_B",
    ),
    "no_config": (lambda p: os.remove(os.path.join(p, "adapter_config.json")), "no adapter_config"),
}  # fmt: skip


@pytest.mark.parametrize("case", list(BAD))
def test_bad_adapter_is_refused_and_the_engine_goes_on(lora_env, tmp_path, case):
    bases, adapters = lora_env
    change, message = BAD[case]
    path = _broken(adapters, tmp_path, change)
    llm = _llm(bases["llama"])
    with pytest.raises(LoRAError, match=message) as e:
        llm.generate([[5, 6, 7]], GREEDY, lora_request=LoRARequest("bad", 9, path))
    assert "'bad'" in str(e.value)
    out = llm.generate([[5, 6, 7]], GREEDY, lora_request=_req(adapters, "attn8"))
    assert len(out[0].outputs[0].token_ids) == NEW
    assert llm.engine.block_pool.num_free == llm.engine.block_pool.num_blocks


def test_lora_not_enabled_is_a_clear_error(lora_env):
    bases, adapters = lora_env
    llm = LLM(bases["llama"], num_kv_blocks=32, max_model_len=128)
    from serverless_llm.engine import InvalidRequestError

    with pytest.raises(InvalidRequestError, match="LoRA is not enabled"):
        llm.generate([[5, 6]], GREEDY, lora_request=_req(adapters, "attn8"))


def test_adapter_from_the_hub_cache(lora_env, tmp_path):
    """A hub repo id as the path: read from the cache under download_dir (offline here); a repo
    not in the cache is that adapter's error."""
    from pathlib import Path

    from tests.engine.test_loader import populate_hub_cache

    bases, adapters = lora_env
    cache = tmp_path / "hub"
    populate_hub_cache(cache, "someone/attn8-adapter", Path(adapters["attn8"]), "c" * 40)
    llm = _llm(bases["llama"], download_dir=str(cache))
    prompts = family_prompts(len(build_tokenizer()))[:3]
    hubbed = LoRARequest("hubbed", 5, "someone/attn8-adapter")
    got = llm.generate(prompts, GREEDY, lora_request=hubbed)
    want = llm.generate(prompts, GREEDY, lora_request=_req(adapters, "attn8"))
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    with pytest.raises(LoRAError, match="'missing'.*not in the cache"):
        llm.generate(prompts, GREEDY, lora_request=LoRARequest("missing", 6, "someone/nothing"))


def test_cpu_step_picks_the_padded_form_for_small_steps():
    """LoRAStep lays out the padded form while slots spanned x the most rows of one slot is at
    most PADDED_MAX_ROWS, and leaves large steps to the masked form; the Triton path never
    gets a layout."""
    from serverless_llm.engine.layers.lora_linear import PADDED_MAX_ROWS, LoRAStep

    def token_slots(groups, n):
        t = torch.full((n,), -1)
        for s, rows in groups:
            t[rows] = s
        return t

    step = LoRAStep(num_slots=4, masked=True)
    m = PADDED_MAX_ROWS // 4
    small = [(s, slice(s * m, (s + 1) * m)) for s in range(4)]
    step.set(small, token_slots(small, 4 * m))
    assert step.padded is not None and step.padded.rows == PADDED_MAX_ROWS
    large = [(0, slice(0, m + 1)), (3, slice(m + 1, m + 2))]  # 4 slots spanned x (m + 1) rows
    step.set(large, token_slots(large, m + 2))
    assert step.padded is None
    step.clear()
    assert step.padded is None
    kernels = LoRAStep(num_slots=4, masked=True, use_kernels=True)
    kernels.set(small, token_slots(small, 4 * m))
    assert kernels.padded is None
