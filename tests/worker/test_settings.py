"""Settings: every env var parsed and validated, one-line errors, limitations reported, the docs
generated from the code, and HF_TOKEN in no log line."""

from __future__ import annotations

import asyncio
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

from serverless_llm.api.batching import BatchSizes
from serverless_llm.engine.config import (
    GPU_MEMORY_UTILIZATION,
    KV_CACHE_DTYPE_CHOICES,
    KV_CACHE_DTYPES,
    QUANTIZED_WEIGHTS_MODES,
    EngineConfig,
)
from serverless_llm.engine.loader import ModelLoadError
from serverless_llm.engine.loader.quantization import QUANTIZATION_METHODS, SERVED_METHODS
from serverless_llm.worker.settings import (
    CATEGORIES,
    EMBEDDED_MODEL_NAME,
    ENV_TO_FIELD,
    Settings,
    SettingsError,
    settings_markdown,
    settings_metadata,
)
from serverless_llm.worker.settings import engine_config as settings_engine_config
from tests.worker.conftest import run_job

ROOT = Path(__file__).resolve().parents[2]

# The worker-vllm table plus the engine's own, as issue 4 lists them.
ISSUE_VARS = [
    "MODEL_NAME",
    "MODEL_REVISION",
    "MAX_MODEL_LEN",
    "BASE_PATH",
    "LOAD_FORMAT",
    "HF_TOKEN",
    "QUANTIZATION",
    "TRUST_REMOTE_CODE",
    "SEED",
    "KV_CACHE_DTYPE",
    "DTYPE",
    "TOKENIZER_NAME",
    "TOKENIZER_REVISION",
    "CUSTOM_CHAT_TEMPLATE",
    "GPU_MEMORY_UTILIZATION",
    "MAX_PARALLEL_LOADING_WORKERS",
    "BLOCK_SIZE",
    "SWAP_SPACE",
    "ENFORCE_EAGER",
    "MAX_CONTEXT_LEN_TO_CAPTURE",
    "MAX_SEQ_LEN_TO_CAPTURE",
    "DISABLE_CUSTOM_ALL_REDUCE",
    "DEFAULT_BATCH_SIZE",
    "DEFAULT_MIN_BATCH_SIZE",
    "DEFAULT_BATCH_SIZE_GROWTH_FACTOR",
    "RAW_OPENAI_OUTPUT",
    "OPENAI_SERVED_MODEL_NAME_OVERRIDE",
    "OPENAI_RESPONSE_ROLE",
    "MAX_CONCURRENCY",
    "DISABLE_LOG_STATS",
    "DISABLE_LOG_REQUESTS",
    "TENSOR_PARALLEL_SIZE",
    "MAX_NUM_SEQS",
    "MAX_NUM_BATCHED_TOKENS",
    "ENABLE_PREFIX_CACHING",
    "ATTENTION_BACKEND",
    "CPU_KV_CACHE_SPACE",
    "NUM_GPU_BLOCKS_OVERRIDE",
    "DEVICE",
]

