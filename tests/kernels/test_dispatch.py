"""The switch between Triton kernels and torch references: the CPU default never imports Triton;
`make_attention_backend`, the one place the choice is made, picks, honours ATTENTION_BACKEND and
TRITON_INTERPRET and refuses what cannot run; layers built with the kernel choice run the kernels
(with the same results)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from serverless_llm.engine.config import ConfigError
from serverless_llm.engine.kernels.activation import silu_and_mul_reference
from serverless_llm.engine.kernels.rotary import apply_rotary_ref, gather_cos_sin
from serverless_llm.engine.layers.activation import SiluAndMul
from serverless_llm.engine.layers.attention import TorchAttentionBackend
from serverless_llm.engine.layers.norm import RMSNorm
from serverless_llm.engine.layers.rotary import (
    apply_rotary,
    cos_sin_cache,
    inv_frequencies,
    rotary_step,
)
from serverless_llm.engine.model_builder import make_attention_backend

CPU = torch.device("cpu")


def test_cpu_default_path_never_imports_triton():
    code = """
import sys, torch
from serverless_llm.engine.model_builder import make_attention_backend
from serverless_llm.engine.layers.activation import SiluAndMul
from serverless_llm.engine.layers.norm import RMSNorm
from serverless_llm.engine.layers.rotary import apply_rotary, cos_sin_cache, rotary_step
import serverless_llm.engine.kernels.activation, serverless_llm.engine.kernels.kv_write
import serverless_llm.engine.kernels.paged_attention, serverless_llm.engine.kernels.rms_norm
import serverless_llm.engine.kernels.rotary
import serverless_llm.engine.models.decoder
backend = make_attention_backend("auto", torch.device("cpu"))
assert backend.name in ("native", "torch") and not backend.use_kernels
x = torch.randn(3, 8)
RMSNorm(8, 1e-6, backend.use_kernels)(x, x)
SiluAndMul(backend.use_kernels)(x)
q = torch.randn(3, 2, 8)
table = cos_sin_cache(torch.ones(4), 16)
apply_rotary(q, q[:, :1], rotary_step(table, torch.arange(3), q.dtype, backend.use_kernels))
assert "triton" not in sys.modules, "the CPU default path imported triton"
"""
    env = {
        k: v for k, v in os.environ.items() if k not in ("ATTENTION_BACKEND", "TRITON_INTERPRET")
    }
    subprocess.run([sys.executable, "-c", code], check=True, env=env, timeout=120)


@pytest.mark.parametrize(
    "env, expected",
    [
        ({}, "native"),  # the CPU kernels of kernels/cpu_native.c (a C compiler is here)
        ({"ATTENTION_BACKEND": "triton", "TRITON_INTERPRET": "1"}, "triton"),
        ({"ATTENTION_BACKEND": "TRITON", "TRITON_INTERPRET": "1"}, "triton"),
        ({"ATTENTION_BACKEND": "triton", "TRITON_INTERPRET": "0"}, ConfigError),
        ({"ATTENTION_BACKEND": "torch", "TRITON_INTERPRET": "1"}, "torch"),
        ({"ATTENTION_BACKEND": "auto", "TRITON_INTERPRET": "1"}, "native"),
    ],
)
def test_backend_choice_on_cpu(monkeypatch, env, expected):
    """The one resolver of the kernel choice: the backend it returns says, through
    `use_kernels`, whether the layers run Triton too."""
    monkeypatch.delenv("ATTENTION_BACKEND", raising=False)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    if expected is ConfigError:
        with pytest.raises(ConfigError, match="TRITON_INTERPRET=1"):
            make_attention_backend("auto", CPU)
        return
    if expected == "triton":
        pytest.importorskip("triton")
    backend = make_attention_backend("auto", CPU)
    assert backend.name == expected
    assert backend.use_kernels is (expected == "triton")


def test_make_attention_backend(monkeypatch):
    pytest.importorskip("triton")
    monkeypatch.delenv("ATTENTION_BACKEND", raising=False)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert isinstance(make_attention_backend("auto", CPU), TorchAttentionBackend)
    assert make_attention_backend("torch", CPU).name == "torch"
    assert make_attention_backend("triton", CPU).name == "triton"
    # auto means triton on CUDA (building the backend touches no device)
    assert make_attention_backend("auto", torch.device("cuda")).name == "triton"
    monkeypatch.setenv("ATTENTION_BACKEND", "triton")
    assert make_attention_backend("auto", CPU).name == "triton"
    # an explicit argument wins over the env var
    assert make_attention_backend("torch", CPU).name == "torch"
    monkeypatch.setenv("ATTENTION_BACKEND", "torch")
    assert make_attention_backend("auto", torch.device("cuda")).name == "torch"


def test_make_attention_backend_refuses(monkeypatch):
    monkeypatch.delenv("ATTENTION_BACKEND", raising=False)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ConfigError, match="TRITON_INTERPRET=1"):
        make_attention_backend("triton", CPU)
    monkeypatch.setenv("ATTENTION_BACKEND", "triton")
    with pytest.raises(ConfigError, match="TRITON_INTERPRET=1"):
        make_attention_backend("auto", CPU)
    monkeypatch.setenv("ATTENTION_BACKEND", "flash")
    with pytest.raises(ConfigError, match="ATTENTION_BACKEND='flash'"):
        make_attention_backend("auto", CPU)


def _spy(monkeypatch, module, name: str) -> list[str]:
    """Counts the calls a layer module makes to `name` (a kernel launcher it imported)."""
    calls: list[str] = []
    real = getattr(module, name)

    def wrapper(*args, **kwargs):
        calls.append(name)
        return real(*args, **kwargs)

    monkeypatch.setattr(module, name, wrapper)
    return calls


def test_layers_run_the_kernels_when_forced(monkeypatch):
    pytest.importorskip("triton")
    from serverless_llm.engine.layers import activation, norm, rotary
    from tests.kernels.batch import DEVICE

    norm_calls = _spy(monkeypatch, norm, "rms_norm")
    act_calls = _spy(monkeypatch, activation, "silu_and_mul")
    rotary_calls = _spy(monkeypatch, rotary, "rotary_embedding")

    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 64, generator=g).to(DEVICE)
    res = torch.randn(5, 64, generator=g).to(DEVICE)
    rms = RMSNorm(64, 1e-6, use_kernels=True).to(DEVICE)
    rms.weight.data = torch.rand(64, generator=g).to(DEVICE) + 0.5
    out, new_res = rms(x, res)
    assert norm_calls == ["rms_norm"]
    torch.testing.assert_close(new_res, x + res, rtol=0, atol=0)
    ref = rms.weight * ((x + res) * torch.rsqrt((x + res).pow(2).mean(-1, keepdim=True) + 1e-6))
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)

    gate_up = torch.randn(5, 128, generator=g).to(DEVICE)
    torch.testing.assert_close(
        SiluAndMul(use_kernels=True)(gate_up), silu_and_mul_reference(gate_up)
    )
    assert act_calls == ["silu_and_mul"]

    params = {"rope_type": "default", "rope_theta": 1e4}
    table = cos_sin_cache(inv_frequencies(params, 32, 64), 64).to(DEVICE)
    positions = torch.tensor([0, 3, 9, 63, 1], device=DEVICE)
    q = torch.randn(5, 4, 32, generator=g).to(DEVICE)
    k = torch.randn(5, 2, 32, generator=g).to(DEVICE)
    cos, sin = gather_cos_sin(table, positions, q.dtype)
    q_ref, k_ref = apply_rotary_ref(q, k, cos, sin)
    step = rotary_step(table, positions, q.dtype, use_kernels=True)
    assert step.cos is None  # the kernel reads the table itself
    q_out, k_out = apply_rotary(q, k, step)
    assert rotary_calls == ["rotary_embedding"]
    torch.testing.assert_close(q_out, q_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(k_out, k_ref, rtol=1e-5, atol=1e-5)
