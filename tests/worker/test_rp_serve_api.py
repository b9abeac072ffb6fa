"""runpod's own local API (`--rp_serve_api`) drives the worker as the image runs it:
`python -m serverless_llm.worker`, POST /runsync, the aggregated list of stream items back."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import httpx
import pytest

from serverless_llm.worker import settings as settings_module


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture()
def rp_server(worker_env, tmp_path):
    port = _free_port()
    env = {
        k: v
        for k, v in os.environ.items()
        if k.upper() not in settings_module.ENV_TO_FIELD and not k.startswith("RUNPOD_")
    }
    env.update(
        worker_env,
        RUNPOD_SKIP_AUTO_SYSTEM_CHECKS="true",
        RUNPOD_SKIP_GPU_CHECK="true",
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
    )
    log = open(tmp_path / "server.log", "w+")  # noqa: SIM115 - read back on failure
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "serverless_llm.worker",
            "--rp_serve_api",
            "--rp_api_host",
            "127.0.0.1",
            "--rp_api_port",
            str(port),
        ],
        env=env,
        cwd=tmp_path,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            if proc.poll() is not None:
                log.seek(0)
                pytest.fail(f"the worker exited with {proc.returncode}:\n{log.read()[-4000:]}")
            try:
                httpx.get(f"{base}/docs", timeout=1.0)
                break
            except httpx.HTTPError:
                if time.monotonic() > deadline:
                    pytest.fail("the worker did not start within 120 s")
                time.sleep(0.2)
        yield base
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


def test_runsync_returns_the_aggregated_stream(rp_server):
    params = {"max_tokens": 60, "ignore_eos": True, "temperature": 0}
    streamed = httpx.post(
        f"{rp_server}/runsync",
        json={"input": {"prompt": "Hello world", "sampling_params": params, "stream": True}},
        timeout=60,
    ).json()
    whole = httpx.post(
        f"{rp_server}/runsync",
        json={"input": {"prompt": "Hello world", "sampling_params": params}},
        timeout=60,
    ).json()
    bad = httpx.post(
        f"{rp_server}/runsync",
        json={"input": {"prompt": "Hello", "sampling_params": {"foo": 1}}},
        timeout=60,
    ).json()

    assert streamed["status"] == "COMPLETED"
    items = streamed["output"]
    assert isinstance(items, list)
    assert [len(i["choices"][0]["tokens"]) for i in items] == [1, 3, 9, 27, 20]
    text = "".join(t for i in items for t in i["choices"][0]["tokens"])
    assert items[-1]["usage"]["output"] == 60

    assert whole["status"] == "COMPLETED" and len(whole["output"]) == 1
    assert whole["output"][0]["choices"][0]["tokens"] == [text]
    assert whole["output"][0]["usage"]["output"] == 60

    # The local API reports a yielded error as an output item (the platform fails the job).
    assert bad["output"] == [{"error": "unknown sampling parameter 'foo'"}]