# Every variable set to a value other than its default, and the field value it must give.
EVERY_VAR = {
    "MODEL_NAME": ("org/model", "model_name", "org/model"),
    "MODEL_REVISION": ("v2", "model_revision", "v2"),
    "MAX_MODEL_LEN": ("4096", "max_model_len", 4096),
    "BASE_PATH": ("/models", "base_path", "/models"),
    "LOAD_FORMAT": ("safetensors", "load_format", "safetensors"),
    "HF_TOKEN": ("hf_abc", "hf_token", None),  # checked separately: a SecretStr
    "TRUST_REMOTE_CODE": ("1", "trust_remote_code", True),
    "SEED": ("7", "seed", 7),
    "KV_CACHE_DTYPE": ("fp8", "kv_cache_dtype", "fp8"),
    "DTYPE": ("bfloat16", "dtype", "bfloat16"),
    "TOKENIZER_NAME": ("org/tok", "tokenizer_name", "org/tok"),
    "TOKENIZER_REVISION": ("t1", "tokenizer_revision", "t1"),
    "CUSTOM_CHAT_TEMPLATE": ("{{ messages }}", "custom_chat_template", "{{ messages }}"),
    "GPU_MEMORY_UTILIZATION": ("0.5", "gpu_memory_utilization", 0.5),
    "MAX_PARALLEL_LOADING_WORKERS": ("2", "max_parallel_loading_workers", 2),
    "BLOCK_SIZE": ("32", "block_size", 32),
    "SWAP_SPACE": ("2", "swap_space", 2.0),
    "ENFORCE_EAGER": ("true", "enforce_eager", True),
    "MAX_CONTEXT_LEN_TO_CAPTURE": ("1024", "max_seq_len_to_capture", 1024),
    "DISABLE_CUSTOM_ALL_REDUCE": ("1", "disable_custom_all_reduce", True),
    "DEFAULT_BATCH_SIZE": ("40", "default_batch_size", 40),
    "DEFAULT_MIN_BATCH_SIZE": ("2", "default_min_batch_size", 2),
    "DEFAULT_BATCH_SIZE_GROWTH_FACTOR": ("2.5", "default_batch_size_growth_factor", 2.5),
    "RAW_OPENAI_OUTPUT": ("0", "raw_openai_output", False),
    "OPENAI_SERVED_MODEL_NAME_OVERRIDE": (
        "my-model",
        "openai_served_model_name_override",
        "my-model",
    ),
    "OPENAI_RESPONSE_ROLE": ("bot", "openai_response_role", "bot"),
    "MAX_CONCURRENCY": ("12", "max_concurrency", 12),
    "DISABLE_LOG_STATS": ("false", "disable_log_stats", False),
    "DISABLE_LOG_REQUESTS": ("0", "disable_log_requests", False),
    "TENSOR_PARALLEL_SIZE": ("2", "tensor_parallel_size", 2),
    "MAX_NUM_SEQS": ("64", "max_num_seqs", 64),
    "MAX_NUM_BATCHED_TOKENS": ("1024", "max_num_batched_tokens", 1024),
    "ENABLE_PREFIX_CACHING": ("0", "enable_prefix_caching", False),
    "ATTENTION_BACKEND": ("torch", "attention_backend", "torch"),
    "DEVICE": ("cuda:1", "device", "cuda:1"),
    "CPU_KV_CACHE_SPACE": ("1.5", "cpu_kv_cache_space", 1.5),
    "NUM_GPU_BLOCKS_OVERRIDE": ("99", "num_gpu_blocks_override", 99),
}

FAKE_TOKEN = "hf_FAKEtoken0123456789abcdefSECRET"


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    """Settings read os.environ in some tests: start each from a clean slate."""
    for name in list(os.environ):
        if name.upper() in ENV_TO_FIELD:
            monkeypatch.delenv(name)


def test_issue_vars_are_all_settings():
    known = {row["env"] for row in settings_metadata()}
    known |= {a for row in settings_metadata() for a in row["aliases"]}
    assert [v for v in ISSUE_VARS if v not in known] == []


def test_every_variable_parsed():
    env = {name: raw for name, (raw, _, _) in EVERY_VAR.items()}
    s = Settings.from_env(env)
    for name, (_, field, expected) in EVERY_VAR.items():
        if field == "hf_token":
            assert s.hf_token.get_secret_value() == "hf_abc"
        else:
            assert getattr(s, field) == expected, name
    cfg = s.engine_config()
    assert cfg.model == "org/model" and cfg.revision == "v2" and cfg.max_model_len == 4096
    assert cfg.num_kv_blocks == 99 and cfg.kv_cache_space_gib == 1.5 and cfg.block_size == 32
    assert cfg.download_dir == os.path.join("/models", "huggingface-cache", "hub")
    assert cfg.hf_token == "hf_abc" and "hf_abc" not in repr(cfg)
    assert cfg.max_num_seqs == 64 and cfg.max_num_batched_tokens == 1024
    assert cfg.device == "cuda:1" and cfg.tokenizer == "org/tok" and cfg.dtype == "bfloat16"
    assert cfg.enforce_eager is True and cfg.max_seq_len_to_capture == 1024


