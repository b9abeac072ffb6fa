"""The throughput benchmark runs end to end at its CI size, transformers baselines included, on a
tiny random model (the real run is by hand; results in docs/benchmarks.md)."""

from __future__ import annotations

from tests.bench_harness import run_bench


def test_throughput_tiny(tiny_llama, tmp_path):
    run = run_bench("throughput.py", tiny_llama, tmp_path)
    assert "engine=" in run.summary and "generate_batch=" in run.summary

    report = run.report
    assert report["num_prompts"] == 4 and report["max_tokens"] == 8
    assert report["engine"]["output_tokens_per_s"] > 0
    assert report["generate"]["output_tokens_per_s"] > 0
    assert report["generate_batch"]["output_tokens_per_s"] > 0
    assert report["compute_ceiling_tokens_per_s"] > 0
    for key in ("engine_vs_generate_batch", "engine_vs_generate"):
        assert report["ratios"][key] > 0


def test_endpoint_tiny(tiny_llama, tmp_path):
    """The worker-overhead benchmark: offline engine, then the local endpoint in a subprocess
    driven by the official OpenAI client, same prompts."""
    run = run_bench("endpoint.py", tiny_llama, tmp_path)
    assert run.summary.startswith("SUMMARY offline="), run.stdout[-4000:]
    report = run.report
    assert report["offline_tok_s"] > 0 and report["endpoint_tok_s"] > 0
    assert len(report["rounds"]) == 1 and report["rounds"][0]["endpoint_s"] > 0


def test_families_tiny(tiny_llama, tmp_path):
    """The families benchmark: tiny models of two families (the Llama reference and Gemma 2),
    the engine and generate_batch each in its own process."""
    run = run_bench("families.py", tiny_llama, tmp_path, timeout=400)
    assert run.summary.startswith("SUMMARY families=2 "), run.stdout[-4000:]
    results = run.report["results"]
    assert set(results) == {"llama", "gemma2"}
    for r in results.values():
        assert r["engine"]["tok_s"] > 0 and r["generate_batch"]["tok_s"] > 0
        assert r["rounds"] == [
            {"engine": r["engine"]["tok_s"], "generate_batch": r["generate_batch"]["tok_s"]}
        ]
    assert results["llama"]["vs_llama"] == 1.0


def test_moe_tiny(tiny_llama, tmp_path):
    """The MoE benchmark: a tiny Qwen3-MoE against generate_batch, and its dense twin."""
    run = run_bench("moe.py", tiny_llama, tmp_path, timeout=400)
    assert run.summary.startswith("SUMMARY moe_vs_generate_batch="), run.stdout[-4000:]
    results = run.report["results"]
    assert all(results[k]["tok_s"] > 0 for k in ("engine", "generate_batch", "dense"))
    assert run.report["params"]["moe"] > run.report["params"]["dense"]


def test_vision_tiny(tiny_llama, tmp_path):
    """The vision benchmark: a tiny Qwen2.5-VL, 4 one-image requests through the engine and
    transformers' padded generate (each in its own process), then one request's first token."""
    run = run_bench("vision.py", tiny_llama, tmp_path, timeout=300)
    assert run.summary.startswith("SUMMARY throughput_ratio="), run.stdout[-4000:]
    report = run.report
    assert report["num_requests"] == 4 and report["max_tokens"] == 8
    for system in ("engine", "transformers"):
        r = report["results"][system]
        assert r["throughput"]["tokens"] == 4 * 8 and r["throughput"]["tok_s"] > 0
        assert r["throughput"]["phases"]["tower_s"] > 0 and r["ttft"]["phases"]["tower_s"] > 0
        assert r["ttft"]["seconds"] > 0
    assert report["ratios"]["throughput"] > 0 and report["ratios"]["ttft"] > 0


def test_lora_tiny(tiny_llama, tmp_path):
    """The LoRA benchmark: four random adapters on every projection against no adapter."""
    run = run_bench("lora.py", tiny_llama, tmp_path)
    assert run.summary.startswith("SUMMARY lora_vs_base="), run.stdout[-4000:]
    assert run.report["tok_s"]["base"] > 0 and run.report["tok_s"]["lora"] > 0


