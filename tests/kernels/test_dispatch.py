"""The switch between Triton kernels and torch references: the CPU default never imports Triton;
ATTENTION_BACKEND=triton with TRITON_INTERPRET=1 routes the layers through the kernels (with the
same results); `make_attention_backend` picks, honours the env var and refuses what cannot run."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from serverless_llm.engine.config import ConfigError
from serverless_llm.engine.kernels.dispatch import use_triton
from serverless_llm.engine.layers.activation import silu_and_mul, silu_and_mul_ref
from serverless_llm.engine.layers.attention import TorchAttentionBackend
from serverless_llm.engine.layers.norm import RMSNorm
from serverless_llm.engine.layers.rotary import (
    apply_rotary,
    apply_rotary_ref,
    cos_sin_cache,
    gather_cos_sin,
    inv_frequencies,
    rotary_step,
)
from serverless_llm.engine.model_builder import make_attention_backend

CPU = torch.device("cpu")


def test_cpu_default_path_never_imports_triton():
    code = """
import sys, torch
from serverless_llm.engine.model_builder import make_attention_backend
from serverless_llm.engine.layers.activation import silu_and_mul
from serverless_llm.engine.layers.norm import RMSNorm
from serverless_llm.engine.layers.rotary import apply_rotary, cos_sin_cache, rotary_step
import serverless_llm.engine.models.llama
assert make_attention_backend("auto", torch.device("cpu")).name == "torch"
x = torch.randn(3, 8)
RMSNorm(8, 1e-6)(x, x)
silu_and_mul(x)
q = torch.randn(3, 2, 8)
apply_rotary(q, q[:, :1], rotary_step(cos_sin_cache(torch.ones(4), 16), torch.arange(3), q.dtype))
assert "triton" not in sys.modules, "the CPU default path imported triton"
"""
    env = {
        k: v for k, v in os.environ.items() if k not in ("ATTENTION_BACKEND", "TRITON_INTERPRET")
    }
    subprocess.run([sys.executable, "-c", code], check=True, env=env, timeout=120)


@pytest.mark.parametrize(
    "env, expected",
    [
        ({}, False),
        ({"ATTENTION_BACKEND": "triton", "TRITON_INTERPRET": "1"}, True),
        ({"ATTENTION_BACKEND": "TRITON", "TRITON_INTERPRET": "1"}, True),
        ({"ATTENTION_BACKEND": "triton", "TRITON_INTERPRET": "0"}, False),
        ({"ATTENTION_BACKEND": "torch", "TRITON_INTERPRET": "1"}, False),
        ({"ATTENTION_BACKEND": "auto", "TRITON_INTERPRET": "1"}, False),
    ],
)
def test_use_triton_on_cpu(monkeypatch, env, expected):
    monkeypatch.delenv("ATTENTION_BACKEND", raising=False)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    assert use_triton(torch.zeros(1)) is expected


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


@pytest.fixture
def forced_triton(monkeypatch):
    pytest.importorskip("triton")
    monkeypatch.setenv("ATTENTION_BACKEND", "triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")


def test_layers_run_the_kernels_when_forced(forced_triton):
    from tests.kernels.batch import DEVICE

    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 64, generator=g).to(DEVICE)
    res = torch.randn(5, 64, generator=g).to(DEVICE)
    norm = RMSNorm(64, 1e-6).to(DEVICE)
    norm.weight.data = torch.rand(64, generator=g).to(DEVICE) + 0.5
    out, new_res = norm(x, res)
    assert "serverless_llm.engine.kernels.rms_norm" in sys.modules
    torch.testing.assert_close(new_res, x + res, rtol=0, atol=0)
    ref = norm.weight * ((x + res) * torch.rsqrt((x + res).pow(2).mean(-1, keepdim=True) + 1e-6))
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)

    gate_up = torch.randn(5, 128, generator=g).to(DEVICE)
    torch.testing.assert_close(silu_and_mul(gate_up), silu_and_mul_ref(gate_up))
    assert "serverless_llm.engine.kernels.activation" in sys.modules

    params = {"rope_type": "default", "rope_theta": 1e4}
    table = cos_sin_cache(inv_frequencies(params, 32, 64), 64).to(DEVICE)
    positions = torch.tensor([0, 3, 9, 63, 1], device=DEVICE)
    q = torch.randn(5, 4, 32, generator=g).to(DEVICE)
    k = torch.randn(5, 2, 32, generator=g).to(DEVICE)
    cos, sin = gather_cos_sin(table, positions, q.dtype)
    q_ref, k_ref = apply_rotary_ref(q, k, cos, sin)
    step = rotary_step(table, positions, q.dtype)
    assert step.cos is None  # the kernel reads the table itself
    q_out, k_out = apply_rotary(q, k, step)
    torch.testing.assert_close(q_out, q_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(k_out, k_ref, rtol=1e-5, atol=1e-5)
