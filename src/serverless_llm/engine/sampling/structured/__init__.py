"""Structured output: JSON schema, regex, choice and grammar constraints over xgrammar.

Three modules, one job each, each usable on its own:

- `spec`: `StructuredOutputSpec`, what a request asks for, validated, hashable (the cache key).
  Built from vLLM's request fields (`guided_json`, `guided_regex`, `guided_choice`,
  `guided_grammar`, `guided_whitespace_pattern`, `guided_decoding_backend`, `response_format`,
  and the newer `structured_outputs` / `guided_decoding` dicts) by
  `StructuredOutputSpec.from_request`; `StructuredOutputError` names the field at fault.
- `grammar`: `GrammarCompiler`, one per engine, built from the tokenizer. Compiles a spec into a
  `CompiledGrammar` (an LRU cache keyed by the spec; compilation of one spec is shared by the
  requests waiting for it) in a compile process (`compile_pool`, running `compile_worker`),
  with a time limit, a size limit and abandonment; `compile_async` never blocks.
  `GrammarMatcher`: one per sequence. Fills its row of the batch's token bitmask before a step
  and accepts the sampled token after it.
- `bitmask`: the batch's token bitmask: `allocate_bitmask`, `fill_bitmasks` (every matcher's
  row) and `apply_bitmask` (disallowed logits to -inf).

`xgrammar_import` holds the xgrammar import: a runtime dependency, its absence reported at first
use.
"""
