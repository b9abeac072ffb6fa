"""Helpers shared by the benchmarks: machine limits measured in the same run, model cost from its
config, realistic chat prompts as token ids, timing and a plain-text table.

Every benchmark compares systems in one process, on the same machine, model and token ids, and
states the result as ratios (see docs/benchmarks.md).
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from functools import partial
from typing import Any, Generic, TypeVar

import torch

T = TypeVar("T")

# Thirty-two different user questions, a realistic chat mix: short facts, explanations, code,
# writing. Each goes through the model's chat template as the only user message.
QUESTIONS = (
    "What is the capital of France?",
    "Explain photosynthesis in simple terms.",
    "Write a haiku about autumn rain.",
    "How do I reverse a list in Python?",
    "What are the main causes of climate change?",
    "Give me three tips for a good night's sleep.",
    "What is the difference between a virus and a bacterium?",
    "Summarize the plot of Romeo and Juliet in two sentences.",
    "How does a refrigerator keep food cold?",
    "What is a prime number? Give some examples.",
    "Write a short poem about the ocean.",
    "Why is the sky blue?",
    "How can I improve my public speaking skills?",
    "Explain what an API is to a beginner.",
    "What should I pack for a weekend camping trip?",
    "What is the Pythagorean theorem?",
    "Suggest a healthy breakfast that takes five minutes.",
    "How do vaccines work?",
    "Write a SQL query that counts the rows in a table named users.",
    "What are the benefits of learning a second language?",
    "Describe the water cycle.",
    "How do I make a cup of green tea?",
    "What is machine learning?",
    "Tell me a fun fact about octopuses.",
    "What is the difference between weather and climate?",
    "How do I write a good cover letter?",
    "Explain recursion with a simple example.",
    "What were the main causes of World War I?",
    "How many planets are in the solar system? Name them.",
    "Give me a recipe idea for a quick vegetarian dinner.",
    "What does HTTP stand for and what does it do?",
    "How can I stay motivated while studying?",
)


# -- the machine --------------------------------------------------------------------------------


def cpu_count() -> int:
    """Cores this process may run on (the affinity mask, not the host's total)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


class BusyProcesses:
    """Context manager: `n` processes that each keep a core busy (a pure-Python spin loop), the
    competing load of issue 13's contention bar; killed on exit."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.procs: list[subprocess.Popen] = []

    def __enter__(self) -> BusyProcesses:
        self.procs = [
            subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(self.n)
        ]
        return self

    def __exit__(self, *exc: object) -> None:
        for p in self.procs:
            p.kill()
        for p in self.procs:
            p.wait()


def set_threads(n: int | None = None) -> int:
    """One torch thread per usable core (torch's default can oversubscribe in containers)."""
    n = n or cpu_count()
    torch.set_num_threads(n)
    return n


def cpu_model_name() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.lower().startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cpu_flags() -> list[str]:
    """The SIMD flags that decide the CPU paths' speed (of avx2, avx512f, avx512_bf16, amx_tile)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("flags"):
                    have = set(line.split(":", 1)[1].split())
                    return [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_tile") if f in have]
    except OSError:
        pass
    return []


def load_average() -> tuple[float, float, float] | None:
    try:
        return os.getloadavg()
    except OSError:
        return None


def machine_info() -> dict[str, Any]:
    import transformers

    return {
        "cpu": cpu_model_name(),
        "cores": cpu_count(),
        "flags": cpu_flags(),
        "torch_threads": torch.get_num_threads(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
    }


def measure_matmul_flops(
    n: int = 2048, dtype: torch.dtype = torch.float32, repeats: int = 5
) -> float:
    """FLOP/s of one large square matmul on this machine: the best of `repeats` timings."""
    a = torch.randn(n, n, dtype=dtype)
    b = torch.randn(n, n, dtype=dtype)
    out = torch.empty(n, n, dtype=dtype)
    torch.mm(a, b, out=out)  # warm-up: thread pool start, page faults
    best = min(_timed(lambda: torch.mm(a, b, out=out)) for _ in range(repeats))
    return 2.0 * n**3 / best


def measure_onednn_matmul_flops(n: int = 2048, repeats: int = 5) -> float | None:
    """FLOP/s of the same matmul through oneDNN with a pre-packed weight (what the engine's CPU
    linear layers use; on AMD processors torch.mm's MKL path can be far below it), or None where
    this torch build lacks the op."""
    try:
        a = torch.randn(n, n)
        w = torch.ops.mkldnn._reorder_linear_weight(torch.randn(n, n), n)

        def run() -> torch.Tensor:
            return torch.ops.mkldnn._linear_pointwise(a, w, None, "none", [], "")

        run()
    except Exception:  # op missing in this build, or no oneDNN
        return None
    best = min(_timed(run) for _ in range(repeats))
    return 2.0 * n**3 / best


def measure_memory_bandwidth(nbytes: int = 256 << 20, repeats: int = 5) -> float:
    """Bytes/s of a large tensor copy (counted as read + write), the best of `repeats`: the
    ceiling for work that streams every weight once, like a one-request decode step."""
    src = torch.ones(nbytes // 4, dtype=torch.float32)
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = min(_timed(lambda: dst.copy_(src)) for _ in range(repeats))
    return 2.0 * nbytes / best


def measure_read_bandwidth(nbytes: int = 1 << 30, repeats: int = 5) -> float:
    """Bytes/s of reading a large tensor once (a sum over it, all torch threads), the best of
    `repeats`: the ceiling a one-request decode step meets when it reads every weight once (a
    copy, `measure_memory_bandwidth`, also writes, and reads slower on most machines)."""
    src = torch.ones(nbytes // 4, dtype=torch.float32)
    src.sum()
    best = min(_timed(lambda: src.sum()) for _ in range(repeats))
    return nbytes / best


class CpuCompetition:
    """Context manager: how many cores other processes kept busy while it was open, from
    /proc/stat (whole machine) minus this process's own CPU time (and that of `pids`, the
    processes the measurement itself runs, such as a server under test). Near 0 means the timing
    inside is clean; on a 2-core machine 0.5 already distorts it (OpenMP waits on preempted
    threads).

        with CpuCompetition(pids=[server.pid]) as c:
            run()
        c.other_cores  # None where /proc/stat is missing
        c.own_cores  # cores this process and `pids` kept busy
        c.own_seconds  # their CPU seconds
    """

    def __init__(self, pids: list[int] | tuple[int, ...] = ()) -> None:
        self.pids = tuple(pids)
        self.other_cores: float | None = None
        self.own_cores: float | None = None
        self.own_seconds: float | None = None  # CPU seconds of this process and `pids`

    def _own(self) -> float:
        return _own_cpu_seconds() + sum(process_cpu_seconds(p) for p in self.pids)

    def __enter__(self) -> CpuCompetition:
        self.other_cores = self.own_cores = self.own_seconds = None
        self._start = (time.perf_counter(), _machine_busy_seconds(), self._own())
        return self

    def __exit__(self, *exc: object) -> None:
        wall0, busy0, own0 = self._start
        wall = time.perf_counter() - wall0
        busy1 = _machine_busy_seconds()
        own = self._own() - own0
        self.own_seconds = own
        if wall <= 0:
            return
        self.own_cores = own / wall
        if busy0 is None or busy1 is None:
            return
        self.other_cores = max(0.0, ((busy1 - busy0) - own) / wall)


def stop_process(proc: subprocess.Popen, grace: float = 30.0) -> None:
    """Ends a server the bench started: SIGTERM (its graceful shutdown), then SIGKILL if it
    is still there after `grace` seconds. Nothing happens to one that has exited already."""
    if proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        proc.kill()


def child_result(cmd: list[str], what: str) -> dict:
    """Runs one system's child process of a bench (`cmd`) and returns the JSON object it
    prints last; its stderr's tail in the error when it fails."""
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"{what} failed:\n{done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def wait_for_quiet(max_wait: float, threshold: float = 0.1, sample: float = 2.0) -> float | None:
    """Waits, up to `max_wait` seconds, until other processes keep fewer than `threshold` cores
    busy over a `sample`-second window; returns the last reading (None: not measurable)."""
    deadline = time.monotonic() + max_wait
    while True:
        with CpuCompetition() as c:
            time.sleep(sample)
        if c.other_cores is None or c.other_cores < threshold or time.monotonic() >= deadline:
            return c.other_cores


@dataclass
class Measured(Generic[T]):
    value: T  # what the timed function returned, from the least disturbed attempt
    other_cores: float | None  # during that attempt
    attempts: int


def measure_clean(
    timed: Callable[[], T],
    *,
    prepare: Callable[[], None] | None = None,
    retries: int = 0,
    settle: float = 0.0,
    threshold: float = 0.1,
    log: Callable[[str], None] | None = None,
) -> Measured[T]:
    """Runs `prepare` then `timed`; when other processes kept `threshold` cores or more busy
    during `timed`, runs both again, up to `retries` more times, and keeps the least disturbed
    attempt. `settle` > 0 first waits up to that many seconds for the machine to go quiet.

    `prepare` must restore the state the first attempt saw (warm caches, no prefix hits), so
    every attempt measures the same thing.
    """
    best: Measured[T] | None = None
    for attempt in range(1, retries + 2):
        if prepare is not None:
            prepare()
        if settle > 0:
            wait_for_quiet(settle, threshold)
        with CpuCompetition() as c:
            value = timed()
        if best is None or (c.other_cores or 0.0) < (best.other_cores or 0.0):
            best = Measured(value, c.other_cores, attempt)
        best.attempts = attempt
        if c.other_cores is None or c.other_cores < threshold:
            break
        if log is not None and attempt <= retries:
            log(f"  other processes used {c.other_cores:.2f} cores meanwhile: measuring again")
    assert best is not None
    return best


def _machine_busy_seconds() -> float | None:
    try:
        with open("/proc/stat", encoding="ascii") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    # user nice system idle iowait irq softirq steal (guest time is already in user)
    busy = sum(fields[:8]) - fields[3] - fields[4]
    return busy / os.sysconf("SC_CLK_TCK")


def _own_cpu_seconds() -> float:
    t = os.times()
    return t.user + t.system


def process_cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of another process, all its threads (0 where unreadable)."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


# -- the model --------------------------------------------------------------------------------


@dataclass
class ModelCost:
    """What one token costs in a forward pass, from the config alone (attention over the context
    is left out: at a few hundred tokens it is a few percent of the matmuls)."""

    non_embedding_params: int
    lm_head_params: int  # vocab x hidden, counted whether or not it is tied to the embedding
    flops_per_token: float  # 2 x (non-embedding params + LM head)
    weight_bytes_per_token: float  # what a one-request decode step reads, at `dtype_bytes`

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def model_cost(hf_config, dtype_bytes: int = 4) -> ModelCost:
    """Builds the model on the meta device (no memory, no weights) and counts its parameters."""
    import transformers

    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(hf_config)
    embeddings = {id(p) for p in model.get_input_embeddings().parameters()}
    head = model.get_output_embeddings()
    if head is not None:
        embeddings |= {id(p) for p in head.parameters()}
    non_embedding = sum(p.numel() for p in model.parameters() if id(p) not in embeddings)
    text_config = (
        hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config
    )
    lm_head = text_config.vocab_size * text_config.hidden_size
    per_token = non_embedding + lm_head
    return ModelCost(
        non_embedding_params=non_embedding,
        lm_head_params=lm_head,
        flops_per_token=2.0 * per_token,
        weight_bytes_per_token=float(per_token * dtype_bytes),
    )


def default_model_dir() -> str:
    """The embedded SmolLM2-135M-Instruct as a safetensors directory (the GGUF is converted into
    a cache the first time, ~20 s, then reused)."""
    from serverless_llm.engine.config import EngineConfig
    from serverless_llm.engine.loader import resolve_model

    config = EngineConfig(model=None, show_progress=False, quantized_weights="dequantize")
    return resolve_model(config).model_dir


def chat_prompt_ids(tokenizer, num_prompts: int, lead: str = "") -> list[list[int]]:
    """`num_prompts` different chat prompts as token ids, so every system gets the same ids.

    `lead` starts every question: warm-ups use one so that they share no more with the measured
    prompts than those share with each other (the chat template's system prompt), and a prefix
    cache gains nothing from the warm-up. The rendered template already holds its special
    tokens, so encoding adds none.
    """
    prompts = []
    for i in range(num_prompts):
        question = lead + QUESTIONS[i % len(QUESTIONS)]
        if i >= len(QUESTIONS):  # keep prompts distinct past the list (no shared-prefix shortcut)
            question = f"Question {i + 1}: {question}"
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": question}], tokenize=False, add_generation_prompt=True
        )
        prompts.append(tokenizer(text, add_special_tokens=False)["input_ids"])
    return prompts


# -- timing and output ------------------------------------------------------------------------


def _timed(fn: Callable[[], Any]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def best_of(fn: Callable[[], T], repeats: int) -> tuple[float, T]:
    """The shortest of `repeats` timed calls (the least disturbed by other load) and its result."""
    best, result = float("inf"), None
    for _ in range(max(1, repeats)):
        t0 = time.perf_counter()
        value = fn()
        elapsed = time.perf_counter() - t0
        if elapsed < best:
            best, result = elapsed, value
    return best, result  # type: ignore[return-value]


def format_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A plain table that reads the same in a terminal and in a Markdown file."""
    cells = [[str(h) for h in headers]] + [[_cell(v) for v in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]

    def line(r: list[str]) -> str:
        return "| " + " | ".join(c.ljust(w) for c, w in zip(r, widths)) + " |"

    sep = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
    return "\n".join([line(cells[0]), sep, *(line(r) for r in cells[1:])])


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:,.2f}" if abs(value) < 100 else f"{value:,.0f}"
    return str(value)


# -- GPU kernel timing -------------------------------------------------------------------------


def gpu_time_ms(fn: Callable[[], Any]) -> float:
    """Median milliseconds of `fn` on the GPU (`triton.testing.do_bench`)."""
    from triton.testing import do_bench

    return float(do_bench(fn, warmup=25, rep=200, return_mode="median"))


def gpu_copy_bandwidth() -> float:
    """The device's copy bandwidth in GB/s (read + write of a 1 GiB clone), the ceiling a
    weight-streaming kernel is compared with."""
    big = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    return 2 * big.numel() / gpu_time_ms(big.clone) / 1e6


# -- low-bit weight GEMMs against the 16-bit matmul (bench/mxfp4_gemm.py, fp8_block_gemm.py) ---


def weight_gemm_timer(cuda: bool) -> tuple[float | None, Callable[[Callable[[], Any]], float]]:
    """(the device's copy bandwidth in GB/s, a milliseconds timer): the GPU's median, or on
    the CPU's interpreted smoke run no bandwidth and one timed call."""
    if cuda:
        return gpu_copy_bandwidth(), gpu_time_ms

    def timed(fn: Callable[[], Any]) -> float:
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3

    return None, timed


def weight_gemm_row(
    what: str, k: int, n: int, m: int, run, x, dense, weight_bytes: int, copy_gbs, timed
) -> list:
    """One table row: `run()` (the low-bit GEMM of x [m, k]) checked against x @ dense.T (a
    SystemExit when off), both timed, the ratio and the low-bit kernel's share of the copy
    bandwidth reading `weight_bytes`."""
    got = run()
    want = torch.matmul(x, dense.t())
    err = (got.float() - want.float()).abs().max().item()
    scale = want.float().abs().max().item()
    if not err <= 2e-2 * scale + 1e-3:
        raise SystemExit(f"{k}x{n} M={m}: {what} GEMM off by {err:.3g} (scale {scale:.3g})")
    t_low = timed(run)
    t16 = timed(partial(torch.matmul, x, dense.t()))
    bw = weight_bytes / t_low / 1e6
    return [
        f"{k}x{n}",
        m,
        f"{t16 * 1e3:.1f} us",
        f"{t_low * 1e3:.1f} us",
        f"{t16 / t_low:.2f}",
        "-" if copy_gbs is None else f"{bw / copy_gbs:.0%}",
    ]


def print_weight_gemm_table(what: str, key: str, table: list, dtype, copy_gbs, cuda: bool) -> None:
    """The device, the table of `weight_gemm_row`s and the summary line (the smallest
    matmul/low-bit ratio at M <= 16)."""
    name = torch.cuda.get_device_name() if cuda else "CPU (interpreted)"
    print(name, "" if copy_gbs is None else f"copy bandwidth {copy_gbs:.0f} GB/s")
    header = ["weight", "M", f"{str(dtype)[6:]} matmul", what, f"matmul/{what}", f"{what} bw"]
    print(format_table(header, table))
    small = [float(r[4]) for r in table if r[1] <= 16]
    print(f"SUMMARY {key}_vs_matmul_min_small_m={min(small):.2f} rows={len(table)}")
