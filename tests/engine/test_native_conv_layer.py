"""LFM2's and LFM3's short-convolution layers in one native call a decode step
(`NativeConvLayer`, cpu_native.c's conv_layer_f32): attached to every convolution layer of the
tiny models (LFM2; LFM3 with its sandwich norms and without them, conv bias on), equal bit for
bit to the module path on the same step (outputs and the state slots' windows), and greedy
tokens equal to transformers' and to the module path's under continuous batching, chunked
prefill and preemption, with every state slot back in its pool.

Bit for bit: the native call runs the module path's own native kernels (the panel GEMM at the
same rows, add_norm_f32, conv1d_decode_f32, activation_f32) in the same order, and the two
products (B * x, C * conv) round once each as torch's do, so nothing may differ."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig

from serverless_llm import LLM, SamplingParams
from serverless_llm.engine.kernels import cpu_native
from serverless_llm.engine.models.decoder import DecoderModel, NativeConvLayer, NativeDecodeLayer
from tests.engine.family_check import family_models_fixture, family_prompts
from tests.engine.reference import hf_greedy
from tests.engine.test_families_conv import CONFIGS

NEW = 24
NAMES = ["lfm2", "lfm3", "lfm3_plain"]

family_models = family_models_fixture(CONFIGS)


@pytest.fixture(scope="module")
def kernels():
    k = cpu_native.load()
    if k is None:
        pytest.skip("the native CPU kernels cannot be built here (no C compiler?)")
    return k


@pytest.fixture
def native_rows(monkeypatch):
    """Every linear takes the native kernel up to 8 rows: decode steps of the 8 prompts do."""
    monkeypatch.setenv("NATIVE_LINEAR_ROWS", "8")


@pytest.fixture
def conv_calls(kernels, monkeypatch) -> list[int]:
    """Rows of each native conv_layer call."""
    rows: list[int] = []
    real = kernels.conv_layer
    monkeypatch.setattr(kernels, "conv_layer", lambda *a: rows.append(a[4].shape[0]) or real(*a))
    return rows


def engine(path: str, **kw) -> LLM:
    args = dict(block_size=8, num_kv_blocks=160, max_model_len=256, dtype="float32")
    args.update(kw)
    return LLM(path, **args)


def greedy(llm: LLM, prompts) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params)]


def conv_layers(llm: LLM) -> list:
    return [layer for layer in llm.engine.runner.model.layers if layer.mixer is not None]


def assert_books_whole(llm: LLM) -> None:
    e = llm.engine
    e.kv.check()
    assert e.block_pool.num_free == e.block_pool.num_blocks, "KV blocks leaked"
    assert e.state_pool.num_free == e.state_pool.num_slots - 1, "state slots leaked"


def module_path(llm: LLM) -> None:
    """Every layer of `llm` on its module path from now on (no whole-layer call)."""
    for layer in llm.engine.runner.model.layers:
        layer.native_decode = None


@pytest.fixture(scope="module")
def prompts(family_models) -> list[list[int]]:
    return family_prompts(AutoConfig.from_pretrained(family_models("lfm2")).vocab_size)


@pytest.mark.parametrize("name", NAMES)
def test_every_conv_layer_takes_the_native_call(family_models, kernels, native_rows, name):
    llm = engine(family_models(name))
    convs = conv_layers(llm)
    assert convs and all(isinstance(layer.native_decode, NativeConvLayer) for layer in convs)
    assert all(layer.native_decode.rows == 8 for layer in convs)
    # the attention layers take the attention layer's call (LFM3's with its head gate and
    # sandwich norms): every layer of the step in one native call
    attn = [layer for layer in llm.engine.runner.model.layers if layer.self_attn is not None]
    assert attn and all(isinstance(layer.native_decode, NativeDecodeLayer) for layer in attn)
    assert all(layer.native_decode.rows == 8 for layer in attn)


@pytest.mark.parametrize("name", NAMES)
def test_native_conv_layer_equals_the_module_path_bit_for_bit(
    family_models, kernels, native_rows, monkeypatch, prompts, name
):
    """Each native call is checked on the spot against the module path run on the same inputs
    from the same state slots: both outputs and every slot's window equal exactly."""
    checked = []
    real = NativeConvLayer.__call__

    def both(self, layer, x, residual, rope, state, meta):
        before = state[0].clone()
        got = real(self, layer, x, residual, rope, state, meta)
        after = state[0].clone()
        state[0].copy_(before)
        nd, layer.native_decode = layer.native_decode, None
        try:
            want = layer.forward(x, residual, rope, state, meta)
        finally:
            layer.native_decode = nd
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
        assert torch.equal(after, state[0])
        assert not torch.equal(after, before)  # the call did move the windows
        checked.append(x.shape[0])
        return got

    monkeypatch.setattr(NativeConvLayer, "__call__", both)
    llm = engine(family_models(name))
    greedy(llm, prompts)
    assert checked and max(checked) == len(prompts)  # up to all 8 rows at once
    assert_books_whole(llm)


@pytest.mark.parametrize("name", NAMES)
def test_tokens_equal_transformers_and_the_module_path(
    family_models, kernels, native_rows, conv_calls, prompts, name, monkeypatch
):
    decode_steps = []  # rows of each decode-only step
    real = DecoderModel.forward

    def forward(self, input_ids, positions, kv_caches, meta, *a, **kw):
        first = meta[0] if isinstance(meta, list) else meta
        if first.num_decodes == input_ids.shape[0]:
            decode_steps.append(input_ids.shape[0])
        return real(self, input_ids, positions, kv_caches, meta, *a, **kw)

    monkeypatch.setattr(DecoderModel, "forward", forward)
    path = family_models(name)
    want = [hf_greedy(path, p, NEW) for p in prompts]
    llm = engine(path)
    assert greedy(llm, prompts) == want
    # every conv layer of every decode-only step, natively
    assert decode_steps and conv_calls == [rows for rows in decode_steps for _ in conv_layers(llm)]
    assert_books_whole(llm)
    del conv_calls[:]
    module_path(llm)
    assert greedy(llm, prompts) == want
    assert not conv_calls
    assert_books_whole(llm)


@pytest.mark.parametrize("name", ["lfm2", "lfm3"])
@pytest.mark.parametrize(
    "kw",
    [
        dict(max_num_batched_tokens=7, max_num_seqs=4),  # chunked prefill beside decodes
        dict(num_kv_blocks=20, max_model_len=128, max_num_batched_tokens=32),  # preemption
    ],
    ids=["chunked", "preempted"],
)
def test_continuous_batching_chunks_and_preemption(
    family_models, kernels, native_rows, conv_calls, prompts, name, kw
):
    """Requests joining and leaving, prompts in chunks of up to 7 tokens beside decodes (those
    steps take the module path; the decode-only steps the native call), and preemption (slots
    freed, the requests recomputed later): transformers' tokens, every slot freed."""
    path = family_models(name)
    want = [hf_greedy(path, p, NEW) for p in prompts]
    if "num_kv_blocks" in kw and name == "lfm3":  # two attention groups: 30 blocks a request
        kw = {**kw, "num_kv_blocks": 40}
    llm = engine(path, **kw)
    assert greedy(llm, prompts) == want
    assert conv_calls  # some decode-only steps ran natively
    if "num_kv_blocks" in kw:
        assert llm.engine.scheduler.num_preemptions > 0
    assert_books_whole(llm)
