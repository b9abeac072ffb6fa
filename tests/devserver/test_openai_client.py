"""The official OpenAI client against the local endpoint, on the real worker and tiny Llama:
what a user who only changes `base_url` gets."""

from __future__ import annotations

import openai
import pytest
from transformers import AutoTokenizer

from tests.devserver.conftest import API_KEY, SERVED_MODEL, ServerThread

GREEDY = {"temperature": 0.0}
MESSAGES = [{"role": "user", "content": "Hello world! How are you today?"}]
PROMPT = "The quick brown fox jumps over"


@pytest.fixture(scope="module")
def client(endpoint: ServerThread) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{endpoint.base_url}/openai/v1", api_key=API_KEY, timeout=30)


@pytest.fixture(scope="module")
def tokenizer(tiny_llama: str):
    return AutoTokenizer.from_pretrained(tiny_llama)


def test_models_list(client: openai.OpenAI):
    models = client.models.list()
    assert [m.id for m in models.data] == [SERVED_MODEL]
    assert client.models.retrieve(SERVED_MODEL).id == SERVED_MODEL


def test_chat_streamed_equals_non_streamed(client: openai.OpenAI, tokenizer):
    kwargs = dict(model=SERVED_MODEL, messages=MESSAGES, max_tokens=12, **GREEDY)
    full = client.chat.completions.create(**kwargs, extra_body={"ignore_eos": True})
    choice = full.choices[0]
    assert choice.message.role == "assistant" and choice.finish_reason == "length"
    prompt_ids = tokenizer(
        tokenizer.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True),
        add_special_tokens=False,
    )["input_ids"]
    assert full.usage.prompt_tokens == len(prompt_ids)
    assert full.usage.completion_tokens == 12
    assert full.usage.total_tokens == len(prompt_ids) + 12

    stream = client.chat.completions.create(
        **kwargs,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    text, finish, usage = "", None, None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            text += c.delta.content or ""
            finish = c.finish_reason or finish
    assert text == choice.message.content
    assert finish == "length"
    assert usage is not None and usage.completion_tokens == 12
    assert usage.prompt_tokens == full.usage.prompt_tokens


def test_completions_streamed_equals_non_streamed(client: openai.OpenAI, tokenizer):
    kwargs = dict(model=SERVED_MODEL, prompt=PROMPT, max_tokens=10, **GREEDY)
    full = client.completions.create(**kwargs, extra_body={"ignore_eos": True})
    assert full.usage.completion_tokens == 10
    assert full.usage.prompt_tokens == len(tokenizer(PROMPT)["input_ids"])
    streamed = "".join(
        c.choices[0].text
        for c in client.completions.create(**kwargs, stream=True, extra_body={"ignore_eos": True})
        if c.choices
    )
    assert streamed == full.choices[0].text and streamed


def test_n_lists_of_prompts_and_token_ids(client: openai.OpenAI, tokenizer):
    kwargs = dict(model=SERVED_MODEL, max_tokens=8, extra_body={"ignore_eos": True}, **GREEDY)
    single = client.completions.create(prompt=PROMPT, **kwargs)
    text = single.choices[0].text

    two = client.completions.create(prompt=PROMPT, n=2, **kwargs)
    assert sorted(c.index for c in two.choices) == [0, 1]
    assert all(c.text == text for c in two.choices)  # greedy: both choices agree
    assert two.usage.completion_tokens == 16
    assert two.usage.prompt_tokens == single.usage.prompt_tokens

    other = "Hello world!"
    listed = client.completions.create(prompt=[PROMPT, other], **kwargs)
    by_index = {c.index: c.text for c in listed.choices}
    assert by_index[0] == text
    assert by_index[1] == client.completions.create(prompt=other, **kwargs).choices[0].text
    assert listed.usage.completion_tokens == 16

    ids = tokenizer(PROMPT)["input_ids"]
    from_ids = client.completions.create(prompt=ids, **kwargs)
    assert from_ids.choices[0].text == text
    assert from_ids.usage.prompt_tokens == len(ids)
    other_ids = tokenizer(other)["input_ids"]
    from_id_lists = client.completions.create(prompt=[ids, other_ids], **kwargs)
    assert {c.index: c.text for c in from_id_lists.choices} == by_index

    chat_two = client.chat.completions.create(messages=MESSAGES, n=2, **kwargs)
    assert len(chat_two.choices) == 2
    assert chat_two.choices[0].message.content == chat_two.choices[1].message.content


def test_errors_raise_the_clients_exceptions(client: openai.OpenAI):
    with pytest.raises(openai.NotFoundError) as not_found:
        client.chat.completions.create(model="no-such-model", messages=MESSAGES, max_tokens=4)
    assert not_found.value.code == "model_not_found"
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="no-such-model", prompt="x", max_tokens=4, stream=True)
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=SERVED_MODEL, messages=[], max_tokens=4)
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=SERVED_MODEL, prompt=PROMPT, max_tokens=-1)
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=SERVED_MODEL, prompt=PROMPT, temperature=-1.0)
    wrong_key = openai.OpenAI(base_url=str(client.base_url), api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        wrong_key.models.list()
