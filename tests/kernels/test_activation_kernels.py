"""The gated (act(gate) * up) and plain activation kernels (Triton, interpreted) against their
torch references, for every activation name the models use; ragged shapes (odd row counts,
widths that are not powers of two, several column blocks) and the layers' kernel switch.

Tolerances: float32 atol = rtol = 2e-5 (exp, erf and the exp-built tanh differ from libm by a
few float32 ulps); float16 within one fp16 ulp (atol = rtol = 1e-3), since the kernels round
where the references do (the activation to fp16, then the product).
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from serverless_llm.engine.kernels.activation import (  # noqa: E402
    ACT_CODES,
    ACTIVATIONS,
    act_and_mul,
    act_and_mul_reference,
    activation,
    activation_reference,
)
from serverless_llm.engine.layers.activation import ActAndMul, Activation  # noqa: E402
from tests.kernels.batch import DEVICE  # noqa: E402

TOL = {torch.float32: dict(atol=2e-5, rtol=2e-5), torch.float16: dict(atol=1e-3, rtol=1e-3)}
DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
ACTS = pytest.mark.parametrize(
    "act", ["silu", "gelu", "gelu_pytorch_tanh", "gelu_new", "relu", "relu2"]
)


def _input(rows: int, cols: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(rows, cols, generator=g) * 3).to(DEVICE, dtype)


def test_every_activation_has_a_kernel_code():
    assert set(ACT_CODES) == set(ACTIVATIONS)


@pytest.mark.parametrize("inter", [40, 1000 + 24], ids=lambda i: f"i{i}")
@ACTS
@DTYPES
def test_act_and_mul(dtype, act, inter):
    x = _input(5, 2 * inter, dtype, inter)
    got = act_and_mul(x, act)
    assert got.shape == (5, inter) and got.dtype == dtype
    torch.testing.assert_close(got, act_and_mul_reference(x, act), **TOL[dtype])


@pytest.mark.parametrize("width", [40, 1000 + 24], ids=lambda w: f"w{w}")
@ACTS
@DTYPES
def test_activation(dtype, act, width):
    x = _input(3, width, dtype, width + 1)
    got = activation(x, act)
    assert got.shape == x.shape and got.dtype == dtype
    torch.testing.assert_close(got, activation_reference(x, act), **TOL[dtype])


@pytest.mark.parametrize("act", ["gelu", "gelu_new"])
def test_extremes_and_strided_3d(act):
    """Large |x| (tanh saturates, exp must not overflow into NaN), zero, rows of a wider
    buffer and a leading batch shape."""
    vals = torch.tensor([-100.0, -20.0, -3.0, -1e-4, 0.0, 1e-4, 3.0, 20.0, 100.0])
    x = vals.repeat(2, 1).to(DEVICE)
    torch.testing.assert_close(activation(x, act), activation_reference(x, act), **TOL[x.dtype])
    buf = _input(6, 50, torch.float32, 7).view(2, 3, 50)
    gate_up = buf[..., :48]
    torch.testing.assert_close(
        act_and_mul(gate_up, act), act_and_mul_reference(gate_up, act), **TOL[torch.float32]
    )
    plain = buf[..., 1:45]
    torch.testing.assert_close(
        activation(plain, act), activation_reference(plain, act), **TOL[torch.float32]
    )


def test_layers_use_the_kernels(monkeypatch):
    from serverless_llm.engine.layers import activation as layer_module

    calls: list[str] = []
    for name in ("act_and_mul", "activation"):
        real = getattr(layer_module, name)

        def spy(*args, _real=real, _name=name, **kwargs):
            calls.append(_name)
            return _real(*args, **kwargs)

        monkeypatch.setattr(layer_module, name, spy)
    x = _input(4, 64, torch.float32, 3)
    torch.testing.assert_close(
        ActAndMul("gelu_pytorch_tanh", use_kernels=True)(x),
        act_and_mul_reference(x, "gelu_pytorch_tanh"),
        **TOL[torch.float32],
    )
    torch.testing.assert_close(
        Activation("gelu", use_kernels=True)(x),
        activation_reference(x, "gelu"),
        **TOL[torch.float32],
    )
    ActAndMul("relu")(x)  # the reference, no kernel call
    assert calls == ["act_and_mul", "activation"]
