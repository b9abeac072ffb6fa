"""One rank's place in a tensor-parallel group and the three collectives the model needs:
all-reduce (row-parallel outputs, the vocab-parallel embedding), gather to rank 0 (the
vocab-parallel logits) and a minimum (the KV block count every rank can hold).

torch.distributed does the transport: NCCL between GPUs, gloo on CPU. Each engine holds its own
process group object, rendezvoused through a file store, rather than torch's global default
group: a process may build, close and build again tensor-parallel engines (tests do), and
nothing else in the process sees the group."""

from __future__ import annotations

import datetime
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

# How long any collective may wait for the other ranks before it raises. The ranks run the
# same work, so a wait this long means a rank is stuck, not slow. Loading is not a collective:
# rank 0 waits for the other ranks' "loaded" messages with no limit while they are alive.
COLLECTIVE_TIMEOUT_S = 120.0


class TensorParallelError(RuntimeError):
    """A rank died or failed: the engine cannot step again. The worker exits non-zero on it."""


@dataclass(frozen=True)
class TensorParallel:
    rank: int = 0
    size: int = 1
    group: object = field(default=None, repr=False, compare=False)  # the c10d process group

    @property
    def enabled(self) -> bool:
        return self.size > 1

    @staticmethod
    def join(
        rank: int, size: int, init_file: str, backend: str, timeout_s: float
    ) -> TensorParallel:
        """Joins the group (blocks until every rank has); `init_file` is the rendezvous."""
        store = dist.FileStore(init_file, size)
        timeout = datetime.timedelta(seconds=timeout_s)
        try:
            if backend == "nccl":
                options = dist.ProcessGroupNCCL.Options()
                options._timeout = timeout
                group = dist.ProcessGroupNCCL(store, rank, size, options)
            else:
                group = dist.ProcessGroupGloo(store, rank, size, timeout)
        except (AttributeError, RuntimeError, TypeError) as e:  # no such backend in this build
            raise TensorParallelError(
                f"cannot start a {backend} process group for rank {rank} of {size}: "
                f"{type(e).__name__}: {e}"
            ) from e
        return TensorParallel(rank, size, group)

    def leave(self) -> None:
        """Ends this rank's part in the group (its peers' collectives fail from now on)."""
        if self.group is not None:
            try:
                self.group.abort()
            except Exception:  # an older torch, or a group already broken
                pass

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum over ranks of `x`, in place (x itself when the group is one rank)."""
        if self.size > 1:
            self.group.allreduce([x]).wait()
        return x

    def gather_last_dim(self, x: torch.Tensor) -> torch.Tensor | None:
        """Every rank's `x` side by side along the last dim, on rank 0; None on the others."""
        if self.size == 1:
            return x
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.size)] if self.rank == 0 else []
        options = dist.GatherOptions()
        options.rootRank = 0
        self.group.gather([parts] if parts else [], [x], options).wait()
        return torch.cat(parts, dim=-1) if parts else None

    def min_int(self, value: int, device: torch.device) -> int:
        if self.size == 1:
            return value
        t = torch.tensor([value], dtype=torch.int64, device=device)
        options = dist.AllreduceOptions()
        options.reduceOp = dist.ReduceOp.MIN
        self.group.allreduce([t], options).wait()
        return int(t.item())

    def vocab_range(self, vocab_size: int) -> tuple[int, int]:
        """(first row, rows) of the embedding and LM head this rank holds: the vocabulary padded
        to a multiple of the size, in equal parts (the last part may run past the real rows)."""
        per = -(-vocab_size // self.size)
        return self.rank * per, per


SINGLE = TensorParallel()