def test_defaults_match_the_table():
    s = Settings.from_env({})
    assert s.model_name is None and s.served_model_name == EMBEDDED_MODEL_NAME
    assert s.base_path == "/runpod-volume" and s.load_format == "auto" and s.dtype == "auto"
    assert s.gpu_memory_utilization == 0.95 and s.block_size == 16 and s.max_concurrency == 300
    assert s.batch_sizes == BatchSizes(max_batch_size=50, min_batch_size=1, growth_factor=3.0)
    assert s.raw_openai_output is True and s.openai_response_role == "assistant"
    assert s.disable_log_stats is True and s.disable_log_requests is True
    assert s.limitations() == []
    assert s.engine_config().model is None  # the embedded default


def test_engine_rules_are_read_not_restated():
    """The choices and the one default the worker shares with the engine are the engine's own
    constants: the same objects, so a change in the engine reaches the settings, the docs and
    the console form."""
    rows = {row["env"]: row for row in settings_metadata()}
    assert rows["QUANTIZATION"]["choices"] == list(QUANTIZATION_METHODS)
    assert rows["KV_CACHE_DTYPE"]["choices"] == list(KV_CACHE_DTYPE_CHOICES)
    assert rows["QUANTIZED_WEIGHTS"]["choices"] == list(QUANTIZED_WEIGHTS_MODES)
    assert rows["KV_CACHE_DTYPE"]["choices"] == ["auto", *KV_CACHE_DTYPES]
    # One GPU memory default: the worker's, the engine's and the offline LLM's.
    assert rows["GPU_MEMORY_UTILIZATION"]["default"] == GPU_MEMORY_UTILIZATION
    assert EngineConfig().gpu_memory_utilization == GPU_MEMORY_UTILIZATION
    assert Settings.from_env({}).engine_config().gpu_memory_utilization == GPU_MEMORY_UTILIZATION
    # Every value each choice list offers is one the engine takes.
    for dtype in KV_CACHE_DTYPE_CHOICES:
        assert EngineConfig(kv_cache_dtype=dtype).kv_cache_dtype == dtype
    for mode in QUANTIZED_WEIGHTS_MODES:
        assert EngineConfig(quantized_weights=mode).quantized_weights == mode
    # A QUANTIZATION the engine serves starts; any other one stops start-up, with the reason.
    assert set(SERVED_METHODS) < set(QUANTIZATION_METHODS)
    for method in QUANTIZATION_METHODS:
        if method in SERVED_METHODS:
            assert Settings.from_env({"QUANTIZATION": method}).limitations() == [], method
        else:
            with pytest.raises(SettingsError, match=f"QUANTIZATION='{method}'"):
                Settings.from_env({"QUANTIZATION": method})


def test_reads_os_environ(monkeypatch):
    monkeypatch.setenv("MAX_MODEL_LEN", "1234")
    monkeypatch.setenv("TRUST_REMOTE_CODE", "TRUE")
    monkeypatch.setenv("MODEL_REVISION", "")  # the console sends "" for blank: unset
    s = Settings.from_env()
    assert s.max_model_len == 1234 and s.trust_remote_code is True and s.model_revision is None


@pytest.mark.parametrize(
    ("raw", "expected"),
    [("0", False), ("1", True), ("true", True), ("false", False), ("True", True), ("FALSE", False)],
)
def test_booleans(raw, expected):
    s = Settings.from_env({"TRUST_REMOTE_CODE": raw, "ENFORCE_EAGER": raw})
    assert s.trust_remote_code is expected and s.enforce_eager is expected


