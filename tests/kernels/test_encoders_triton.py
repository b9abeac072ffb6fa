"""Encoders end to end on the Triton backend (the interpreter on CPU, see conftest.py): the
paged kernel's DENSE_KV + BIDIRECTIONAL path (with ModernBERT's two-sided windows) and the
LayerNorm kernel, against transformers' pooled hidden states over a ragged batch."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
import transformers

pytest.importorskip("triton")

from serverless_llm.llm import LLM  # noqa: E402
from tests.tiny_encoders import build_tiny_encoder  # noqa: E402
from tests.tiny_models import CORPUS  # noqa: E402

TEXTS = ["hello", CORPUS[0], CORPUS[2] + " " + CORPUS[7]]


@pytest.mark.parametrize("kind", ["bert", "modernbert"])
def test_encoder_on_triton_backend(tmp_path, kind):
    path = build_tiny_encoder(str(tmp_path / kind), kind)
    llm = LLM(path, dtype="float32", attention_backend="triton")
    assert llm.engine.backend.name == "triton"
    outs = llm.embed(TEXTS)
    tok = transformers.AutoTokenizer.from_pretrained(path)
    ref = transformers.AutoModel.from_pretrained(path).eval()
    for text, out in zip(TEXTS, outs):
        with torch.no_grad():
            h = ref(**tok(text, return_tensors="pt")).last_hidden_state[0]
        want = F.normalize(h[0], dim=-1)
        torch.testing.assert_close(torch.tensor(out.outputs.embedding), want, atol=1e-4, rtol=1e-4)
