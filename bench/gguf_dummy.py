"""A ~0.5B llama GGUF of dummy weights for bench/llamacpp.py (issue 39: one request against
llama.cpp on a Q4_K_M and a Q8_0 file), written with the `gguf` package.

Shape: 24 layers, hidden 1280, MLP 3584, 20 heads of 64 (4 KV heads), SmolLM2's vocabulary of
49,152 and its tokenizer (copied from the embedded GGUF, so both systems tokenize alike), tied
embedding: 0.49B parameters. Weights are random file blocks with small float16 scales (their
values mean nothing; both systems read and multiply the same bytes). Q8_0: every linear and the
embedding Q8_0. Q4_K_M: Q4_K linears, Q6_K for attn_v and ffn_down in llama.cpp's
"more bits" layers (the first and last eighth and every third between) and for the embedding
(the LM head).

    .venv/bin/python bench/gguf_dummy.py --type Q8_0 --out /tmp/dummy-0.5b.Q8_0.gguf
    .venv/bin/python bench/llamacpp.py --model /tmp/dummy-0.5b.Q8_0.gguf --threads 1
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402

LAYERS, HIDDEN, MLP, HEADS, KV_HEADS, HEAD_DIM, VOCAB = 24, 1280, 3584, 20, 4, 64, 49152
# where each type keeps its float16 fields in a block (set to small values), block bytes, inputs
HALVES = {"Q8_0": ((0,), 34, 32), "Q4_K": ((0, 2), 144, 256), "Q6_K": ((208,), 210, 256)}
TOKENIZER_KEYS = ("tokenizer.ggml.model", "tokenizer.ggml.pre", "tokenizer.ggml.tokens",
                  "tokenizer.ggml.token_type", "tokenizer.ggml.merges",
                  "tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id",
                  "tokenizer.ggml.unknown_token_id", "tokenizer.ggml.padding_token_id",
                  "tokenizer.ggml.add_bos_token", "tokenizer.ggml.add_space_prefix",
                  "tokenizer.chat_template")  # fmt: skip


def blocks(type_name: str, rows: int, inputs: int, rng) -> np.ndarray:
    halves, size, per = HALVES[type_name]
    raw = rng.integers(0, 256, (rows, inputs // per, size), dtype=np.uint8)
    for at in halves:
        scale = (rng.random((rows, inputs // per)) * 2e-3).astype(np.float16)
        raw[..., at : at + 2] = scale.view(np.uint8).reshape(rows, inputs // per, 2)
    return raw.reshape(rows, -1)


def more_bits(i: int) -> bool:
    return i < LAYERS // 8 or i >= 7 * LAYERS // 8 or (i - LAYERS // 8) % 3 == 2


def copy_tokenizer(writer, source: str) -> None:
    import gguf

    fields = gguf.GGUFReader(source).fields
    for key in TOKENIZER_KEYS:
        f = fields.get(key)
        if f is None:
            continue
        value, kind = f.contents(), f.types[0]
        if kind == gguf.GGUFValueType.ARRAY:
            writer.add_array(key, value)
        elif kind == gguf.GGUFValueType.STRING:
            writer.add_string(key, value)
        elif kind == gguf.GGUFValueType.BOOL:
            writer.add_bool(key, value)
        else:
            writer.add_uint32(key, int(value))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--type", choices=("Q8_0", "Q4_K_M"), required=True)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    import gguf

    from serverless_llm.engine.loader.gguf import embedded_model_path

    q = gguf.GGMLQuantizationType
    rng = np.random.default_rng(0)
    w = gguf.GGUFWriter(a.out, "llama")
    w.add_name(f"dummy-0.5b-{a.type}")
    w.add_block_count(LAYERS)
    w.add_context_length(4096)
    w.add_embedding_length(HIDDEN)
    w.add_feed_forward_length(MLP)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_rope_dimension_count(HEAD_DIM)
    w.add_rope_freq_base(100000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(VOCAB)
    w.add_file_type(7 if a.type == "Q8_0" else 15)  # llama.cpp's MOSTLY_Q8_0 / MOSTLY_Q4_K_M
    copy_tokenizer(w, embedded_model_path())

    def add(name, type_name, rows, inputs):
        w.add_tensor(name, blocks(type_name, rows, inputs, rng), raw_dtype=q[type_name])

    low = "Q8_0" if a.type == "Q8_0" else "Q4_K"
    add("token_embd.weight", "Q8_0" if a.type == "Q8_0" else "Q6_K", VOCAB, HIDDEN)
    ones = np.ones(HIDDEN, np.float32)
    for i in range(LAYERS):
        b = f"blk.{i}."
        high = low if a.type == "Q8_0" or not more_bits(i) else "Q6_K"
        w.add_tensor(b + "attn_norm.weight", ones)
        w.add_tensor(b + "ffn_norm.weight", ones)
        add(b + "attn_q.weight", low, HEADS * HEAD_DIM, HIDDEN)
        add(b + "attn_k.weight", low, KV_HEADS * HEAD_DIM, HIDDEN)
        add(b + "attn_v.weight", high, KV_HEADS * HEAD_DIM, HIDDEN)
        add(b + "attn_output.weight", low, HIDDEN, HEADS * HEAD_DIM)
        add(b + "ffn_gate.weight", low, MLP, HIDDEN)
        add(b + "ffn_up.weight", low, MLP, HIDDEN)
        add(b + "ffn_down.weight", high, HIDDEN, MLP)
    w.add_tensor("output_norm.weight", ones)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    print(f"wrote {a.out}: {Path(a.out).stat().st_size / 2**20:.0f} MiB")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
