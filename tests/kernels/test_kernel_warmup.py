"""The warm-up's list of kernel specialisations (engine/kernel_warmup.py) holds every launch real
requests make: tiny models of each kernel family run requests on the Triton backend (the
interpreter on CPU) with every launch recorded by Triton's own binder, and each recorded
specialisation must be one the sweep listed. A launcher that starts launching a specialisation
the sweep cannot reach is caught the same way."""

from __future__ import annotations

import pytest

pytest.importorskip("triton")

import transformers  # noqa: E402

from serverless_llm import LLM, LoRARequest, SamplingParams  # noqa: E402
from serverless_llm.engine.kernel_warmup import (  # noqa: E402
    SweepLimits,
    list_launches,
    sweep_steps,
    sweep_tables,
    table_widths,
)
from serverless_llm.engine.kernels import rms_norm  # noqa: E402
from serverless_llm.engine.kernels.launch_keys import record_launches, spec_of  # noqa: E402
from tests.engine.family_check import save_family_model, tiny_dims  # noqa: E402
from tests.tiny_models import build_tokenizer  # noqa: E402

# Prompts of 1-60 tokens through a 16-token step budget: decodes, whole prompts, chunks over a
# context, and steps mixing them.
PROMPT_LENGTHS = (1, 4, 9, 17, 30, 60)
LIMITS = dict(max_model_len=96, max_num_batched_tokens=16, max_num_seqs=4)


def _llm(path: str, **kw) -> LLM:
    return LLM(path, attention_backend="triton", dtype="float32", block_size=8,
               num_kv_blocks=96, **LIMITS, **kw)  # fmt: skip


def _listed(llm: LLM) -> set:
    e = llm.engine
    limits = SweepLimits(e.max_num_batched_tokens, LIMITS["max_num_seqs"], e.max_model_len)
    return set(list_launches(e.runner, limits))


def _served(llm: LLM, **kw) -> set:
    prompts = [[5 + (7 * i) % 90 for i in range(n)] for n in PROMPT_LENGTHS]
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    with record_launches() as rec:
        llm.generate(prompts, params, **kw)
    return set(rec.specs)


def _assert_listed(served: set, listed: set) -> None:
    assert served, "no Triton launch recorded: the model did not run its kernels"
    missing = sorted(s.label() for s in served - listed)
    assert not missing, f"{len(missing)} launches not in the warm-up's list:\n" + "\n".join(missing)


def _family(tmp_path, name: str) -> str:
    tok = build_tokenizer()
    configs = {
        "dense": lambda: transformers.LlamaConfig(**tiny_dims(tok)),
        # a sliding window shorter than the prompts: the window variant of the attention kernel
        "sliding": lambda: transformers.MistralConfig(**tiny_dims(tok), sliding_window=24),
        # soft-capped scores (Gemma 2) and its own norms and activation
        "softcap": lambda: transformers.Gemma2Config(
            **tiny_dims(tok),
            attn_logit_softcapping=50.0,
            final_logit_softcapping=30.0,
            query_pre_attn_scalar=16,
            sliding_window=24,
            head_dim=16,
        ),  # fmt: skip
        "moe": lambda: transformers.Qwen2MoeConfig(
            **tiny_dims(tok),
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=32,
        ),  # fmt: skip
    }
    return save_family_model(str(tmp_path / name), configs[name]())


@pytest.mark.parametrize("name", ["dense", "sliding", "softcap", "moe"])
def test_served_launches_are_listed(tmp_path, name):
    llm = _llm(_family(tmp_path, name))
    listed = _listed(llm)
    _assert_listed(_served(llm), listed)


def test_lora_launches_are_listed(tmp_path):
    pytest.importorskip("peft")
    from tests.lora_adapters import make_adapter

    base = _family(tmp_path, "dense")
    adapter = make_adapter(base, str(tmp_path / "adapter"), 8, 16, ["q_proj", "down_proj"])
    llm = _llm(base, enable_lora=True, max_lora_rank=8)
    listed = _listed(llm)
    served = _served(llm, lora_request=LoRARequest("a", 1, adapter))
    assert any(s.name == "_moe_gemm_kernel" for s in served)  # LoRA's grouped GEMM ran
    _assert_listed(served, listed)


def test_unlisted_specialisation_is_caught(tmp_path, monkeypatch):
    """A launcher that starts launching a specialisation the sweep never reaches (here the
    RMSNorm launcher, with more warps once a step holds more than the sweep's steps do) fails
    the check: the served launch is not in the list."""
    llm = _llm(_family(tmp_path, "dense"))
    listed = _listed(llm)
    real_shape = rms_norm.row_launch_shape

    def drifted(n_cols: int):
        block, warps = real_shape(n_cols)
        return block, warps * 2

    monkeypatch.setattr(rms_norm, "row_launch_shape", drifted)
    served = _served(llm)
    new = {s for s in served - listed}
    assert new and all(s.name == "_rms_norm_kernel" for s in new)
    with pytest.raises(AssertionError, match="not in the warm-up's list"):
        _assert_listed(served, listed)


def test_spec_is_tritons_binder():
    """The recorded specialisation is Triton's own: a tensor's type and its 16-byte alignment,
    ints as constants when 1, 'D' when a multiple of 16, constexprs by value."""
    import torch

    from serverless_llm.engine.kernels import triton_common

    x = torch.zeros(64, dtype=torch.float16)
    fn = rms_norm._rms_norm_kernel
    fn = fn.fn if hasattr(fn, "fn") else fn
    names = list(fn.__code__.co_varnames[: fn.__code__.co_argcount])
    block, warps = triton_common.row_launch_shape(32)
    args = {n: 0 for n in names}
    for n in names:
        if n.endswith("_ptr"):
            args[n] = x
    args["HAS_RESIDUAL"], args["BLOCK"] = False, block
    aligned = spec_of(fn, tuple(args.values()), {"num_warps": warps})
    args = {n: (x[1:] if n.endswith("_ptr") else v) for n, v in args.items()}
    ints = [n for n in names if not n.endswith("_ptr") and n not in ("HAS_RESIDUAL", "BLOCK")]
    args.update({n: 1 for n in ints})
    other = spec_of(fn, tuple(args.values()), {"num_warps": warps})
    i = names.index("x_ptr")
    assert aligned.specialization[i] == ("*fp16", "D") and other.specialization[i] == ("*fp16", "")
    j = names.index(ints[0])
    assert other.specialization[j] == ("constexpr", 1)
    assert aligned.specialization[names.index("BLOCK")] == ("constexpr", block)


def test_sweep_shapes():
    steps = sweep_steps(SweepLimits(token_budget=16, max_num_seqs=4, max_model_len=96))
    assert all(sum(q) <= 16 and len(q) <= 4 and max(s) <= 96 for q, s in steps)
    assert ([1], [96]) in steps and ([16], [16]) in steps  # a decode at the longest context
    assert any(len(q) == 4 and q[0] == 1 and q[-1] > 1 for q, _ in steps)  # mixed
    assert table_widths(1) == [1, 2, 16] and table_widths(16) == [16, 17]
    tables = sweep_tables(SweepLimits(token_budget=16, max_num_seqs=4, max_model_len=96), 8)
    # never narrower than the step needs; the one-block width with steps of short requests
    assert all(w >= -(-max(s) // 8) for _, s, w in tables)
    assert ([1, 1, 1, 1], [8] * 4, 1) in tables and ([1, 2], [8, 2], 1) in tables
