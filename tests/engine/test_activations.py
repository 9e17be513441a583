"""The MLP activations: GELU's tanh approximation is the same function compiled (as x * sigmoid(2u))
and eager (``F.gelu``); the gated kernel (``act(gate) * up`` in one C call) is torch's two ops."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from common.engine.models.activations import ACTIVATIONS, KERNEL_ACTIVATIONS, gated, gelu_tanh, kernel


def test_compiled_gelu_tanh_is_f_gelu_to_the_last_bits():
    x = torch.cat([torch.linspace(-12, 12, 20001), torch.randn(4096) * 4,
                   torch.tensor([0.0, -0.0, 1e-30, -1e-30, 88.0, -88.0, 3e12, -3e12])])
    reference = F.gelu(x.double(), approximate="tanh")
    compiled = torch.compile(gelu_tanh, fullgraph=True, dynamic=False)(x)
    eager = gelu_tanh(x)
    torch.testing.assert_close(eager, F.gelu(x, approximate="tanh"), rtol=0, atol=0)
    # as close to the fp64 reference as torch's own fp32 kernel is: within 2 units in the last place
    # from x = -1 up (measured: 1.5 compiled, 1.75 eager), and within the eager kernel's largest
    # absolute error everywhere (below -1, 1 + tanh(u) -> 0 loses the relative precision of both)
    compiled_error, eager_error = (compiled.double() - reference).abs(), (eager.double() - reference).abs()
    upper = x >= -1
    assert (compiled_error[upper] <= 2 * torch.finfo(torch.float32).eps * reference.abs()[upper] + 1e-30).all()
    assert compiled_error.max() <= 2 * eager_error.max()


def test_a_compiled_mlp_activation_takes_the_exponential_form():
    code = []
    from torch._inductor.utils import run_and_get_code

    _, code = run_and_get_code(torch.compile(gelu_tanh, fullgraph=True, dynamic=False), torch.randn(64, 32))
    generated = "\n".join(code)
    assert "tanh" not in generated and "exp" in generated


def test_the_checkpoint_names_map_to_their_functions():
    x = torch.randn(100)
    assert ACTIVATIONS["gelu_pytorch_tanh"] is gelu_tanh
    torch.testing.assert_close(ACTIVATIONS["silu"](x), F.silu(x))
    torch.testing.assert_close(ACTIVATIONS["gelu"](x), F.gelu(x))


needs_gated_kernel = pytest.mark.skipif(kernel() is None, reason="no C compiler for the kernel")


def _stable(name: str, g: torch.Tensor) -> torch.Tensor:
    """act(g) in fp64 without cancellation: g * sigmoid(z) (z = g for silu, 2u for the tanh GELU,
    whose 0.5 (1 + tanh u) loses all precision below u ~ -18 even in fp64)."""
    z = g if name == "silu" else 2 * math.sqrt(2 / math.pi) * (g + 0.044715 * g ** 3)
    return g * torch.sigmoid(z)


@needs_gated_kernel
@pytest.mark.parametrize("name", sorted(KERNEL_ACTIVATIONS))
@pytest.mark.parametrize("rows,width", [(1, 37), (8, 2048), (300, 640)])  # a tail; decode; split among threads
def test_the_gated_kernel_is_act_gate_times_up(name, rows, width):
    g = torch.Generator().manual_seed(rows)
    gate_up = torch.randn(rows, 2 * width, generator=g) * 4
    gate_up[0, :6] = torch.tensor([0.0, -0.0, 1e-30, -50.0, 50.0, 3e12])
    gate, up = gate_up[:, :width], gate_up[:, width:]
    reference = _stable(name, gate.double()) * up.double()
    got = gated(gate_up, name)
    eager_error = ((ACTIVATIONS[name](gate) * up).double() - reference).abs()
    # float-level accuracy: within 8 units in the last place of the value (u, rounded to fp32 in
    # both, is ill-conditioned for the GELU's negative side) or twice torch's own fp32 error there
    bound = 8 * torch.finfo(torch.float32).eps * reference.abs() + 2 * eager_error + 1e-35
    assert ((got.double() - reference).abs() <= bound).all()


@needs_gated_kernel
def test_the_gated_kernel_keeps_nan_in_its_own_value_and_falls_back_off_its_cases():
    gate_up = torch.randn(2, 64)
    gate_up[1, 3] = float("nan")
    out = gated(gate_up, "silu")
    assert out[1, 3].isnan() and out.isnan().sum() == 1
    # bf16, a strided view, or an activation the kernel lacks: torch's ops, same values
    for x, name in [(gate_up.bfloat16(), "silu"), (gate_up[:, :32].t().contiguous().t(), "silu"), (gate_up, "gelu")]:
        gate, up = x.chunk(2, dim=-1)
        torch.testing.assert_close(gated(x, name), ACTIVATIONS[name](gate) * up, rtol=0, atol=0, equal_nan=True)
