"""`python -m serverless_llm.devserver` as a user runs it: env-configured, prints how to call
it, refuses bad settings in one line."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

import httpx

from serverless_llm.devserver.__main__ import banner, main


def run_devserver(env: dict[str, str], *args: str) -> subprocess.Popen:
    full_env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1", **env}
    return subprocess.Popen(
        [sys.executable, "-m", "serverless_llm.devserver", *args],
        env=full_env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def test_bad_env_value_stops_start_up_in_one_line():
    proc = run_devserver({"MAX_CONCURRENCY": "lots"})
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 2
    lines = out.strip().splitlines()
    assert len(lines) == 1 and "MAX_CONCURRENCY" in lines[0] and "'lots'" in lines[0]


def test_bad_port_is_refused(capsys):
    assert main(["--port", "http"]) == 2
    assert capsys.readouterr().err == "error: port='http': allowed an integer in 0..65535\n"


def test_starts_prints_how_to_call_and_serves(tiny_llama: str, tmp_path):
    secret = "s3cret-key-value"
    proc = run_devserver(
        {
            "MODEL_NAME": tiny_llama,
            "BASE_PATH": str(tmp_path),
            "DEVICE": "cpu",
            "MAX_MODEL_LEN": "128",
            "NUM_KV_BLOCKS": "64",
            "DEVSERVER_API_KEY": secret,
        },
        "--port",
        "0",
        "--log-level",
        "warning",
    )
    lines: list[str] = []
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            lines.append(line)
            if line.lstrip().startswith("Health:"):
                break
        out = "".join(lines)
        match = re.search(r"ready at (http://127\.0\.0\.1:\d+)", out)
        assert match, out
        base = match.group(1)
        assert f'OpenAI(base_url="{base}/openai/v1"' in out and f"curl -s {base}/runsync" in out
        job = {"input": {"prompt": "Hello", "sampling_params": {"max_tokens": 3}}}
        resp = httpx.post(
            f"{base}/runsync", json=job, headers={"Authorization": f"Bearer {secret}"}, timeout=30
        )
        assert resp.json()["status"] == "COMPLETED"
        assert httpx.post(f"{base}/runsync", json=job).status_code == 401
    finally:
        proc.send_signal(signal.SIGINT)
        rest, _ = proc.communicate(timeout=30)
    assert proc.returncode == 0  # a clean, graceful shutdown (see test_shutdown.py)
    assert "Traceback" not in rest
    assert secret not in out + rest


def test_banner_never_shows_the_key():
    text = banner("0.0.0.0", 8000, "my-model", api_key_set=True)
    assert "http://127.0.0.1:8000/openai/v1" in text
    assert "$DEVSERVER_API_KEY" in text
