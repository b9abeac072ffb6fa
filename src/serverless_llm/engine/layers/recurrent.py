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
"""

from __future__ import annotations

import torch
from torch import nn

from ..kernels.metadata import AttentionMetadata

StateShapes = list[tuple[tuple[int, ...], torch.dtype]]

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


class RecurrentMixer(nn.Module):
    """A recurrent layer: `forward(x [T, hidden], state, meta) -> [T, hidden]` (the output
    projection's partial sums all-reduced with tensor parallelism)."""

    def state_shapes(self, dtype: torch.dtype) -> StateShapes:
        """Per state tensor, one request's shape and its dtype, for a model in `dtype`."""
        raise NotImplementedError


def step_slots(meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
    """The step's (state_slots [B] int32, has_initial_state [B] bool)."""
    if meta.state_slots is None or meta.has_initial_state is None:
        raise RuntimeError("a recurrent layer ran without state slots in the step's metadata")
    return meta.state_slots, meta.has_initial_state