def test_families_rounds_keep_each_systems_best():
    from bench.families import _best

    slow, fast = {"tok_s": 10.0}, {"tok_s": 12.0}
    assert _best(slow, fast) is fast and _best(fast, slow) is fast
    assert _best(None, slow) is slow and _best(slow, None) is slow and _best(None, None) is None


def test_soak_tiny(tiny_llama, tmp_path):
    """The soak benchmark for a few seconds: 4 clients, the whole request mix (streams, n=2,
    logprobs, guided, stop strings, disconnects, cancels, bad requests) through the local
    endpoint; nothing dies, nothing answers 5xx, every KV block is free again at the end."""
    run = run_bench("soak.py", tiny_llama, tmp_path)
    assert run.summary.startswith("SUMMARY served="), run.stdout[-4000:]
    report = run.report
    assert report["served_total"] > 0, run.stdout[-4000:]
    assert report["http_5xx"] == 0 and report["worker_deaths"] == 0, run.stdout[-4000:]
    assert report["checks"]["no_leaked_blocks"], run.stdout[-4000:]
    assert report["kv_blocks"]["free"] == report["kv_blocks"]["total"] > 0


def test_capture_tiny(tiny_llama, capsys):
    """bench/capture.py on CPU: the eager-replay twin against eager, at a tiny size."""
    from bench.capture import main

    args = ["--model", tiny_llama, "--num-prompts", "3", "--max-tokens", "4", "--rounds", "1"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "capture: replay, buckets [1, 2, 3]" in out
    assert "captured vs eager: 1-request decode" in out


def test_tensor_parallel_tiny(tiny_llama, capsys):
    """bench/tensor_parallel.py: the communication table, and a tiny dummy Llama at TP 1 and 2
    with the all-reduces of a step counted (2 per layer + the embedding's)."""
    from bench.tensor_parallel import main

    assert main(["--measure", "--tiny", "--tokenizer", tiny_llama]) == 0
    out = capsys.readouterr().out
    assert "llama-70b   8         161" in out
    assert "TP 2: 9 all-reduces per step counted on rank 0" in out
    assert "SUMMARY TP2/TP1 throughput" in out


def test_kv_capacity_tiny(capsys):
    from bench import kv_capacity

    args = ["--budget-gib", "0.5", "--tokens", "2048", "--new-tokens", "256", "--check"]
    assert kv_capacity.main(args) == 0
    out = capsys.readouterr().out
    summary = out.strip().splitlines()[-1]
    assert summary.startswith("SUMMARY") and "gemma3-1b" in summary and "mistral-7b" in summary
    # Gemma 3's local layers hold a quarter of 2k tokens: far more requests fit.
    assert float(summary.split("gemma3-1b ")[1].split("x")[0]) > 2


def test_mla_kv_tiny(tiny_llama, capsys):
    """bench/mla_kv.py at 4 layers: the engine's KV bytes a token of the DeepSeek-V3-shaped
    dummy (4 x 576 x 2) against the same heads' K and V, under the 1/8 bar."""
    from bench import mla_kv

    assert mla_kv.main(["--layers", "4", "--tokenizer", tiny_llama]) == 0
    summary = capsys.readouterr().out.strip().splitlines()[-1]
    assert summary.startswith("SUMMARY mla_kv_bytes_per_token=4608 gqa_equivalent=327680")
    assert "PASS" in summary


def test_gemma4_decode_attention_tiny(capsys):
    """bench/gemma4_decode.py --attention: one layer's step on a layer view and on the wide
    tensor, through both CPU backends (no model), at a tiny size."""
    from bench.gemma4_decode import main

    assert main(["--attention", "--requests", "2", "--context", "40", "--repeats", "2"]) == 0
    out = capsys.readouterr().out
    for backend in ("native", "torch"):
        for layer in ("sliding (view)", "global"):
            assert any(line.startswith(f"{backend:7s} {layer}") for line in out.splitlines())
