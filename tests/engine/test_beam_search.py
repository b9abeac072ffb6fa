"""Beam search on the tiny random Llama: the same sequences as transformers' beam search, its
parameters' rules, and no KV block left behind (finished, aborted, cache too small to fork)."""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import itertools
import random

import pytest
import torch
import transformers

from serverless_llm import LLM, SamplingParams
from serverless_llm.engine.async_engine import AsyncEngine
from serverless_llm.engine.sampling.params import SamplingParamsError
from serverless_llm.llm import BeamSearchParams
from tests.engine.reference import hf_model
from tests.step_gate import StepGate
from tests.tiny_models import build_tiny_model

VOCAB = 384  # the tiny tokenizer's


@pytest.fixture(scope="module")
def llm(tiny_llama):
    return LLM(tiny_llama, num_kv_blocks=256, block_size=16, max_model_len=256, max_num_seqs=64)


def pool_full(llm: LLM) -> bool:
    pool = llm.engine.block_pool
    return pool.num_free == pool.num_blocks and not llm.engine.requests


def hf_beam_search(
    path: str,
    prompt: list[int],
    *,
    width: int,
    n: int,
    eos: list[int],
    max_new_tokens: int,
    length_penalty: float = 1.0,
    early_stopping: bool | str = False,
    min_new_tokens: int = 0,
) -> list[list[int]]:
    """transformers' `generate(num_beams=...)`: the n sequences, each cut after its EOS."""
    model = hf_model(path)
    config = copy.deepcopy(model.generation_config)
    config.update(
        eos_token_id=eos,
        pad_token_id=0,
        max_new_tokens=max_new_tokens,
        num_beams=width,
        num_return_sequences=n,
        length_penalty=length_penalty,
        early_stopping=early_stopping,
        do_sample=False,
        min_new_tokens=min_new_tokens or None,
    )
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=config)
    sequences = []
    for row in out.tolist():
        generated = row[len(prompt) :]
        ends = [i for i, t in enumerate(generated) if t in eos]
        sequences.append(generated[: ends[0] + 1] if ends else generated)
    return sequences


def beam_params(**kw) -> SamplingParams:
    return SamplingParams(use_beam_search=True, temperature=0.0, **kw)


@pytest.fixture(scope="module")
def eos_model(tmp_path_factory) -> str:
    """The tiny Llama with EOS made likely (its output row points along the mean final hidden
    state: EOS is the top token about 15% of the time), so beams finish at all lengths and the
    early-stopping rules decide when searches end."""
    path = build_tiny_model(str(tmp_path_factory.mktemp("eos-model")), "llama")
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    rng = random.Random(0)
    ids = torch.tensor([[rng.randrange(5, VOCAB) for _ in range(256)] for _ in range(4)])
    with torch.no_grad():
        mean = model.model(ids).last_hidden_state.reshape(-1, model.config.hidden_size).mean(0)
        model.lm_head.weight[model.config.eos_token_id] = 2.5 * mean / mean.norm() ** 2
    model.save_pretrained(path)
    return path


def test_beam_search_equals_transformers(eos_model):
    """Widths 2 and 4, length_penalty 0.5/1/2, early_stopping True/False/"never", each with EOS
    (K = 2w candidates), EOS and a stop id (K = 3w), min_tokens, and ignore_eos with a stop id;
    n from 1 to the width. Every search runs in one batch, so beams of different requests
    share the engine's steps."""
    llm = LLM(eos_model, num_kv_blocks=256, block_size=16, max_model_len=256, max_num_seqs=64)
    eos = llm.get_tokenizer().eos_token_id
    rng = random.Random(0)
    cases = []
    for mode in ("eos", "eos and a stop id", "min_tokens", "ignore_eos and a stop id"):
        prompt = [rng.randrange(5, VOCAB) for _ in range(rng.randint(3, 24))]
        free = hf_beam_search(eos_model, prompt, width=2, n=1, eos=[VOCAB + 1], max_new_tokens=4)
        stop = next(t for t in free[0] if t != eos)
        for i, (width, lp, es) in enumerate(
            itertools.product((2, 4), (0.5, 1.0, 2.0), (True, False, "never"))
        ):
            kw = dict(
                best_of=width,
                n=1 + i % width,
                length_penalty=lp,
                early_stopping=es,
                max_tokens=8 + i % 13,
            )
            hf_eos = [eos]
            if "stop id" in mode:
                kw["stop_token_ids"] = [stop]
                hf_eos = [stop] if mode.startswith("ignore_eos") else [eos, stop]
            if mode.startswith("ignore_eos"):
                kw["ignore_eos"] = True
            if mode == "min_tokens":
                kw["min_tokens"] = 1 + i % 4
            cases.append((prompt, beam_params(**kw), hf_eos))

    engine = llm.engine
    roots = [engine.add_request(prompt, params) for prompt, params, _ in cases]
    while engine.has_unfinished_requests():
        engine.step()
    ended = {"stop": 0, "length": 0}
    early = set()  # early_stopping values of searches that ended before max_tokens
    for (prompt, params, hf_eos), root in zip(cases, roots):
        want = hf_beam_search(
            eos_model,
            prompt,
            width=params.best_of,
            n=params.n,
            eos=hf_eos,
            max_new_tokens=params.max_tokens,
            length_penalty=params.length_penalty,
            early_stopping=params.early_stopping,
            min_new_tokens=params.min_tokens,
        )
        got = [o.new_token_ids for o in root.beam.outputs]
        assert got == want, (prompt, params)
        if root.beam.search.num_generated < params.max_tokens:
            early.add(params.early_stopping)
        for out in root.beam.outputs:
            ended[out.finish_reason] += 1
            last = out.new_token_ids[-1]
            if out.finish_reason == "stop":
                assert last in hf_eos and out.stop_reason == (None if last == eos else last)
                assert len(out.new_token_ids) >= params.min_tokens + 1
            else:
                assert len(out.new_token_ids) == params.max_tokens and out.stop_reason is None
    assert ended["stop"] >= 50 and ended["length"] >= 20, ended
    assert early == {True, False, "never"}
    assert pool_full(llm)


