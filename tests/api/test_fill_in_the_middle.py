"""`suffix` on /v1/completions (issue 15): a fill-in-the-middle prompt where the model has FIM
tokens, a clear 400 where it has none."""

from __future__ import annotations

import pytest

from serverless_llm.api.openai.completions import FIM_FORMATS, fim_prompt, fim_token_ids
from tests.tiny_models import build_tokenizer


@pytest.mark.parametrize("tokens", FIM_FORMATS[:3])
def test_fim_tokens_are_found_and_the_prompt_is_prefix_suffix_middle(tokens):
    tok = build_tokenizer()
    assert fim_token_ids(tok) is None  # the tiny tokenizer has no FIM tokens
    tok.add_special_tokens({"additional_special_tokens": list(tokens)})
    fim = fim_token_ids(tok)
    assert fim is not None and tok.convert_ids_to_tokens(list(fim)) == list(tokens)
    prefix = tok.encode("def add(a, b):\n    return ", add_special_tokens=False)
    ids = fim_prompt(tok, fim, prefix, "\n\nprint(add(1, 2))")
    pre, suf, mid = fim
    assert ids[0] == pre and ids[-1] == mid and ids.count(suf) == 1
    assert ids[1 : ids.index(suf)] == prefix
    assert tok.decode(ids[ids.index(suf) + 1 : -1]) == "\n\nprint(add(1, 2))"
    # A BOS the tokenizer put first stays first, before the prefix marker.
    if tok.bos_token_id is not None:
        with_bos = fim_prompt(tok, fim, [tok.bos_token_id, *prefix], "x")
        assert with_bos[:2] == [tok.bos_token_id, pre]
