"""DecoderModel's decode loop over whole-layer native calls (`_whole_native_step`): a decode
step whose every layer takes its `NativeDecodeLayer` calls them directly, without the module
call and per-layer branches; a layer with forward hooks (eagle.py's taps), or whose linears were
replaced since (a LoRA wrapper), and those after it, run as modules. Tokens equal
transformers' either way."""

from __future__ import annotations

import pytest
import torch

from serverless_llm import LLM, SamplingParams
from serverless_llm.engine.models.decoder import DecoderLayer
from tests.engine.reference import hf_greedy
from tests.tiny_models import build_tiny_model

PROMPTS = [[5 + (3 * i + 7 * j) % 90 for j in range(n)] for i, n in enumerate((4, 13, 30))]
NEW = 12


@pytest.fixture(scope="module")
def four_layers(tmp_path_factory) -> str:
    return build_tiny_model(str(tmp_path_factory.mktemp("llama4l")), "llama", num_hidden_layers=4)


@pytest.fixture(scope="module")
def want(four_layers) -> list[list[int]]:
    return [hf_greedy(four_layers, p, NEW) for p in PROMPTS]


@pytest.fixture
def native_llm(four_layers, monkeypatch):
    monkeypatch.setenv("NATIVE_LINEAR_ROWS", "8")
    llm = LLM(four_layers, dtype="float32", attention_backend="native", max_model_len=128)
    layers = llm.engine.runner.model.layers
    assert len(layers) == 4 and all(layer.native_decode is not None for layer in layers)
    return llm


def counted_module_calls(monkeypatch) -> list[int]:
    """Rows of each DecoderLayer.forward call (a module-path layer step)."""
    rows: list[int] = []
    real = DecoderLayer.forward

    def forward(self, x, *a, **kw):
        rows.append(x.shape[0])
        return real(self, x, *a, **kw)

    monkeypatch.setattr(DecoderLayer, "forward", forward)
    return rows


def generate(llm) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)]


def test_decode_steps_skip_the_module_path(native_llm, want, monkeypatch):
    rows = counted_module_calls(monkeypatch)
    assert generate(native_llm) == want
    # only the prompt step (all three prompts, 47 rows) went through the modules
    assert rows == [sum(map(len, PROMPTS))] * 4


def test_a_hooked_layer_runs_as_a_module(native_llm, want, monkeypatch):
    layers = native_llm.engine.runner.model.layers
    seen: list[int] = []
    handle = layers[1].register_forward_pre_hook(lambda mod, args: seen.append(args[0].shape[0]))
    rows = counted_module_calls(monkeypatch)
    try:
        got = generate(native_llm)
    finally:
        handle.remove()
    assert got == want
    decode_rows = [r for r in rows if r == len(PROMPTS)]
    assert seen.count(len(PROMPTS)) == NEW - 1  # every decode step reached the hook
    assert len(decode_rows) == 4 * (NEW - 1)  # every layer of it as a module


class Wrapper(torch.nn.Module):
    """A stand-in for a LoRA wrapper: the same output, another module."""

    def __init__(self, inner: torch.nn.Module) -> None:
        super().__init__()
        self.inner = inner
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        return self.inner(x)


def test_a_replaced_linear_sends_its_layer_and_later_ones_to_modules(native_llm, want, monkeypatch):
    layers = native_llm.engine.runner.model.layers
    wrapped = Wrapper(layers[1].self_attn.o_proj)
    layers[1].self_attn.o_proj = wrapped
    rows = counted_module_calls(monkeypatch)
    got = generate(native_llm)
    assert got == want
    # each decode step: layer 1 (its per-op path: the wrapper runs) and the layers after it
    # as modules, layer 0 native
    assert wrapped.calls == 1 + (NEW - 1)
    assert [r for r in rows if r == len(PROMPTS)] == [len(PROMPTS)] * 3 * (NEW - 1)
