"""End to end on CPU: the tiny models generate the same greedy tokens with every kernel in
Triton (attention, KV write, RMSNorm, and rotary/SiLU where the model routes them) under the
interpreter as with the torch path (compiled, on the GPU, where there is one). Chunked prefill with a small token budget makes steps that
mix decodes and prefill chunks over contexts of several blocks; Mistral brings a sliding window
(24) shorter than the prompts."""

from __future__ import annotations

import pytest

pytest.importorskip("triton")

from serverless_llm import LLM, SamplingParams  # noqa: E402

PROMPTS = [
    "The quick brown fox jumps over the lazy dog. Hello world!",
    "Paged attention stores keys and values in fixed-size blocks.",
    "Once upon a time",
    "Café, naïve, résumé, über, smörgåsbord, crème brûlée. def add(a, b): return a + b",
]


def _generate(path: str, backend: str) -> tuple[str, list[list[int]]]:
    llm = LLM(
        path,
        attention_backend=backend,
        dtype="float32",
        num_kv_blocks=64,
        block_size=8,
        max_model_len=256,
        max_num_batched_tokens=24,
    )
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    outs = llm.generate(PROMPTS, params)
    assert max(len(o.prompt_token_ids) for o in outs) > 32  # past the window, several blocks
    return llm.engine.backend.name, [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("kind", ["llama", "mistral"])
def test_triton_backend_matches_torch_greedy(tiny_model_dirs, monkeypatch, kind):
    path = tiny_model_dirs[kind]
    monkeypatch.delenv("ATTENTION_BACKEND", raising=False)
    name, expected = _generate(path, "torch")
    assert name == "torch"
    monkeypatch.setenv("ATTENTION_BACKEND", "triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    name, tokens = _generate(path, "auto")  # auto yields to the env var
    assert name == "triton"
    assert tokens == expected
