"""Recurrent token mixers: the layers of hybrid models that keep a fixed-size state per request
instead of keys and values (Gated DeltaNet, Mamba-2, Mamba, short convolutions).

A family describes its recurrent layers with a `RecurrentMixerSpec` (a frozen dataclass of the
kind's own sizes and options, `DecoderSpec.recurrent`); `build` makes the layer's module, a
`RecurrentMixer`. The module says what state one request needs (`state_shapes`: per tensor its
shape and dtype, this rank's share with tensor parallelism); the engine allocates each tensor
with a leading slot dimension (`kv_cache.RecurrentState`) and hands every step the requests'
slots (`AttentionMetadata.state_slots`) and whether each continues a state
(`has_initial_state`). A module reads a request's state from its slot at the start of the step
and writes it back after the request's last token of the step, in place, so a prompt computed in
chunks carries its state across them exactly.

Tensor parallelism (models/sharding.py): each rank holds its share of a layer's heads (or
channels), as its attention holds its share of query heads. The description says what must
divide (`tp_refusal`), what one rank's layer is (`shard`: a description of the same kind with
this rank's counts, so the module and its `state_shapes` are the rank's share), and which rows or
columns of each parameter are the rank's (`tp_split`); the module all-reduces its output
projection's partial sums, and whatever else spans the ranks (Mamba's x_proj, a norm over a
group wider than a rank's channels).
"""

from __future__ import annotations

import torch
from torch import nn

from ..kernels.metadata import AttentionMetadata

StateShapes = list[tuple[tuple[int, ...], torch.dtype]]
Ranges = list[tuple[int, int]]  # (start, length) along one dimension
# How one rank cuts a parameter from the whole model's (`RecurrentMixerSpec.tp_split`).
Split = tuple[str, Ranges] | None

# Recurrent states are kept in float32 whatever the model dtype (transformers' own references
# keep their recurrent matrices in float32 too); a convolution's inputs in the model dtype.
STATE_DTYPE = torch.float32


class RecurrentMixerSpec:
    """The description of a model's recurrent layers (subclassed by each kind, as a frozen
    dataclass)."""

    def build(self, spec, backend, tp) -> RecurrentMixer:
        """The layer's module, for the decoder description `spec`, the attention backend (its
        `use_kernels` chooses Triton or the torch reference) and this rank's tensor-parallel
        group."""
        raise NotImplementedError

    def describe(self) -> str:
        raise NotImplementedError

    def tp_refusal(self, hidden: int, size: int) -> str | None:
        """Why `size` tensor-parallel ranks cannot split these layers (a count that does not
        divide), or None; `hidden` is the model's hidden size."""
        return (
            f"tensor_parallel_size={size}: tensor parallelism of the model's recurrent layers "
            f"({self.describe()}) is not supported; use tensor_parallel_size=1"
        )

    def shard(self, hidden: int, size: int) -> RecurrentMixerSpec:
        """The description of one rank's part of the layers (after `tp_refusal` said None)."""
        raise NotImplementedError

    def tp_split(self, name: str, hidden: int, rank: int, size: int) -> Split:
        """How rank `rank` of `size` cuts the layer's parameter `name` (its path inside the
        mixer: "in_proj", "conv1d", "A_log", ...) from the whole model's: ("out", ranges) of its
        first dimension (a linear's output rows, a convolution's channels, a vector's entries:
        for a checkpoint tensor with leading dimensions of 1, its first longer one), ("in",
        ranges) of a row-parallel linear's input columns (whose partial outputs the module
        all-reduces), or None: whole on every rank. Ranges are in the fused parameter's rows."""
        raise NotImplementedError

    def checkpoint_segments(self, part: str, rows: int) -> list[tuple[int, int, int]]:
        """For a layer whose checkpoint tensors fill a fused parameter in another order (the
        "mixer:<part>:<n>" placement): the `rows` rows of checkpoint tensor `part` as runs
        (first checkpoint row, first fused row, length)."""
        raise ValueError(f"{self.describe()} has no checkpoint part {part!r}")


class RecurrentMixer(nn.Module):
    """A recurrent layer: `forward(x [T, hidden], state, meta) -> [T, hidden]` (the output
    projection's partial sums all-reduced with tensor parallelism)."""

    def state_shapes(self, dtype: torch.dtype) -> StateShapes:
        """Per state tensor, one request's shape and its dtype, for a model in `dtype`."""
        raise NotImplementedError


def share(count: int, rank: int, size: int) -> tuple[int, int]:
    """(first, how many) of `count` heads or channels split evenly over `size` ranks."""
    per = count // size
    return rank * per, per


def indivisible(size: int, value: int, what: str) -> str | None:
    """The refusal for `value` `what` that `size` ranks cannot split evenly, or None."""
    if value % size:
        return (
            f"tensor_parallel_size={size} does not divide the model's {what} ({value}); "
            "choose a size that divides it"
        )
    return None


class ParamHolder(nn.Module):
    """One parameter as a module's `weight`: where the loader puts a bare checkpoint parameter
    (A_log, D, a bias used apart from its linear) or a gated norm's weight applied by a kernel
    (models/weights.py)."""

    def __init__(self, *shape: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(*shape))


def conv_and_state(
    conv_channels: int, kernel: int, state: tuple[int, ...] | None, dtype: torch.dtype
) -> StateShapes:
    """A recurrent layer's state tensors: its causal convolution's last kernel - 1 inputs (the
    model dtype), then its recurrent state of shape `state` (STATE_DTYPE), if it has one."""
    shapes = [((conv_channels, kernel - 1), dtype)]
    if state is not None:
        shapes.append((state, STATE_DTYPE))
    return shapes


def step_slots(meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
    """The step's (state_slots [B] int32, has_initial_state [B] bool)."""
    if meta.state_slots is None or meta.has_initial_state is None:
        raise RuntimeError("a recurrent layer ran without state slots in the step's metadata")
    return meta.state_slots, meta.has_initial_state