def test_outputs_text_logprobs_and_prompt_logprobs(llm):
    """The text is the decode of the tokens (the stop token's left out unless asked for); the
    logprobs and ranks are the model's own, the cumulative logprob their sum."""
    tok = llm.get_tokenizer()
    prompt = tok.encode("Once upon a time")
    free = llm.generate([prompt], beam_params(best_of=3, max_tokens=4, ignore_eos=True))[0]
    stop = free.outputs[0].token_ids[2]
    params = beam_params(
        best_of=3, n=3, max_tokens=10, stop_token_ids=[stop], logprobs=2, prompt_logprobs=1
    )
    (result,) = llm.generate([prompt], params)
    assert [o.index for o in result.outputs] == [0, 1, 2]
    assert len(result.prompt_logprobs) == len(prompt) and result.prompt_logprobs[0] is None
    assert any(o.finish_reason == "stop" for o in result.outputs)
    for out in result.outputs:
        shown = out.token_ids[:-1] if out.finish_reason == "stop" else out.token_ids
        assert out.text == tok.decode(shown)
        assert len(out.logprobs) == len(out.token_ids)
        assert all(
            token in pos and len(pos) <= 3 for token, pos in zip(out.token_ids, out.logprobs)
        )
        total = sum(pos[token].logprob for token, pos in zip(out.token_ids, out.logprobs))
        assert out.cumulative_logprob == pytest.approx(total, abs=1e-4)
        # The same tokens fed back as a prompt have the same logprobs and ranks.
        check = llm.generate(
            [prompt + out.token_ids], SamplingParams(max_tokens=1, prompt_logprobs=0)
        )[0].prompt_logprobs[len(prompt) :]
        for want, token, got in zip(check, out.token_ids, out.logprobs):
            assert got[token].logprob == pytest.approx(want[token].logprob, abs=1e-4)
            assert got[token].rank == want[token].rank
    again = llm.generate(
        [prompt], dataclasses.replace(params, logprobs=None, include_stop_str_in_output=True)
    )[0]
    for out, kept in zip(result.outputs, again.outputs):
        assert kept.token_ids == out.token_ids and kept.logprobs is None
        assert kept.text == tok.decode(out.token_ids)


def test_llm_beam_search_api(llm):
    """vLLM's `LLM.beam_search`: every beam, prompt tokens included, best first."""
    prompt = llm.get_tokenizer().encode("Hello world")
    outs = llm.beam_search(
        [{"prompt": "Hello world"}, prompt], BeamSearchParams(beam_width=3, max_tokens=5)
    )
    want = llm.generate([prompt], beam_params(n=3, max_tokens=5))[0].outputs
    for out in outs:
        assert [s.tokens for s in out.sequences] == [prompt + w.token_ids for w in want]
        assert [s.text for s in out.sequences] == [w.text for w in want]
        # To float32 rounding: beam_search steps both prompts' beams together (6 rows) and
        # generate one prompt's (3), and on CPU a step's linears take the native few-row kernel
        # or oneDNN by row count (docs/engine.md), which sum in different orders.
        got = [s.cum_logprob for s in out.sequences]
        assert got == pytest.approx([w.cumulative_logprob for w in want], abs=1e-4)


