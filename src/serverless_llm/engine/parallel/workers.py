"""Ranks 1..N-1 of a tensor-parallel engine: one spawned process each, and how rank 0 (the
engine's own process: scheduler, tokenizer, sampler, API) drives them.

Start-up: rank 0 resolves the model and checks that it splits, spawns the ranks, and every
rank joins the group, loads its shard (at most MAX_PARALLEL_LOADING_WORKERS at once) and says
so over its pipe; then the ranks agree on the KV block count (a collective), allocate their
caches and say they are ready. Each step rank 0 sends the step's flat inputs (a pickled
`HostBatch` without its requests) down every pipe and all ranks run the same forward, meeting
in the all-reduces; rank 0 alone gets the logits and samples.

Failure: a rank that raises sends its error up its pipe and exits; a rank that dies closes its
sockets. Either way rank 0's next collective fails at once (or after COLLECTIVE_TIMEOUT_S if a
rank hangs), and `failure()` turns it into a TensorParallelError naming the rank. A rank exits
when its pipe says close, when its pipe breaks, or when its parent process is gone (a watchdog
thread), so nothing outlives the engine.
"""

from __future__ import annotations

import contextlib
import logging
import os
import pickle
import shutil
import tempfile
import threading
import time
import traceback
import weakref

import torch
import torch.multiprocessing as mp

from ..config import EngineConfig
from .group import COLLECTIVE_TIMEOUT_S, TensorParallel, TensorParallelError

logger = logging.getLogger(__name__)

PARENT_POLL_S = 0.5
CLOSE_WAIT_S = 5.0
ERROR_WAIT_S = 3.0  # for a failed rank's own message to arrive after its sockets closed


def backend_for(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def threads_per_rank(size: int) -> int:
    """CPU: the cores divided among the ranks (each is a process with its own op threads)."""
    return max(1, (os.cpu_count() or 1) // size)


class RankProcesses:
    """Rank 0's handle on the other ranks."""

    def __init__(self, config: EngineConfig) -> None:
        n = config.tensor_parallel_size
        ctx = mp.get_context("spawn")
        self._dir = tempfile.mkdtemp(prefix="sllm-tp-")
        self.init_file = os.path.join(self._dir, "rendezvous")
        limit = config.max_parallel_loading_workers
        # Only a real limit needs a shared semaphore (one the resource tracker must clean up).
        self.load_slots = ctx.BoundedSemaphore(limit) if limit is not None and limit < n else None
        self.procs = []
        self.conns = []
        self.info: dict[int, dict] = {}  # rank -> what it reported (device, parameter bytes)
        self.failed: TensorParallelError | None = None
        for rank in range(1, n):
            parent, child = ctx.Pipe()
            proc = ctx.Process(
                target=rank_main,
                args=(rank, config, self.init_file, child, self.load_slots, os.getpid()),
                name=f"tp-rank-{rank}",
                daemon=True,
            )
            proc.start()
            child.close()
            self.procs.append(proc)
            self.conns.append(parent)
        # An engine dropped without close() still stops its ranks when it is collected.
        self._finalizer = weakref.finalize(self, _stop, self.procs, self.conns, self._dir)

    def ranks(self):
        return zip(range(1, len(self.procs) + 1), self.procs, self.conns)

    def wait_for(self, what: str) -> None:
        """Each rank's next message, which must be `what`; a rank that fails or exits first
        raises TensorParallelError. No time limit while they are alive (loading takes long)."""
        pending = {rank for rank, _, _ in self.ranks()}
        while pending:
            for rank, proc, conn in self.ranks():
                if rank not in pending:
                    continue
                if conn.poll(0.05):
                    kind, payload = conn.recv()
                    if kind == "error":
                        raise self._fail(f"tensor-parallel rank {rank} failed: {payload}")
                    if kind != what:
                        raise self._fail(f"tensor-parallel rank {rank} said {kind}, not {what}")
                    self.info[rank] = {**self.info.get(rank, {}), **payload}
                    pending.discard(rank)
                elif not proc.is_alive():
                    raise self._fail(
                        f"tensor-parallel rank {rank} exited (code {proc.exitcode}) before it "
                        f"was {what}"
                    )

    def send(self, batch) -> None:
        """The step's inputs to every rank (raises the standing failure, if any)."""
        if self.failed is not None:
            raise self.failed
        data = pickle.dumps(("step", batch), protocol=pickle.HIGHEST_PROTOCOL)
        for conn in self.conns:
            try:
                conn.send_bytes(data)
            except OSError as e:
                raise self.failure(e) from e

    def failure(self, exc: BaseException) -> TensorParallelError:
        """The error for a step that failed on rank 0 (`exc`, often a collective's): the failed
        rank's own message when one arrives, else which rank is gone, else `exc`. The engine
        cannot step again: the ranks are stopped."""
        if self.failed is not None:
            return self.failed
        deadline = time.monotonic() + ERROR_WAIT_S
        message = None
        while message is None and time.monotonic() < deadline:
            for rank, proc, conn in self.ranks():
                try:
                    if conn.poll(0):
                        kind, payload = conn.recv()
                        if kind == "error":
                            message = f"tensor-parallel rank {rank} failed: {payload}"
                            break
                except (EOFError, OSError):
                    pass
                if not proc.is_alive() and proc.exitcode is not None:
                    message = f"tensor-parallel rank {rank} died (exit code {proc.exitcode})"
            if message is None:
                time.sleep(0.05)
        if message is None:
            message = f"tensor-parallel step failed on rank 0: {type(exc).__name__}: {exc}"
        return self._fail(message)

    def _fail(self, message: str) -> TensorParallelError:
        self.failed = TensorParallelError(message)
        logger.error("%s; stopping the other ranks", message)
        self.close()
        return self.failed

    def state(self) -> list[dict]:
        """Per rank (1..N-1): alive or not, its device, loaded parameter bytes and the host
        memory its load added at its peak."""
        out = []
        for rank, proc, _ in self.ranks():
            info = self.info.get(rank, {})
            out.append(
                {
                    "rank": rank,
                    "alive": proc.is_alive(),
                    "exit_code": proc.exitcode,
                    "device": info.get("device"),
                    "param_bytes": info.get("param_bytes"),
                    "load_peak_bytes": info.get("load_peak_bytes"),
                    "load_window": info.get("load_window"),
                }
            )
        return out

    def close(self) -> None:
        """Asks every rank to exit, waits a little, then kills what remains."""
        self._finalizer()


def _stop(procs: list, conns: list, directory: str) -> None:
    for proc, conn in zip(procs, conns):
        try:
            if proc.is_alive():
                conn.send_bytes(pickle.dumps(("close", None)))
        except OSError:
            pass
    deadline = time.monotonic() + CLOSE_WAIT_S
    for proc in procs:
        proc.join(max(0.0, deadline - time.monotonic()))
        if proc.is_alive():
            proc.kill()
            proc.join(1.0)
    for conn in conns:
        conn.close()
    shutil.rmtree(directory, ignore_errors=True)


def _memory_status(key: str) -> int | None:
    """A /proc/self/status figure in bytes (Linux), else None."""
    try:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key))
    except (OSError, StopIteration, ValueError):
        return None


