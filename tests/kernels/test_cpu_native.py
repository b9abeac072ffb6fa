"""The native CPU kernels (kernels/cpu_native.c) against their torch references: the attention
step (q/k preparation, KV write, decode attention) in every option the decoder hands it, the
residual-add norms, the native GEMM (weights in panels) and its choice by measurement; the build cache, the
fallbacks (no compiler, a failed self-check) and the backend choice; and whole models on the
native backend equal to the torch backend's tokens and to transformers'."""

from __future__ import annotations

import logging

import pytest
import torch

from serverless_llm.engine.config import ConfigError
from serverless_llm.engine.kernels import cpu_native
from serverless_llm.engine.kernels.cpu_native import (
    LayerPrep,
    add_norm_reference,
    make_layer,
    make_step,
    native_cache_ok,
    prepare_reference,
)
from serverless_llm.engine.kernels.kv_write import reshape_and_cache_reference
from serverless_llm.engine.kernels.metadata import AttentionMetadata, AttentionSpec
from serverless_llm.engine.kernels.paged_attention import paged_attention_reference
from serverless_llm.engine.kv_cache import layer_view
from serverless_llm.engine.layers.attention import NativeCpuBackend, TorchAttentionBackend
from serverless_llm.engine.model_builder import make_attention_backend

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def kernels():
    k = cpu_native.load()
    assert k is not None, "the native CPU kernels did not build (is a C compiler installed?)"
    return k