@pytest.mark.parametrize(
    ("kw", "param"),
    [
        (dict(temperature=0.7), "temperature"),
        (dict(temperature=0.0, top_p=0.9), "top_p"),
        (dict(temperature=0.0, top_k=5), "top_k"),
        (dict(temperature=0.0, min_p=0.1), "min_p"),
        (dict(temperature=0.0, repetition_penalty=1.2), "repetition_penalty"),
        (dict(temperature=0.0, logit_bias={5: 1.0}), "logit_bias"),
        (dict(temperature=0.0, stop=["x"]), "stop"),
        (dict(temperature=0.0, early_stopping="sometimes"), "early_stopping"),
        (dict(temperature=0.0, length_penalty=float("nan")), "length_penalty"),
    ],
)
def test_beam_search_refuses_what_it_cannot_honour(kw, param):
    with pytest.raises(SamplingParamsError) as info:
        SamplingParams(use_beam_search=True, **kw)
    assert info.value.param == param and param in str(info.value)


def test_beam_parameters_need_beam_search():
    for kw, param in (
        (dict(length_penalty=2.0), "length_penalty"),
        (dict(early_stopping=True), "early_stopping"),
    ):
        with pytest.raises(SamplingParamsError) as info:
            SamplingParams(**kw)
        assert info.value.param == param
    # Their defaults are fine, and seed is accepted (beam search draws nothing).
    SamplingParams(length_penalty=1.0, early_stopping=False)
    SamplingParams(use_beam_search=True, temperature=0.0, seed=3, early_stopping="never")


def test_split_steps_and_small_cache_give_the_same_beams(llm, tiny_llama):
    """Beams of one step spread over several engine steps (max_num_seqs=3), and a cache so small
    that forking beams runs out of blocks: the same sequences as with room, and every block
    free at the end."""
    rng = random.Random(3)
    prompts = [[rng.randrange(5, VOCAB) for _ in range(rng.randint(10, 40))] for _ in range(4)]
    params = [beam_params(best_of=4, n=2, max_tokens=40, ignore_eos=True) for _ in prompts]
    params.append(SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True))
    prompts.append(prompts[0])
    want = [[o.token_ids for o in r.outputs] for r in llm.generate(prompts, params)]
    for kw in (dict(num_kv_blocks=64, max_num_seqs=3), dict(num_kv_blocks=7, block_size=16)):
        small = LLM(tiny_llama, max_model_len=96, **kw)
        got = [[o.token_ids for o in r.outputs] for r in small.generate(prompts, params)]
        assert got == want, kw
        assert pool_full(small)


def test_abort_frees_every_beam(llm):
    engine = llm.engine
    prompt = list(range(20, 60))
    engine.add_request(prompt, beam_params(best_of=4, n=2, max_tokens=50, ignore_eos=True), "b")
    for _ in range(5):
        assert engine.step() == []
    assert engine.block_pool.num_free < engine.block_pool.num_blocks
    out = engine.abort_request("b")
    assert out.finished and out.finish_reason == "abort" and out.sequences is None
    assert not engine.has_unfinished_requests()
    assert pool_full(llm)


def test_async_engine_beam_search_and_cancel(llm):
    """Through AsyncEngine (the worker's path): one output, at the end, holding the n beams; a
    consumer that stops listening frees every beam's blocks."""
    prompt = list(range(30, 50))
    params = beam_params(best_of=3, n=2, max_tokens=12, ignore_eos=True)
    want = [o.token_ids for o in llm.generate([prompt], params)[0].outputs]

    # The cancelled search is held after its first step (blocks taken, 199 tokens to go), so it
    # is still running when its consumer leaves, however fast the machine.
    gate = StepGate(llm.engine, hold_when=lambda gate: gate.steps >= 1)

    async def main():
        engine = AsyncEngine(llm.engine)
        try:
            outs = [o async for o in engine.generate(prompt, params)]
            gate.install()
            stream = engine.generate(
                prompt, beam_params(best_of=4, max_tokens=200, ignore_eos=True)
            )
            task = asyncio.create_task(stream.__anext__())
            await asyncio.to_thread(gate.wait_held)
            assert llm.engine.block_pool.num_free < llm.engine.block_pool.num_blocks
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            await stream.aclose()
            gate.release()
            deadline = asyncio.get_running_loop().time() + 30  # only against a hang
            while not pool_full(llm) and asyncio.get_running_loop().time() < deadline:
                await asyncio.sleep(0.01)
            return outs
        finally:
            gate.uninstall()
            await engine.shutdown()

    outs = asyncio.run(main())
    assert len(gate.aborted) == 1 and gate.finished == []  # aborted, never finished
    assert len(outs) == 1 and outs[0].finished
    assert [s.new_token_ids for s in outs[0].sequences] == want
    assert outs[0].new_token_ids == want[0]
    assert pool_full(llm)