@pytest.mark.parametrize(
    ("env", "must_contain"),
    [
        ({"MAX_MODEL_LEN": "abc"}, ["MAX_MODEL_LEN", "'abc'", "integer >= 1"]),
        ({"MAX_MODEL_LEN": "0"}, ["MAX_MODEL_LEN", "'0'", "integer >= 1"]),
        ({"BLOCK_SIZE": "12"}, ["BLOCK_SIZE", "'12'", "8, 16, 32"]),
        ({"DTYPE": "float64"}, ["DTYPE", "'float64'", "bfloat16"]),
        ({"TRUST_REMOTE_CODE": "maybe"}, ["TRUST_REMOTE_CODE", "'maybe'", "0, 1, true or false"]),
        ({"GPU_MEMORY_UTILIZATION": "1.5"}, ["GPU_MEMORY_UTILIZATION", "'1.5'", "<= 1"]),
        ({"GPU_MEMORY_UTILIZATION": "nan"}, ["GPU_MEMORY_UTILIZATION", "'nan'"]),
        ({"LOAD_FORMAT": "onnx"}, ["LOAD_FORMAT", "'onnx'", "safetensors"]),
        ({"DEVICE": "tpu"}, ["DEVICE", "'tpu'", "cuda:N"]),
        ({"MAX_CONCURRENCY": "-3"}, ["MAX_CONCURRENCY", "'-3'", "integer >= 1"]),
        ({"DEFAULT_BATCH_SIZE_GROWTH_FACTOR": "0"}, ["DEFAULT_BATCH_SIZE_GROWTH_FACTOR", "> 0"]),
        ({"MIN_BATCH_SIZE": "zero"}, ["MIN_BATCH_SIZE", "'zero'"]),  # named as the user set it
        ({"KV_CACHE_DTYPE": "int4"}, ["KV_CACHE_DTYPE", "'int4'", "fp8"]),
        ({"QUANTIZATION": "bitsandbytes"}, ["QUANTIZATION", "'bitsandbytes'", "only GPTQ, AWQ"]),
        ({"ATTENTION_BACKEND": "flash"}, ["ATTENTION_BACKEND", "'flash'", "triton"]),
        ({"ENABLE_LORA": "1", "LORA_MODULES": "{oops"}, ["LORA_MODULES", "'{oops'"]),
        ({"ENABLE_LORA": "1", "LORA_MODULES": "a=/x a=/y"}, ["LORA_MODULES", "'a=/x a=/y'"]),
        ({"LORA_MODULES": "a=/x"}, ["LORA_MODULES is set but ENABLE_LORA is not"]),
        ({"MAX_LORAS": "0"}, ["MAX_LORAS", "'0'", ">= 1"]),
    ],
)
def test_bad_values_give_one_line(env, must_contain):
    with pytest.raises(SettingsError) as info:
        Settings.from_env(env)
    message = str(info.value)
    assert "\n" not in message
    for part in must_contain:
        assert part in message


def test_several_bad_values_still_one_line():
    with pytest.raises(SettingsError) as info:
        Settings.from_env({"SEED": "x", "BLOCK_SIZE": "7"})
    message = str(info.value)
    assert "\n" not in message and "SEED" in message and "BLOCK_SIZE" in message