def ragged_step(lens, qlens, block_size, num_blocks, g, pad_rows=0):
    """Metadata of decodes then prefills (query lengths `qlens`), random distinct blocks; plus
    `pad_rows` padding decode rows (slot -1, one key in block 0) after the real decodes."""
    need = [-(-n // block_size) for n in lens]
    perm = torch.randperm(num_blocks - 1, generator=g) + 1  # block 0 stays for padding
    tables = torch.zeros(len(lens) + pad_rows, max(need), dtype=torch.int32)
    at = 0
    for i, k in enumerate(need):
        tables[i, :k] = perm[at : at + k]
        at += k
    nd = sum(1 for q in qlens if q == 1)
    order = list(range(nd)) + [None] * pad_rows + list(range(nd, len(lens)))
    slots, positions, seq, ql, rows = [], [], [], [], []
    for i in order:
        if i is None:
            slots.append(-1)
            positions.append(0)
            seq.append(1)
            ql.append(1)
            rows.append(tables.new_zeros(tables.shape[1]))
            continue
        n, q = lens[i], qlens[i]
        for p in range(n - q, n):
            slots.append(int(tables[i, p // block_size]) * block_size + p % block_size)
            positions.append(p)
        seq.append(n)
        ql.append(q)
        rows.append(tables[i])
    qsl = [0]
    for q in ql:
        qsl.append(qsl[-1] + q)
    meta = AttentionMetadata(
        query_start_loc=torch.tensor(qsl, dtype=torch.int32),
        seq_lens=torch.tensor(seq, dtype=torch.int32),
        context_lens=torch.tensor([s - q for s, q in zip(seq, ql)], dtype=torch.int32),
        block_tables=torch.stack(rows),
        slot_mapping=torch.tensor(slots),
        num_decodes=nd + pad_rows,
        max_query_len=max(ql),
        max_seq_len=max(seq),
        query_lens_host=ql,
        seq_lens_host=seq,
        block_size=block_size,
    )
    return meta, torch.tensor(positions)


def rope_table(rot_dim, g, max_pos=128):
    angles = torch.rand(max_pos, rot_dim // 2, generator=g) * 6.3
    return torch.cat([angles.cos(), angles.sin()], dim=-1)


CASES = {
    # name: (H, KVH, D, prep options, spec options)
    "llama-gqa": (8, 2, 32, dict(rope="full"), {}),
    "mha-no-rope": (4, 4, 16, {}, {}),
    "gptj-partial": (4, 4, 32, dict(rope=8, is_neox=False), {}),
    "neox-partial": (6, 2, 32, dict(rope=16), {}),
    "qk-norm-head": (4, 2, 16, dict(rope="full", qk_norm="rms_head"), {"sliding_window": 6}),
    "qk-norm-full": (4, 2, 16, dict(rope="full", qk_norm="rms_full"), {}),
    "qk-layer-head": (4, 2, 16, dict(rope=8, is_neox=False, qk_norm="layer_head"), {}),
    "qk-layer-shared": (4, 4, 16, dict(rope=8, qk_norm="layer_head_shared"), {}),
    "clip-alibi": (4, 4, 16, dict(clip=1.5), {"alibi": True}),
    "softcap-window": (4, 1, 16, dict(rope="full"), {"logit_softcap": 2.5, "sliding_window": 9}),
    # groups of 3 and 5 query heads a KV head (key dots in threes and twos) and head sizes past
    # a multiple of 16 (the weighted values' last D % 16 outputs a row at a time)
    "gqa3-d24": (6, 2, 24, dict(rope="full"), {}),
    "gqa5-d40": (10, 2, 40, {}, {"sliding_window": 7}),
}


def make_case(name, g):
    H, KVH, D, popt, sopt = CASES[name]
    popt, sopt = dict(popt), dict(sopt)
    rope = popt.pop("rope", None)
    if rope is not None:
        popt["rope"] = rope_table(D if rope == "full" else rope, g)
    norm = popt.get("qk_norm")
    if norm == "rms_head":
        popt["q_norm"], popt["k_norm"] = torch.rand(D, generator=g) + 0.5, torch.rand(D) + 0.5
    elif norm in ("rms_full", "layer_head"):
        popt["q_norm"] = torch.rand(H, D, generator=g).flatten(-2 if norm == "rms_full" else -1)
        popt["k_norm"] = torch.rand(KVH, D, generator=g).flatten(-2 if norm == "rms_full" else -1)
        popt["q_norm"], popt["k_norm"] = popt["q_norm"] + 0.5, popt["k_norm"] + 0.5
    elif norm == "layer_head_shared":
        popt["q_norm"], popt["k_norm"] = torch.rand(D, generator=g) + 0.5, torch.rand(D) + 0.5
        popt["q_norm_bias"], popt["k_norm_bias"] = torch.randn(D, generator=g), torch.randn(D)
    if sopt.pop("alibi", False):
        sopt["alibi_slopes"] = torch.rand(H, generator=g)
    return AttentionSpec(H, KVH, D, D**-0.5, **sopt), LayerPrep(**popt)


def layer_cache(layout, num_blocks, block_size, KVH, D, g):
    """(a layer's cache [2, blocks, block_size, KVH, D], the wider tensor it is a view of or
    None): head-major (the torch backend's), token-major, or a `layer_view` of a wider
    head-major tensor, with its heads inside the wider heads (Gemma 4's sliding layers in the
    global layers' entries) or packed at each block's start (heads that do not nest)."""
    if layout == "token-major":
        return torch.randn(2, num_blocks, block_size, KVH, D, generator=g), None
    heads, dim = {"head-major": (KVH, D), "nested": (KVH + 1, 2 * D), "packed": (2 * KVH, D // 2)}[
        layout
    ]
    wide = torch.randn(2, num_blocks, heads, block_size, dim, generator=g).transpose(2, 3)
    if layout == "head-major":
        return wide, None
    return layer_view(wide, KVH, D), wide


LAYOUTS = ["head-major", "token-major", "nested", "packed"]


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("block_size", [4, 16])
def test_attention_step_matches_the_references(kernels, name, block_size, layout):
    """Every cache layout is read and written in place at its own strides (a layer view's
    writes touch nothing of the wider tensor outside the view)."""
    g = torch.Generator().manual_seed(hash((name, block_size)) % 1000)
    spec, prep = make_case(name, g)
    H, KVH, D = spec.num_heads, spec.num_kv_heads, spec.head_dim
    lens, qlens = [1, 5, 17, 40, 9, 23], [1, 1, 1, 1, 9, 4]  # 4 decodes, a prefill, a chunk
    meta, positions = ragged_step(lens, qlens, block_size, 40, g, pad_rows=2)
    T = positions.shape[0]
    qkv = torch.randn(T, (H + 2 * KVH) * D, generator=g) * 2
    cache, wide = layer_cache(layout, 40, block_size, KVH, D, g)
    assert native_cache_ok(cache)
    wide_before = None if wide is None else wide.clone()
    ref_cache = cache.clone()
    q, k, v = qkv.view(T, -1, D).split([H, KVH, KVH], dim=1)
    rq, rk, rv = prepare_reference(q, k, v, positions, prep)
    reshape_and_cache_reference(rk, rv, ref_cache, meta.slot_mapping)
    want = paged_attention_reference(rq, ref_cache, meta, spec)
    nd = meta.num_decodes
    out = torch.full((nd, H * D), float("nan"))
    keep: list = []
    kernels.attention_step(
        make_layer(spec, cache, prep), make_step(meta, positions, keep), q, k, v, out
    )
    # Element-wise work rounds as torch does: exactly equal.
    if prep.qk_norm is None:
        assert torch.equal(q, rq) and torch.equal(k, rk)
    else:  # the norms' sums run in another order
        torch.testing.assert_close(q, rq, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(k, rk, rtol=1e-5, atol=1e-5)
    assert torch.equal(v, rv)
    torch.testing.assert_close(cache, ref_cache, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out, want[:nd], rtol=1e-5, atol=1e-5)
    if wide is not None:  # outside the view, the wider tensor is as it was
        outside = torch.ones_like(wide, dtype=torch.bool)
        layer_view(outside, KVH, D).fill_(False)
        assert torch.equal(wide[outside], wide_before[outside])


def test_attention_step_leaves_padding_slots_and_other_blocks_alone(kernels):
    g = torch.Generator().manual_seed(3)
    spec, prep = make_case("llama-gqa", g)
    meta, positions = ragged_step([6, 11], [1, 1], 4, 12, g, pad_rows=3)
    T = positions.shape[0]
    qkv = torch.randn(T, (8 + 4) * 32, generator=g)
    cache = torch.randn(2, 12, 2, 4, 32, generator=g).transpose(2, 3)
    before = cache.clone()
    q, k, v = qkv.view(T, -1, 32).split([8, 2, 2], dim=1)
    out = torch.empty(meta.num_decodes, 8 * 32)
    kernels.attention_step(
        make_layer(spec, cache, prep), make_step(meta, positions, []), q, k, v, out
    )
    changed = (cache != before).any(0).flatten(2).any(-1)  # [blocks, block_size]: written
    written = {(int(s) // 4, int(s) % 4) for s in meta.slot_mapping if s >= 0}
    assert {tuple(x) for x in changed.nonzero().tolist()} == written
    assert torch.isfinite(out).all()


@pytest.mark.parametrize("with_residual", [False, True])
@pytest.mark.parametrize(
    ("kind", "affine"), [(0, "weight"), (1, "both"), (1, "weight"), (1, "none")]
)  # RMSNorm (0) has a weight and no bias; LayerNorm (1) either, both or neither
def test_add_norm_matches_the_references(kernels, kind, with_residual, affine):
    g = torch.Generator().manual_seed(kind * 10 + with_residual)
    x = torch.randn(7, 96, generator=g) * 3
    res = torch.randn(7, 96, generator=g) if with_residual else None
    w = torch.randn(96, generator=g) if affine != "none" else None
    b = torch.randn(96, generator=g) if affine == "both" else None
    got = kernels.add_norm(x, res, w, b, 1e-5, kind)
    want = add_norm_reference(x, res, w, b, 1e-5, kind)
    torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-5)
    if with_residual:
        assert torch.equal(got[1], want[1])  # the add rounds as torch's
    else:
        assert got[1] is None


def test_build_is_cached_by_key(tmp_path, monkeypatch):
    first = cpu_native.build(tmp_path)
    stamp = first.stat().st_mtime_ns
    assert cpu_native.build(tmp_path) == first and first.stat().st_mtime_ns == stamp
    monkeypatch.setattr(cpu_native, "cpu_flags", lambda: "another machine")
    assert cpu_native.build(tmp_path) != first  # another CPU: another library


def fresh_load(monkeypatch):
    monkeypatch.setattr(cpu_native, "_loaded", {})
    return cpu_native.load()


def test_no_compiler_leaves_the_torch_path(monkeypatch, tmp_path, caplog):
    monkeypatch.setenv("NATIVE_KERNEL_CACHE", str(tmp_path))
    monkeypatch.setenv("CC", "/nonexistent/cc")
    monkeypatch.delenv("ATTENTION_BACKEND", raising=False)
    with caplog.at_level(logging.WARNING):
        assert fresh_load(monkeypatch) is None
        assert isinstance(make_attention_backend("auto", CPU), TorchAttentionBackend)
    assert "native CPU kernels off" in caplog.text
    with pytest.raises(ConfigError, match="native"):
        make_attention_backend("native", CPU)


def test_a_failed_self_check_leaves_the_torch_path(monkeypatch, caplog):
    monkeypatch.setattr(cpu_native, "self_check", lambda k: "attention differs by 1")
    monkeypatch.delenv("ATTENTION_BACKEND", raising=False)
    with caplog.at_level(logging.WARNING):
        assert fresh_load(monkeypatch) is None
    assert "self-check failed: attention differs by 1" in caplog.text


def test_self_check_catches_a_wrong_kernel(kernels, monkeypatch):
    real = kernels.attention_step

    def off_by_a_bit(layer, step, q, k, v, out):
        real(layer, step, q, k, v, out)
        out.add_(1e-3)

    monkeypatch.setattr(kernels, "attention_step", off_by_a_bit)
    assert "attention" in cpu_native.self_check(kernels)


def test_backend_choice(monkeypatch, kernels):
    monkeypatch.delenv("ATTENTION_BACKEND", raising=False)
    auto = make_attention_backend("auto", CPU)
    assert isinstance(auto, NativeCpuBackend) and auto.kernels is kernels
    assert make_attention_backend("native", CPU).name == "native"
    assert make_attention_backend("torch", CPU).name == "torch"
    monkeypatch.setenv("ATTENTION_BACKEND", "torch")  # the reference path, for the worker too
    assert make_attention_backend("auto", CPU).name == "torch"
    with pytest.raises(ConfigError):
        make_attention_backend("native", torch.device("cuda"))


# Families that between them hand the native step each option.
ENGINE_CASES = [
    ("test_families", "gemma2"),  # soft-cap, sliding window, RMSNorm + 1
    ("test_families", "olmo2"),  # q/k RMSNorm over all heads, post-norms
    ("test_families", "qwen3"),  # q/k RMSNorm per head
    ("test_families", "cohere"),  # q/k LayerNorm with a weight per head
    ("test_families", "stablelm"),  # per-head LayerNorm q/k norm, partial rotary, qkv bias
    ("test_families_gpt", "phi"),  # q/k LayerNorm with weight and bias shared by the heads
    ("test_families_alibi", "mpt"),  # ALiBi, clip_qkv, LayerNorm without bias
    ("test_families_gpt", "gptj"),  # GPT-J partial rotary, parallel block
]


@pytest.mark.parametrize(("module", "name"), ENGINE_CASES)
def test_native_backend_tokens_equal_the_torch_backends(tmp_path, module, name, kernels):
    """The families' own tests run the default backend (native on CPU) against transformers;
    this runs the torch backend beside it, so both CPU paths stay equal."""
    import importlib

    import transformers

    from tests.engine.family_check import engine_greedy, family_prompts, save_family_model
    from tests.tiny_models import build_tokenizer

    config = importlib.import_module(f"tests.engine.{module}").CONFIGS[name](build_tokenizer())
    path = save_family_model(str(tmp_path / name), config)
    prompts = family_prompts(transformers.AutoConfig.from_pretrained(path).vocab_size)
    native = engine_greedy(path, prompts, 24, attention_backend="native")
    assert native == engine_greedy(path, prompts, 24, attention_backend="torch")


# -- the native GEMM ---------------------------------------------------------------------------


def test_panels_round_trip():
    from serverless_llm.engine.kernels.cpu_native import pack_panels

    w = torch.randn(37, 5)
    panels = pack_panels(w)
    assert panels.shape == (3, 5, 16) and panels.is_contiguous()
    assert torch.equal(panels[2, :, 5:], torch.zeros(5, 11))  # past N: zeros
    assert torch.equal(panels[1, 3], w[16:32, 3]) and torch.equal(
        panels.transpose(1, 2).reshape(-1, 5)[:37],
        w,  # unpacked: the weight again
    )


def test_panels_in_place_equal_panels_over_the_weights_own_memory():
    """A stacked expert weight's slices packed in place (the MoE load's way: no second copy):
    the same panels as pack_panels, in the stacked tensor's storage; a weight off the panel
    width or not contiguous gets pack_panels' fresh copy and stays as it was."""
    from serverless_llm.engine.kernels.cpu_native import pack_panels, pack_panels_in_place

    stacked = torch.randn(3, 48, 7)
    want = [pack_panels(w) for w in stacked]
    start = stacked.untyped_storage().data_ptr()
    got = [pack_panels_in_place(w) for w in stacked]
    for e, (g, w) in enumerate(zip(got, want)):
        assert torch.equal(g, w) and g.is_contiguous()
        assert g.untyped_storage().data_ptr() == start  # a view of the stacked storage
        assert g.data_ptr() == start + e * 48 * 7 * 4
    for w in (torch.randn(37, 5), torch.randn(7, 32).T):
        before = w.clone()
        assert torch.equal(pack_panels_in_place(w), pack_panels(before))
        assert torch.equal(w, before)


# Rows: 1-6 (each micro-kernel alone), 7 and 13 (6 + a remainder), 32 and 70 (a decode batch;
# more row blocks than prefetch lines to share); for the AVX-512 kernel (2 rows and more), 12 and
# 24 (whole blocks of its 12), 25 (three balanced blocks, 8 + 8 + 9) and 64. Shapes: N off the
# 16-column panels and under one panel, an odd panel count (a lone last panel) and an even one,
# K under, at and past the 128-step blocks (one, two and three blocks).
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 6, 7, 12, 13, 24, 25, 32, 64, 70])
@pytest.mark.parametrize(("n", "k"), [(64, 48), (37, 130), (4, 16), (3, 7), (48, 128), (80, 300)])
@pytest.mark.parametrize("bias", [False, True])
def test_native_linear_matches_f_linear(kernels, rows, n, k, bias):
    from serverless_llm.engine.kernels.cpu_native import pack_panels

    g = torch.Generator().manual_seed(rows * 100 + n)
    x = torch.randn(rows, k + 5, generator=g)[:, 2 : 2 + k]  # rows strided, as a view can be
    w = torch.randn(n, k, generator=g)
    b = torch.randn(n, generator=g) if bias else None
    got = kernels.linear(x, pack_panels(w), b, n)
    want = torch.nn.functional.linear(x.double(), w.double(), None if b is None else b.double())
    torch.testing.assert_close(got, want.float(), rtol=1e-5, atol=1e-5 * k**0.5)


@pytest.mark.parametrize(("n", "k"), [(37, 300), (80, 130)])
def test_native_linear_rows_do_not_depend_on_the_step(kernels, n, k):
    """A row's output is the same whatever else the step holds: one row alone (the AVX2 kernel)
    and within 2-70 rows (the AVX-512 form where the build has it) sum in the same order."""
    from serverless_llm.engine.kernels.cpu_native import pack_panels

    g = torch.Generator().manual_seed(n + k)
    x, w, b = torch.randn(70, k, generator=g), torch.randn(n, k, generator=g), torch.randn(n)
    panels = pack_panels(w)
    alone = torch.cat([kernels.linear(x[i : i + 1], panels, b, n) for i in range(70)])
    for rows in (2, 12, 25, 32, 70):
        assert torch.equal(kernels.linear(x[:rows], panels, b, n), alone[:rows])


def test_native_linear_is_threaded_over_panels_and_equal_to_itself_alone(kernels):
    """A shape big enough for the OpenMP team (M * N * K over its threshold), each thread's
    panels done as one thread would: the same bits with 1 and 2 threads."""
    from serverless_llm.engine.kernels.cpu_native import pack_panels

    g = torch.Generator().manual_seed(7)
    w, x = torch.randn(200, 256, generator=g), torch.randn(9, 256, generator=g)
    panels = pack_panels(w)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = kernels.linear(x, panels, None, 200)
        torch.set_num_threads(2)
        together = kernels.linear(x, panels, None, 200)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(alone, together)
    torch.testing.assert_close(together, x @ w.T, rtol=1e-5, atol=1e-4)


# -- the MLP's activations ---------------------------------------------------------------------


@pytest.mark.parametrize("code", [0, 1, 2, 3])  # silu, gelu, gelu's tanh form, relu
@pytest.mark.parametrize("gated", [False, True])
@pytest.mark.parametrize(("rows", "n"), [(1, 7), (5, 64), (32, 1030)])  # threaded at 32 x 1030
def test_native_activation_matches_its_reference(kernels, code, gated, rows, n):
    from serverless_llm.engine.kernels.cpu_native import activation_code_reference

    g = torch.Generator().manual_seed(code * 10 + rows)
    width = 2 * n if gated else n
    x = (torch.randn(rows, width + 3, generator=g) * 5)[:, 1 : 1 + width]  # strided rows
    x[0, :4] = torch.tensor([0.0, -0.0, 40.0, -40.0])[: min(4, width)]  # the saturated ends
    got = kernels.activation(x, code, gated)
    # torch's tanh form loses digits in 1 + tanh(u) for u < 0 (this kernel does not): equal to
    # float32 rounding of the inputs' scale, not of each tiny output
    want = activation_code_reference(x, code, gated)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(("act", "native"), [("gelu_new", True), ("relu", True), ("gelu", False)])
def test_activation_module_takes_the_native_kernel_where_it_has_the_activation(
    tmp_path, kernels, act, native
):
    """A model's plain-MLP activation runs the native kernel for silu, gelu's tanh form and
    relu; the erf gelu keeps torch's (set at load by optimize_for_cpu)."""
    import transformers

    from serverless_llm import LLM
    from serverless_llm.engine.layers.activation import Activation
    from tests.engine.family_check import save_family_model
    from tests.tiny_models import build_tokenizer

    tok = build_tokenizer()
    config = transformers.GPT2Config(
        vocab_size=len(tok),
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        n_embd=32,
        n_layer=1,
        n_head=2,
        activation_function=act,
    )
    path = save_family_model(str(tmp_path / act), config)
    llm = LLM(path, dtype="float32", max_model_len=64, num_kv_blocks=8, block_size=8)
    acts = [m for m in llm.engine.runner.model.modules() if isinstance(m, Activation)]
    assert acts and all(m.native is kernels for m in acts)


def packed(n=24, k=16, bias=True, keep_panels=True):
    from serverless_llm.engine.layers.linear import PackedLinear, packed_ops_work

    if not packed_ops_work():
        pytest.skip("this torch build has no oneDNN packed linear")
    lin = torch.nn.Linear(k, n, bias=bias)
    return lin, PackedLinear(lin, keep_panels=keep_panels)


def test_packed_linear_takes_the_native_kernel_up_to_its_rows(kernels, monkeypatch):
    lin, p = packed()
    calls = []
    real = kernels.linear
    monkeypatch.setattr(kernels, "linear", lambda *a: calls.append(a[0].shape[0]) or real(*a))
    p.use_native_rows(kernels, 4)
    for m in (1, 4, 5, 32):
        x = torch.randn(m, 16)
        torch.testing.assert_close(p(x), lin(x), rtol=1e-5, atol=1e-5)
    assert calls == [1, 4]
    p.use_native_rows(kernels, 4, 2)  # from 2 rows: one row stays on oneDNN
    for m in (1, 2, 5):
        x = torch.randn(m, 16)
        torch.testing.assert_close(p(x), lin(x), rtol=1e-5, atol=1e-5)
    assert calls == [1, 4, 2]
    p.use_native_rows(kernels, 0)
    assert p.panels is None and p(torch.randn(1, 16)).shape == (1, 24) and calls == [1, 4, 2]


def test_choose_native_rows_spans_the_wins_past_streaming_bound_coin_flips(kernels):
    from serverless_llm.engine.layers.linear import choose_native_rows

    _, p = packed()
    # native's share of oneDNN's time by rows (a list: one value a timing, the last repeated)
    share: dict[int, list[float]] = {}
    tried = []

    def timer(linears, x, native, repeats=3):
        m = next(iter(x.values())).shape[0]
        if repeats == 1:
            return 1.0  # the warm-up pass
        tried.append(m) if native else None
        if not native:
            return 1.0
        values = share[m]
        return values.pop(0) if len(values) > 1 else values[0]

    def choose(**shares):
        share.clear()
        share.update({int(k[1:]): list(v) for k, v in shares.items()})
        tried.clear()
        return choose_native_rows([p], kernels, timer)

    # wins at 1 and 2, a stray loss at 4 (streaming-bound: inside the span), wins to 32, a loss
    # at 64 that holds when timed again: the span is 1-32
    rows, timings = choose(r1=[0.5], r2=[0.9], r4=[1.2], r8=[0.1], r16=[0.1], r32=[0.2],
                           r64=[1.3])  # fmt: skip
    assert rows == (1, 32) and [t[0] for t in timings] == [1, 2, 4, 8, 16, 32, 64]
    assert tried.count(64) == 2 and tried.count(4) == 1  # only past 4 rows is a loss retimed
    # a loss past 4 rows that does not hold (a busy moment) does not end the span
    assert choose(r1=[0.5], r2=[0.5], r4=[0.5], r8=[1.3, 0.4], r16=[0.4], r32=[0.4],
                  r64=[0.4])[0] == (1, 64)  # fmt: skip
    # one that holds does
    assert choose(r1=[0.5], r2=[0.5], r4=[0.5], r8=[1.3, 1.2], r16=[0.1], r32=[0.1],
                  r64=[0.1])[0] == (1, 4)  # fmt: skip
    assert 16 not in tried
    # within NATIVE_WIN of oneDNN at 1 row: not worth the memory; the span starts at 2
    assert choose(r1=[0.99], r2=[0.9], r4=[0.9], r8=[1.2], r16=[1.2])[0] == (2, 4)
    # losses before the first win, up to 4 rows, are skipped
    assert choose(r1=[1.3], r2=[0.5], r4=[0.7], r8=[1.1])[0] == (2, 4)
    # no win by 4 rows (streaming evenly, as a large LM head does), wins from 8: 8 to 64
    assert choose(r1=[1.3], r2=[1.2], r4=[1.2], r8=[0.5], r16=[0.5], r32=[0.5],
                  r64=[0.5])[0] == (8, 64)  # fmt: skip
    # a CPU where the native kernel loses there and at 8 rows too stops at 8
    assert choose(r1=[1.3], r2=[1.2], r4=[1.2], r8=[1.2])[0] == (0, 0) and tried[-1] == 8


def test_the_measurement_times_only_a_budget_of_each_shapes_weights(kernels):
    from serverless_llm.engine.layers.linear import timed_instances

    group = [packed(n=24, k=16)[1] for _ in range(5)]  # 1,536 bytes each
    assert timed_instances(group, budget=3000) == group[:2]
    assert timed_instances(group, budget=100) == group[:1]  # always one
    assert timed_instances(group, budget=1 << 20) == group


def test_a_bad_native_linear_rows_setting_is_named(kernels, monkeypatch):
    from serverless_llm.engine.layers.linear import use_native_linears

    monkeypatch.setenv("NATIVE_LINEAR_ROWS", "-2")
    with pytest.raises(ValueError, match="NATIVE_LINEAR_ROWS='-2'"):
        use_native_linears(torch.nn.Sequential(packed()[1]), kernels)


@pytest.mark.parametrize(("setting", "rows"), [("0", 0), ("3", 3)])
def test_native_linear_rows_setting(kernels, monkeypatch, setting, rows):
    from serverless_llm.engine.layers.linear import use_native_linears

    _, p = packed()
    model = torch.nn.Sequential(p)
    monkeypatch.setenv("NATIVE_LINEAR_ROWS", setting)
    line = use_native_linears(model, kernels)
    assert p.native_rows == rows and (p.panels is None) == (rows == 0)
    assert "NATIVE_LINEAR_ROWS" in line


def test_a_model_on_native_linears_equals_transformers(tmp_path, monkeypatch, kernels):
    """Every step of a tiny Llama through the native linears (8 rows and fewer: the decodes),
    greedy tokens equal to transformers'."""
    from tests.engine.family_check import assert_matches_transformers
    from tests.tiny_models import build_tiny_model

    monkeypatch.setenv("NATIVE_LINEAR_ROWS", "8")
    path = build_tiny_model(str(tmp_path / "llama"), "llama")
    assert_matches_transformers(path, attention_backend="native")


# -- a whole decode layer in one call ----------------------------------------------------------


@pytest.mark.parametrize(
    "kind",
    ["llama", "qwen2", "mistral", "llama_tied"],  # + QKV bias; sliding window; one KV head, tied
)
def test_whole_decode_layers_equal_transformers(tmp_path, monkeypatch, kernels, kind):
    """Decode steps of up to 8 rows through `decoder_layer_f32` (every layer takes it: the
    count of calls says so), greedy tokens equal to transformers'."""
    from tests.tiny_models import build_tiny_model

    assert_whole_layers_match(
        monkeypatch, kernels, lambda: build_tiny_model(str(tmp_path / kind), kind)
    )


def assert_whole_layers_match(monkeypatch, kernels, build) -> None:
    """The model `build()` saves, its decode steps of up to 8 rows through `decoder_layer_f32`
    (the count of calls says it ran), greedy tokens equal to transformers'."""
    from tests.engine.family_check import assert_matches_transformers

    monkeypatch.setenv("NATIVE_LINEAR_ROWS", "8")
    calls = []
    real = kernels.decoder_layer
    monkeypatch.setattr(
        kernels, "decoder_layer", lambda *a: calls.append(a[3].shape[0]) or real(*a)
    )
    assert_matches_transformers(build(), attention_backend="native")
    assert calls and max(calls) <= 8


@pytest.mark.parametrize(
    ("module", "name"),
    [
        ("test_families_gpt", "gpt2"),  # plain gelu-tanh MLP, LayerNorm with bias, positions
        ("test_families_gpt", "opt"),  # plain relu MLP
        ("test_families_alibi", "bloom"),  # ALiBi, embedding norm
        ("test_families", "gemma"),  # gated gelu-tanh MLP
        ("test_families_gpt", "gptj"),  # parallel, one norm, interleaved partial rotary
        ("test_families_gpt", "phi"),  # parallel, shared q/k LayerNorm, dense bias
        ("test_families", "cohere"),  # parallel, LayerNorm without bias, gated SiLU, q/k norm
        ("test_families_gpt", "gpt_neox"),  # parallel with the MLP's own norm, erf gelu
        ("test_families_alibi", "mpt"),  # erf gelu, ALiBi, clip_qkv, no biases
        ("test_families", "gemma2"),  # sandwich norms, soft-cap
        ("test_families", "gemma3"),  # sandwich norms, q/k norm, sliding layers
        ("test_families_conv", "lfm3"),  # a sigmoid gate a head, sandwich norms, convolutions
        ("test_families_conv", "lfm3_plain"),  # LFM3 without the gate and the sandwich norms
    ],
)
def test_whole_decode_layers_of_other_shapes_equal_transformers(
    tmp_path, monkeypatch, kernels, module, name
):
    """The whole-layer call with a plain MLP (gelu's tanh form, relu), a gated non-SiLU one,
    and parallel blocks with one norm or two: every layer takes it, greedy tokens equal to
    transformers'."""
    import importlib

    from tests.engine.family_check import save_family_model
    from tests.tiny_models import build_tokenizer

    config = importlib.import_module(f"tests.engine.{module}").CONFIGS[name](build_tokenizer())
    assert_whole_layers_match(
        monkeypatch, kernels, lambda: save_family_model(str(tmp_path / name), config)
    )


def test_whole_decode_layer_is_attached_only_where_the_shape_fits(tmp_path, monkeypatch, kernels):
    from serverless_llm import LLM
    from tests.engine.family_check import save_family_model
    from tests.engine.test_families import CONFIGS
    from tests.tiny_models import build_tiny_model, build_tokenizer

    monkeypatch.setenv("NATIVE_LINEAR_ROWS", "4")
    # 48 blocks: Gemma 2's three layers are three cache groups of one layer (one full, two
    # windowed), each a block table of up to 16 blocks for a 128-token request.
    kw = dict(dtype="float32", max_model_len=128, num_kv_blocks=48, block_size=8)
    llama = LLM(build_tiny_model(str(tmp_path / "llama"), "llama"), **kw)
    layers = llama.engine.runner.model.layers
    assert all(layer.native_decode is not None for layer in layers)
    assert layers[0].native_decode.rows == 4
    # Gemma 2's sandwich norms (RMSNorms before the residual adds) take it too; Granite's
    # multipliers and OLMo 2's norms after the sublayers alone keep the per-op path.
    gemma2 = save_family_model(str(tmp_path / "gemma2"), CONFIGS["gemma2"](build_tokenizer()))
    layers = LLM(gemma2, **kw).engine.runner.model.layers
    assert all(layer.native_decode is not None for layer in layers)
    for name in ("granite", "olmo2"):
        path = save_family_model(str(tmp_path / name), CONFIGS[name](build_tokenizer()))
        layers = LLM(path, **kw).engine.runner.model.layers
        assert all(layer.native_decode is None for layer in layers), name
    monkeypatch.setenv("NATIVE_LINEAR_ROWS", "0")  # no native linears: no whole layers
    layers = LLM(build_tiny_model(str(tmp_path / "l2"), "llama"), **kw).engine.runner.model.layers
    assert all(layer.native_decode is None for layer in layers)


def test_the_measured_choice_is_cached_per_machine_and_shape(kernels, monkeypatch, tmp_path):
    from serverless_llm.engine.layers import linear as linear_mod

    monkeypatch.setenv("NATIVE_KERNEL_CACHE", str(tmp_path))
    monkeypatch.delenv("NATIVE_LINEAR_ROWS", raising=False)
    measured = []

    def fake_choose(group, native, timer=None):
        measured.append(len(group))
        return (2, 4), [(1, 2.0, 1.0), (2, 0.5, 1.0), (4, 0.5, 1.0), (8, 2.0, 1.0)]

    monkeypatch.setattr(linear_mod, "choose_native_rows", fake_choose)
    monkeypatch.setattr(linear_mod, "others_busy_cores", lambda before, after: 0.0)

    def model():
        return torch.nn.Sequential(packed(24, 16)[1], packed(24, 16)[1], packed(8, 16)[1])

    first = model()
    assert "measured" in linear_mod.use_native_linears(first, kernels)
    assert sorted(measured) == [1, 2]
    assert all((p.native_min_rows, p.native_rows) == (2, 4) for p in first)
    assert len(list(tmp_path.glob("linear-rows-*.json"))) == 1
    again = model()
    line = linear_mod.use_native_linears(again, kernels)  # another start, same shapes
    assert "cached in" in line and len(measured) == 2 and "2-4" in line
    assert all((p.native_min_rows, p.native_rows) == (2, 4) for p in again)
    monkeypatch.setenv("NATIVE_LINEAR_ROWS", "measure")
    linear_mod.use_native_linears(model(), kernels)
    assert len(measured) == 4
    monkeypatch.delenv("NATIVE_LINEAR_ROWS")
    monkeypatch.setattr(linear_mod, "cpu_flags", lambda: "another machine")
    linear_mod.use_native_linears(model(), kernels)
    assert len(measured) == 6  # another CPU: measured again


def test_a_choice_measured_under_load_is_not_cached(kernels, monkeypatch, tmp_path):
    """Other processes busy while the rows were timed: the choice serves this start, and the
    next start measures again (a loaded machine's timings must not outlive the load)."""
    from serverless_llm.engine.layers import linear as linear_mod

    monkeypatch.setenv("NATIVE_KERNEL_CACHE", str(tmp_path))
    monkeypatch.delenv("NATIVE_LINEAR_ROWS", raising=False)
    measured = []

    def fake_choose(group, native, timer=None):
        measured.append(len(group))
        return (1, 8), [(1, 0.5, 1.0), (8, 0.5, 1.0), (16, 2.0, 1.0)]

    monkeypatch.setattr(linear_mod, "choose_native_rows", fake_choose)
    busy = [1.4]
    monkeypatch.setattr(linear_mod, "others_busy_cores", lambda before, after: busy[0])
    model = torch.nn.Sequential(packed(24, 16)[1])
    line = linear_mod.use_native_linears(model, kernels)
    assert "not cached" in line and "1.40 cores" in line
    assert model[0].native_rows == 8
    assert not list(tmp_path.glob("linear-rows-*.json"))
    busy[0] = 0.05  # idle now: measured again, and kept
    line = linear_mod.use_native_linears(torch.nn.Sequential(packed(24, 16)[1]), kernels)
    assert len(measured) == 2 and "not cached" not in line
    assert len(list(tmp_path.glob("linear-rows-*.json"))) == 1


def test_others_busy_cores_from_two_samples():
    from serverless_llm.engine.layers.linear import others_busy_cores

    # 2 s apart: the machine's busy CPU seconds grew by 3.0, this process's by 1.0
    assert others_busy_cores((10.0, (100.0, 5.0)), (12.0, (103.0, 6.0))) == pytest.approx(1.0)
    assert others_busy_cores((10.0, None), (12.0, (103.0, 6.0))) is None
    assert others_busy_cores((10.0, (100.0, 5.0)), (10.0, (100.0, 5.0))) is None
