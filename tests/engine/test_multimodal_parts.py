"""The engine's image plumbing, piece by piece: multimodal rotary tables against transformers'
own rotary classes, bidirectional span masks against an explicit mask, the encoder cache's
bounds, and prefix-cache keys that follow a prompt's images."""

from __future__ import annotations

import torch
import transformers

from serverless_llm.engine.kernels.metadata import AttentionMetadata, AttentionSpec
from serverless_llm.engine.kernels.paged_attention import (
    attention_mask,
    paged_attention_reference,
    prefill_torch,
)
from serverless_llm.engine.layers.rotary import cos_sin_cache, inv_frequencies, mrope_table
from serverless_llm.engine.multimodal import EncoderCache, ImageFeatures, ImageItem
from serverless_llm.engine.request import Request
from serverless_llm.engine.sampling.params import SamplingParams


def _positions(T: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    return torch.randint(0, 40, (3, T), generator=g)


def _check_mrope(rotary, section, interleaved, head_dim):
    T = 23
    pos = _positions(T)
    x = torch.zeros(1, T, head_dim)
    cos_hf, sin_hf = rotary(x, pos.unsqueeze(1))  # [1, T, head_dim] each
    inv = inv_frequencies(
        {"rope_theta": rotary.config.rope_parameters["rope_theta"], "rope_type": "default"},
        head_dim,
        64,
    )
    table = cos_sin_cache(inv, 64)
    mixed = mrope_table(table, pos, section, interleaved)  # [T, head_dim]: cos half, sin half
    half = head_dim // 2
    torch.testing.assert_close(mixed[:, :half], cos_hf[0, :, :half], atol=1e-6, rtol=0)
    torch.testing.assert_close(mixed[:, half:], sin_hf[0, :, :half], atol=1e-6, rtol=0)


def test_mrope_table_equals_qwen2_5_vl_rotary():
    from transformers.models.qwen2_5_vl import modeling_qwen2_5_vl as m

    cfg = transformers.Qwen2_5_VLConfig().text_config
    cfg.hidden_size, cfg.num_attention_heads = 128, 4  # head_dim 32
    cfg.rope_parameters = {
        "rope_type": "default",
        "rope_theta": 10000.0,
        "mrope_section": [4, 6, 6],
    }
    rotary = m.Qwen2_5_VLRotaryEmbedding(cfg)
    _check_mrope(rotary, [4, 6, 6], False, 32)


def test_mrope_table_equals_qwen3_vl_interleaved_rotary():
    from transformers.models.qwen3_vl import modeling_qwen3_vl as m

    cfg = transformers.Qwen3VLConfig().text_config
    cfg.head_dim = 32
    cfg.rope_parameters = {
        "rope_type": "default",
        "rope_theta": 5000.0,
        "mrope_section": [6, 5, 5],
        "mrope_interleaved": True,
    }
    rotary = m.Qwen3VLTextRotaryEmbedding(cfg)
    _check_mrope(rotary, [6, 5, 5], True, 32)


def test_mrope_table_with_equal_streams_is_the_plain_table():
    inv = inv_frequencies({"rope_theta": 10000.0, "rope_type": "default"}, 32, 64)
    table = cos_sin_cache(inv, 64)
    pos = torch.arange(10).repeat(3, 1)
    torch.testing.assert_close(mrope_table(table, pos, [4, 6, 6]), table[:10])
    torch.testing.assert_close(mrope_table(table, pos, [6, 5, 5], True), table[:10])


def _meta(n: int, ctx: int, limits, block_size: int = 4) -> AttentionMetadata:
    seq = ctx + n
    blocks = -(-seq // block_size)
    return AttentionMetadata(
        query_start_loc=torch.tensor([0, n], dtype=torch.int32),
        seq_lens=torch.tensor([seq], dtype=torch.int32),
        context_lens=torch.tensor([ctx], dtype=torch.int32),
        block_tables=torch.arange(blocks, dtype=torch.int32).view(1, -1),
        slot_mapping=torch.arange(ctx, seq, dtype=torch.int64),
        num_decodes=0,
        max_query_len=n,
        max_seq_len=seq,
        query_lens_host=[n],
        seq_lens_host=[seq],
        block_size=block_size,
        key_limits_host=[limits],
    )


def test_bidirectional_span_mask():
    pos = torch.arange(2, 8)
    limits = [2, 5, 5, 5, 6, 7]  # positions 3..5 form a span
    mask = attention_mask(pos, 8, None, limits)
    expected = torch.tensor(
        [[k <= max(p, lim) for k in range(8)] for p, lim in zip(range(2, 8), limits)]
    )
    assert torch.equal(mask, expected)


def test_prefill_with_a_bidirectional_span_equals_the_reference():
    torch.manual_seed(0)
    H, KVH, D, bs = 4, 2, 8, 4
    ctx, n = 3, 9
    spec = AttentionSpec(num_heads=H, num_kv_heads=KVH, head_dim=D, scale=D**-0.5)
    seq = ctx + n
    cache = torch.zeros(2, -(-seq // bs), bs, KVH, D)  # [2, blocks, block, KVH, D]
    k_all, v_all = torch.randn(seq, KVH, D), torch.randn(seq, KVH, D)
    for p in range(seq):
        cache[0, p // bs, p % bs], cache[1, p // bs, p % bs] = k_all[p], v_all[p]
    q = torch.randn(n, H, D)
    limits = list(range(ctx, seq))
    limits[2:6] = [ctx + 5] * 4  # tokens 5..8 attend to each other
    meta = _meta(n, ctx, limits, bs)
    ref = paged_attention_reference(q, cache, meta, spec)
    # an explicit computation of the same mask
    keys = k_all.repeat_interleave(H // KVH, 1)
    vals = v_all.repeat_interleave(H // KVH, 1)
    scores = torch.einsum("nhd,lhd->hnl", q, keys) * spec.scale
    allowed = torch.tensor([[k <= max(ctx + r, limits[r]) for k in range(seq)] for r in range(n)])
    probs = scores.masked_fill(~allowed[None], float("-inf")).softmax(-1)
    explicit = torch.einsum("hnl,lhd->nhd", probs, vals).reshape(n, -1)
    torch.testing.assert_close(ref, explicit, atol=1e-5, rtol=1e-5)
    # the torch backend's head-major layout, seen logically as [2, blocks, block, KVH, D]
    head_major = cache.permute(0, 1, 3, 2, 4).contiguous().transpose(2, 3)
    out = prefill_torch(q, k_all[ctx:], v_all[ctx:], head_major, meta, spec, 0)
    torch.testing.assert_close(out, explicit, atol=1e-5, rtol=1e-5)


def _features(rows: int) -> ImageFeatures:
    return ImageFeatures(torch.zeros(rows, 8))  # 32 bytes a row


def test_encoder_cache_is_bounded_and_keeps_the_steps_images():
    cache = EncoderCache(capacity_bytes=32 * 10)
    cache.put(b"a", _features(4))
    cache.put(b"b", _features(4))
    assert cache.get(b"a") is not None  # a is now the most recent
    cache.put(b"c", _features(4), keep={b"c"})  # over: b (least recent) goes
    assert b"b" not in cache and b"a" in cache and b"c" in cache
    cache.put(b"d", _features(20), keep={b"a", b"d"})  # larger than the cache: kept for its step
    assert b"d" in cache and b"a" in cache and b"c" not in cache
    assert cache.encoded == 4


def _item(offset, length, tag: bytes) -> ImageItem:
    return ImageItem(offset, length, {}, tag)


def test_prefix_salt_keys_only_blocks_an_image_overlaps():
    from serverless_llm.engine.multimodal import MultiModalPrompt

    req = Request("r", list(range(20)), SamplingParams(), 40)
    assert req.prefix_salt(4) == b""
    req.mm = MultiModalPrompt(list(range(20)), [_item(6, 5, b"X"), _item(12, 2, b"Y")])
    salt = req.prefix_salt(4)
    assert [salt(i) for i in range(5)] == [b"", b"X", b"X", b"Y", b""]
