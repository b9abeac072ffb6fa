"""The worker with TENSOR_PARALLEL_SIZE=2: the same OpenAI answers as with one rank, the
parallel size on the start-up line, and each rank's state in the engine stats."""

from __future__ import annotations

from serverless_llm.worker.handler import ready_line
from tests.worker.conftest import run, run_job


def _answers(worker) -> tuple[list, list, str, list]:
    model = worker.settings.served_model_name
    completion = {"model": model, "prompt": "The quick brown", "max_tokens": 24}
    chat = {
        "model": model,
        "messages": [{"role": "user", "content": "Hello world!"}],
        "max_tokens": 24,
        "temperature": 0,
    }
    common = {"temperature": 0, "ignore_eos": True}

    async def scenario(w):
        a = await run_job(
            w, {"openai_route": "/v1/completions", "openai_input": completion | common}
        )
        b = await run_job(w, {"openai_route": "/v1/chat/completions", "openai_input": chat})
        return a, b, ready_line(w), w.engine.stats().ranks

    return run(worker, scenario)


def test_two_ranks_serve_the_openai_routes_as_one_does(make_worker):
    one_completion, one_chat, one_line, one_ranks = _answers(make_worker())
    two_completion, two_chat, two_line, two_ranks = _answers(make_worker(TENSOR_PARALLEL_SIZE="2"))
    text = [c["choices"][0]["text"] for c in (one_completion[0], two_completion[0])]
    assert text[0] and text[0] == text[1]
    chat = [c["choices"][0]["message"]["content"] for c in (one_chat[0], two_chat[0])]
    assert chat[0] and chat[0] == chat[1]
    assert "tensor_parallel_size=1" in one_line and "tensor_parallel_size=2" in two_line
    assert one_ranks == []
    assert [r["rank"] for r in two_ranks] == [0, 1] and all(r["alive"] for r in two_ranks)
    assert two_ranks[0]["param_bytes"] == two_ranks[1]["param_bytes"] > 0