def test_bad_env_stops_startup_with_one_line(worker_env):
    env = {k: v for k, v in os.environ.items() if k.upper() not in ENV_TO_FIELD}
    env.update(worker_env, MAX_MODEL_LEN="lots")
    proc = subprocess.run(
        [sys.executable, "-m", "serverless_llm.worker"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert lines == ["error: MAX_MODEL_LEN='lots' is not valid: expected an integer >= 1"]


def test_documented_batch_names_and_legacy_aliases():
    s = Settings.from_env(
        {
            "DEFAULT_BATCH_SIZE": "20",
            "DEFAULT_MIN_BATCH_SIZE": "4",
            "DEFAULT_BATCH_SIZE_GROWTH_FACTOR": "2",
        }
    )
    assert s.batch_sizes == BatchSizes(max_batch_size=20, min_batch_size=4, growth_factor=2.0)
    legacy = Settings.from_env({"MIN_BATCH_SIZE": "5", "BATCH_SIZE_GROWTH_FACTOR": "4"})
    assert (legacy.default_min_batch_size, legacy.default_batch_size_growth_factor) == (5, 4.0)
    both = Settings.from_env({"DEFAULT_MIN_BATCH_SIZE": "2", "MIN_BATCH_SIZE": "9"})
    assert both.default_min_batch_size == 2  # the documented name wins


def test_context_len_to_capture_aliases():
    assert Settings.from_env({"MAX_SEQ_LEN_TO_CAPTURE": "10"}).max_seq_len_to_capture == 10
    assert Settings.from_env({"MAX_CONTEXT_LEN_TO_CAPTURE": "11"}).max_seq_len_to_capture == 11


def test_served_model_name():
    assert Settings.from_env({"MODEL_NAME": "org/m"}).served_model_name == "org/m"
    both = {"MODEL_NAME": "org/m", "OPENAI_SERVED_MODEL_NAME_OVERRIDE": "alias"}
    assert Settings.from_env(both).served_model_name == "alias"
    assert Settings.from_env({}).served_model_name == "SmolLM2-135M-Instruct"


def test_served_model_names_and_unlisted_aliases(tmp_path):
    """SERVED_MODEL_NAME lists names (commas and/or spaces), after the override's; MODEL_NAME as
    written and its last component stay accepted without being listed."""
    model_dir = str(tmp_path / "my-model")
    os.mkdir(model_dir)
    s = Settings.from_env({"MODEL_NAME": model_dir})
    assert s.served_model_names == ("my-model",) and s.model_name_aliases == (model_dir,)
    s = Settings.from_env({"MODEL_NAME": model_dir, "SERVED_MODEL_NAME": "a, b  c,,a"})
    assert s.served_model_names == ("a", "b", "c") and s.served_model_name == "a"
    assert s.model_name_aliases == (model_dir, "my-model")
    both = {
        "MODEL_NAME": "org/m",
        "OPENAI_SERVED_MODEL_NAME_OVERRIDE": "x",
        "SERVED_MODEL_NAME": "y x",
    }
    s = Settings.from_env(both)
    assert s.served_model_names == ("x", "y") and s.model_name_aliases == ("org/m",)
    assert Settings.from_env({"SERVED_MODEL_NAME": "only"}).model_name_aliases == ()


def test_base_path(monkeypatch, tmp_path):
    s = Settings.from_env({"BASE_PATH": str(tmp_path)})
    assert s.download_dir == str(tmp_path / "huggingface-cache" / "hub")
    # The default where /runpod-volume is not there (no network volume, a local run): the HF
    # cache, and nothing is created at the filesystem's root.
    monkeypatch.setattr(settings_engine_config, "_volume_present", lambda path: False)
    assert Settings.from_env({}).download_dir is None
    assert Settings.from_env({"BASE_PATH": str(tmp_path)}).download_dir is not None
    monkeypatch.setattr(settings_engine_config, "_volume_present", lambda path: True)
    volume = os.path.join("/runpod-volume", "huggingface-cache", "hub")
    assert Settings.from_env({}).download_dir == volume


def test_limitations_warn_or_fail():
    s = Settings.from_env(
        {
            "TENSOR_PARALLEL_SIZE": "2",
            "SWAP_SPACE": "4",
            "KV_CACHE_DTYPE": "fp8",  # honoured since the 8-bit cache: not a limitation
            "MAX_PARALLEL_LOADING_WORKERS": "3",
            "MAX_CONTEXT_LEN_TO_CAPTURE": "4096",  # honoured since CUDA graphs: not a limitation
        }
    )
    lims = {lim.env: lim for lim in s.limitations()}
    # Tensor parallelism and its loading limit are honoured (parallel/): not limitations.
    assert set(lims) == {"SWAP_SPACE"}
    assert all(lim.level == "warning" for lim in lims.values())
    assert lims["SWAP_SPACE"].message.startswith("SWAP_SPACE=4.0: ")
    # Defaults, and values that ask for nothing, are not reported.
    quiet = {"TENSOR_PARALLEL_SIZE": "1", "SWAP_SPACE": "0", "ENFORCE_EAGER": "1"}
    assert Settings.from_env(quiet).limitations() == []


def test_limitations_are_logged_at_startup(make_worker, caplog):
    worker = make_worker(DISABLE_CUSTOM_ALL_REDUCE="1", SWAP_SPACE="1")
    with caplog.at_level(logging.INFO):
        worker.load()
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any(w.startswith("SWAP_SPACE=1.0:") for w in warnings)
    assert not any(w.startswith("DISABLE_CUSTOM_ALL_REDUCE") for w in warnings)
    info = [r.getMessage() for r in caplog.records if r.getMessage().startswith("settings: ")]
    assert len(info) == 1 and "DISABLE_CUSTOM_ALL_REDUCE=" in info[0]


def test_metadata_is_complete():
    rows = settings_metadata()
    assert len({row["env"] for row in rows}) == len(rows)
    for row in rows:
        assert row["title"] and row["description"], row["env"]
        assert row["category"] in CATEGORIES, row["env"]
        assert row["type"] in {"str", "int", "float", "bool", "secret"}, row["env"]
        assert row["form_type"] in {"text", "number", "toggle", "select"}, row["env"]
        if row["form_type"] == "select":
            assert row["default"] is None or row["default"] in row["choices"], row["env"]


def test_docs_are_current():
    """docs/settings.md is generated: regenerate it with
    `python -m serverless_llm.worker.settings --markdown > docs/settings.md`."""
    on_disk = (ROOT / "docs" / "settings.md").read_text()
    assert on_disk == settings_markdown()
    for row in settings_metadata():
        assert f"`{row['env']}`" in on_disk


def test_hf_token_never_logged(monkeypatch, make_worker, tmp_path):
    """Everything the worker logs at every level, with a fake token set, on the paths that
    touch it: settings, start-up, a job, a failing hub lookup."""
    monkeypatch.setenv("HF_TOKEN", FAKE_TOKEN)
    records: list[str] = []

    class Capture(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(logging.Formatter("%(name)s %(message)s").format(record))

    root = logging.getLogger()
    handler = Capture(level=logging.DEBUG)
    old_level = root.level
    root.addHandler(handler)
    root.setLevel(logging.DEBUG)
    try:
        worker = make_worker(HF_TOKEN=FAKE_TOKEN, DISABLE_LOG_REQUESTS="0")
        settings = worker.settings
        assert settings.hf_token.get_secret_value() == FAKE_TOKEN
        logging.getLogger("test").debug("settings %r %s", settings, settings)
        logging.getLogger("test").debug("config %r", settings.engine_config())

        async def scenario():
            await worker.start()
            items = await run_job(worker, {"prompt": "Hello", "sampling_params": {"max_tokens": 4}})
            await worker.shutdown()
            return items

        assert "error" not in asyncio.run(scenario())[0]

        hub = make_worker(HF_TOKEN=FAKE_TOKEN, MODEL_NAME="someorg/private-model")
        with pytest.raises(ModelLoadError) as info:
            hub.load()
        assert FAKE_TOKEN not in str(info.value)
        logging.getLogger("test").exception("load failed", exc_info=info.value)
        with pytest.raises(SettingsError) as bad:
            Settings.from_env({"HF_TOKEN": FAKE_TOKEN, "SEED": "x"})
        assert FAKE_TOKEN not in str(bad.value)
    finally:
        root.removeHandler(handler)
        root.setLevel(old_level)
    assert len(records) > 5
    assert any("settings: " in r and "HF_TOKEN=***" in r for r in records)
    leaked = [r for r in records if FAKE_TOKEN in r or FAKE_TOKEN[3:20] in r]
    assert leaked == []


def test_tool_call_settings(tmp_path):
    s = Settings.from_env({"ENABLE_AUTO_TOOL_CHOICE": "1", "TOOL_CALL_PARSER": "hermes"})
    assert s.enable_auto_tool_choice and s.tool_call_parser == "hermes"
    # On by default; the parser then comes from the chat template when TOOL_CALL_PARSER is unset.
    s = Settings.from_env({})
    assert s.enable_auto_tool_choice and s.tool_call_parser is None
    assert not Settings.from_env({"ENABLE_AUTO_TOOL_CHOICE": "0"}).enable_auto_tool_choice
    with pytest.raises(SettingsError, match="not a tool call parser"):
        Settings.from_env({"TOOL_CALL_PARSER": "nope"})
    with pytest.raises(SettingsError, match="TOOL_PARSER_PLUGIN"):
        Settings.from_env({"TOOL_PARSER_PLUGIN": str(tmp_path / "missing.py")})
    plugin = tmp_path / "my_parser.py"
    plugin.write_text(
        "from serverless_llm.api.openai.tool_parsers import (\n"
        "    ExtractedToolCalls, ToolParser, register_tool_parser)\n\n"
        "@register_tool_parser('settings_test_parser')\n"
        "class P(ToolParser):\n"
        "    def extract(self, text):\n"
        "        return ExtractedToolCalls(text, [])\n"
    )
    s = Settings.from_env(
        {
            "TOOL_PARSER_PLUGIN": str(plugin),
            "TOOL_CALL_PARSER": "settings_test_parser",
            "ENABLE_AUTO_TOOL_CHOICE": "1",
        }
    )
    assert s.tool_call_parser == "settings_test_parser"


def test_a_local_model_path_is_served_by_its_last_component(tmp_path, monkeypatch):
    """Never a path with slashes (issue 15): clients read a prefix before '/' as a provider."""
    model_dir = tmp_path / "my-model"
    model_dir.mkdir()
    gguf = tmp_path / "tiny.Q4_1.gguf"
    gguf.write_bytes(b"")
    monkeypatch.chdir(tmp_path)
    cases = {
        str(model_dir): "my-model",
        str(model_dir) + "/": "my-model",
        "./my-model": "my-model",
        "my-model": "my-model",  # relative, and on disk: the loader reads it as a path
        str(gguf): "tiny.Q4_1.gguf",
        "org/not-on-disk": "org/not-on-disk",  # a hub repo id stays as it is
    }
    for name, served in cases.items():
        assert Settings.from_env({"MODEL_NAME": name}).served_model_name == served, name
    both = {"MODEL_NAME": str(model_dir), "OPENAI_SERVED_MODEL_NAME_OVERRIDE": "a/b"}
    assert Settings.from_env(both).served_model_name == "a/b"


def test_lora_modules_in_both_formats():
    """worker-vllm's JSON (one object or a list) and vLLM's name=path pairs."""
    json_list = (
        '[{"name": "sql", "path": "org/sql-lora", "base_model_name": "base"},'
        ' {"name": "chat", "path": "/adapters/chat"}]'
    )
    cases = {
        json_list: [("sql", 1, "org/sql-lora", "base"), ("chat", 2, "/adapters/chat", None)],
        '{"name": "one", "path": "/a"}': [("one", 1, "/a", None)],
        "sql=/a/sql, chat=org/chat": [("sql", 1, "/a/sql", None), ("chat", 2, "org/chat", None)],
    }
    for text, want in cases.items():
        settings = Settings.from_env(
            {"ENABLE_LORA": "true", "LORA_MODULES": text, "MAX_LORAS": "2"}
        )
        got = [
            (r.lora_name, r.lora_int_id, r.lora_path, r.base_model_name)
            for r in settings.lora_requests()
        ]
        assert got == want
        config = settings.engine_config()
        assert config.enable_lora and config.max_loras == 2