def _reset_peak_rss() -> int | None:
    """Resets the process's peak resident size to the current one (Linux: clear_refs 5) and
    returns the current one; None where that cannot be done."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return None
    return _memory_status("VmRSS")


def _watch_parent(parent_pid: int) -> None:
    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(PARENT_POLL_S)
        os._exit(1)  # the engine's process is gone: nothing to serve

    threading.Thread(target=watch, name="tp-parent-watch", daemon=True).start()


def rank_main(rank, config, init_file, conn, load_slots, parent_pid) -> None:
    """A rank other than 0: join, load the shard, then run each step rank 0 sends."""
    _watch_parent(parent_pid)
    logging.basicConfig(level=logging.WARNING)
    # tqdm's default lock is a multiprocessing semaphore, which a rank that ends in os._exit
    # would leave for the resource tracker to report; a thread lock serves one process.
    from tqdm import tqdm

    tqdm.set_lock(threading.RLock())
    from ..model_builder import cache_capacity, load_model, prepare_model, step_token_budget
    from ..model_runner import ModelRunner

    try:
        n = config.tensor_parallel_size
        device = config.resolve_device()
        if device.type == "cpu":
            torch.set_num_threads(threads_per_rank(n))
        else:  # NCCL binds its communicator to the current device
            torch.cuda.set_device(torch.device("cuda", rank))
        conn.send(("joining", {}))
        tp = TensorParallel.join(rank, n, init_file, backend_for(device), COLLECTIVE_TIMEOUT_S)
        prepared = prepare_model(config)
        with load_slots if load_slots is not None else contextlib.nullcontext():
            start = time.time()
            before = _reset_peak_rss()
            loaded = load_model(config, tp, prepared)
            peak = _memory_status("VmHWM")
            window = (start, time.time())
        model = loaded.model
        info = {
            "device": str(loaded.device),
            "param_bytes": loaded.param_bytes,
            "load_window": window,  # wall-clock start and end of its load
        }
        if before is not None and peak is not None:
            info["load_peak_bytes"] = peak - before  # host memory the load added at its peak
        conn.send(("loaded", info))
        budget = step_token_budget(config, loaded.device)
        capacity = cache_capacity(config, loaded, config.block_size, budget)
        blocks = tp.min_int(capacity.num_blocks, loaded.device)
        slots = tp.min_int(capacity.num_slots, loaded.device)
        kv_caches = loaded.allocate_kv_cache(blocks, config.block_size, max(slots, 2))
        runner = ModelRunner(
            model,
            kv_caches,
            loaded.backend,
            config.block_size,
            loaded.device,
            loaded.cache_layout(),
        )
        if loaded.vision is not None:
            from ..model_builder import encoder_cache_bytes

            runner.attach_vision(
                loaded.vision.tower,
                encoder_cache_bytes(config, loaded),
                loaded.vision.bidirectional,
            )
        lora = None
        if config.enable_lora:  # the same slots as rank 0's, filled as its header says
            from ..config import lora_dtype
            from ..lora_adapters import LoRAManager

            lora = LoRAManager(model, config.max_loras, config.max_lora_rank, config.max_loras,
                               lora_dtype(config, loaded.dtype))  # fmt: skip
            runner.lora_step = lora.step
        conn.send(("ready", {"kv_blocks": blocks}))
        while True:
            if not conn.poll(PARENT_POLL_S):
                continue
            kind, batch = pickle.loads(conn.recv_bytes())
            if kind == "close":
                break
            with torch.inference_mode():
                for slot, req, local in batch.lora_loads:
                    lora.load_for_peer(slot, req, local)
                runner.lora_slots = batch.lora_slots
                runner.run(batch)
    except (EOFError, BrokenPipeError):
        os._exit(1)  # rank 0 is gone
    except BaseException as e:
        detail = "".join(traceback.format_exception_only(type(e), e)).strip()
        try:
            conn.send(("error", detail))
        except OSError:
            pass
        logger.error("tensor-parallel rank %d failed:\n%s", rank, traceback.format_exc())
        os._exit(1)
    os._exit(0)
