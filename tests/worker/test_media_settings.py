"""The multimodal settings: LIMIT_MM_PER_PROMPT, MAX_IMAGE_BYTES, MEDIA_FETCH_TIMEOUT (and vLLM's
VLLM_IMAGE_FETCH_TIMEOUT), ALLOW_PRIVATE_IMAGE_URLS, ALLOWED_LOCAL_MEDIA_PATH: parsed, refused
with one line, and handed to the routes as one MediaConfig."""

from __future__ import annotations

import os

import pytest

from serverless_llm.api.media import MAX_IMAGE_PIXELS, MediaConfig
from serverless_llm.worker.settings import ENV_TO_FIELD, Settings, SettingsError


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    for name in list(os.environ):
        if name.upper() in ENV_TO_FIELD:
            monkeypatch.delenv(name)


def test_defaults():
    config = Settings.from_env({}).media_config
    assert config == MediaConfig()
    # vLLM's defaults: one image a prompt, 5 s to fetch one.
    assert config.limit_mm_per_prompt == {"image": 1} and config.media_fetch_timeout == 5.0
    assert config.max_image_bytes == 20 << 20 and config.max_image_pixels == MAX_IMAGE_PIXELS
    assert config.allow_private_image_urls is False and config.allowed_local_media_path is None


def test_values(tmp_path):
    s = Settings.from_env(
        {
            "LIMIT_MM_PER_PROMPT": '{"image": 4, "video": 0}',
            "MAX_IMAGE_BYTES": "1000",
            "MEDIA_FETCH_TIMEOUT": "2.5",
            "ALLOW_PRIVATE_IMAGE_URLS": "1",
            "ALLOWED_LOCAL_MEDIA_PATH": str(tmp_path),
        }
    )
    assert s.media_config == MediaConfig(
        max_image_bytes=1000,
        media_fetch_timeout=2.5,
        allow_private_image_urls=True,
        allowed_local_media_path=str(tmp_path),
        limit_mm_per_prompt={"image": 4, "video": 0},
    )
    assert Settings.from_env({"LIMIT_MM_PER_PROMPT": "image=3"}).media_config.limit("image") == 3
    # vLLM's name for the timeout is read too.
    assert (
        Settings.from_env({"VLLM_IMAGE_FETCH_TIMEOUT": "9"}).media_config.media_fetch_timeout == 9
    )


@pytest.mark.parametrize(
    "env, must_contain",
    [
        ({"LIMIT_MM_PER_PROMPT": '{"imag": 1}'}, "LIMIT_MM_PER_PROMPT="),
        ({"LIMIT_MM_PER_PROMPT": '{"image": -1}'}, "LIMIT_MM_PER_PROMPT="),
        ({"LIMIT_MM_PER_PROMPT": "four"}, "LIMIT_MM_PER_PROMPT="),
        ({"MAX_IMAGE_BYTES": "0"}, "MAX_IMAGE_BYTES='0'"),
        ({"MEDIA_FETCH_TIMEOUT": "0"}, "MEDIA_FETCH_TIMEOUT='0'"),
        ({"VLLM_IMAGE_FETCH_TIMEOUT": "-1"}, "VLLM_IMAGE_FETCH_TIMEOUT='-1'"),
        ({"ALLOWED_LOCAL_MEDIA_PATH": "relative/dir"}, "existing directory"),
        ({"ALLOWED_LOCAL_MEDIA_PATH": "/no/such/dir/here"}, "existing directory"),
    ],
)
def test_bad_values_give_one_line(env, must_contain):
    with pytest.raises(SettingsError) as e:
        Settings.from_env(env)
    assert must_contain in str(e.value) and "\n" not in str(e.value)
