"""The quantized products' AVX2 builds (``csrc/int8_vnni_cpu.c`` and ``csrc/int4_vnni_cpu.c`` compiled
for ``-march=haswell``: AVX2 and FMA, no AVX-512) on any CPU that runs them -- so a CPU whose own
build is the AVX512-VNNI one still checks the code AVX2 CPUs take: against the reference arithmetic,
and there, int8 against the VNNI build's outputs bit for bit (the same integer sums and epilogue)."""
from __future__ import annotations

import ctypes

import pytest
import torch

from common.engine import cpu_kernels
from common.engine.models import int4_vnni, int8_vnni
from tests.support.cpu_flags import cpu_has


pytestmark = pytest.mark.skipif(not cpu_has("avx2", "fma"), reason="no AVX2 with FMA on this CPU")
_I64, _PTR = ctypes.c_int64, ctypes.c_void_p


@pytest.fixture(scope="module")
def avx2(tmp_path_factory) -> dict[str, ctypes.CDLL]:
    """Each source's -march=haswell build, loaded."""
    libs = {}
    for name in ("int8_vnni_cpu", "int4_vnni_cpu"):
        target = tmp_path_factory.mktemp("avx2") / f"{name}.so"
        try:
            cpu_kernels.compile_source(cpu_kernels.SOURCES / f"{name}.c", target, march="haswell")
        except RuntimeError as exc:  # no compiler here: the engine takes the torch paths
            pytest.skip(str(exc))
        libs[name] = ctypes.CDLL(str(target))
    return libs


def _int8_entries(libs):
    lib = libs["int8_vnni_cpu"]
    path = lib.int8_vnni_path
    path.argtypes, path.restype = [ctypes.c_int], ctypes.c_int
    assert path(1) == 3, "the haswell build is not the AVX2 one"
    gemm, argmax = lib.int8_vnni_gemm, lib.int8_vnni_argmax
    gemm.argtypes, gemm.restype = [_PTR, _I64, _I64, _PTR, _PTR, _PTR, _I64, _I64], ctypes.c_int
    argmax.argtypes, argmax.restype = [_PTR, _I64, _I64, _PTR, _PTR, _I64, _I64, _PTR], ctypes.c_int
    return gemm, argmax


def _int8_weight(out_features: int, in_features: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(-127, 128, (out_features, in_features), dtype=torch.int8, generator=g)
    scale = torch.rand(out_features, generator=g) * 0.02 + 1e-3
    return q, scale


@pytest.mark.parametrize("out_features", [16, 40, 203, 1000])  # one block; partial blocks; several chunks
@pytest.mark.parametrize("in_features", [64, 98, 640])  # one group; a partial quad; several groups
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8, 13])  # each tile height; passes and remainders
def test_int8_avx2_products_and_greedy_tokens_follow_the_reference(avx2, out_features, in_features, rows):
    gemm, argmax = _int8_entries(avx2)
    q, scale = _int8_weight(out_features, in_features, seed=out_features + in_features + rows)
    packed = int8_vnni.pack(q)
    x = torch.randn(rows, in_features, generator=torch.Generator().manual_seed(rows))
    x[:, 5] *= 300  # a huge channel: its group's scale differs from the others'
    got = int8_vnni.product(gemm, x, packed, scale, out_features, in_features)
    ref = int8_vnni.reference_product(x, q, scale)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-4 * ref.abs().max().item())
    tokens = int8_vnni.argmax(argmax, x, packed, scale, out_features, in_features)
    assert torch.equal(tokens, got.argmax(-1))
    native = int8_vnni.kernel()
    if int8_vnni.product_path(True) in ("vnni", "amx"):  # this CPU's own build: AVX512-VNNI
        assert torch.equal(got, int8_vnni.product(native, x, packed, scale, out_features, in_features))


def test_int8_avx2_rows_do_not_depend_on_the_rows_beside_them(avx2):
    gemm, _ = _int8_entries(avx2)
    q, scale = _int8_weight(203, 97, seed=1)
    packed, x = int8_vnni.pack(q), torch.randn(9, 97)
    alone = torch.cat([int8_vnni.product(gemm, x[i : i + 1], packed, scale, 203, 97) for i in range(9)])
    for rows in range(1, 10):
        assert torch.equal(int8_vnni.product(gemm, x[:rows], packed, scale, 203, 97), alone[:rows]), rows


# the same lane of two blocks; two lanes of one block, one in each half; two chunks; the last
# block, partial
@pytest.mark.parametrize("first,second", [(40, 56), (33, 45), (100, 900), (990, 998)])
@pytest.mark.parametrize("rows", [1, 4, 6])
def test_int8_avx2_greedy_tokens_take_the_first_of_tied_channels(avx2, rows, first, second):
    _, argmax = _int8_entries(avx2)
    q, scale = _int8_weight(1000, 128, seed=rows)
    q[:] = q // 4  # every other channel well below the tied ones
    q[first] = q[second] = 127
    scale[:] = 0.01
    x = torch.randn(rows, 128, generator=torch.Generator().manual_seed(7)).abs()
    tokens = int8_vnni.argmax(argmax, x, int8_vnni.pack(q), scale, 1000, 128)
    assert tokens.tolist() == [first] * rows


def test_int8_avx2_non_finite_rows_hand_the_greedy_step_back(avx2):
    gemm, argmax = _int8_entries(avx2)
    q, scale = _int8_weight(64, 32, seed=2)
    packed, x = int8_vnni.pack(q), torch.randn(3, 32)
    x[1, 4] = float("nan")
    y = int8_vnni.product(gemm, x, packed, scale, 64, 32)
    assert y[1].isnan().all() and y[[0, 2]].isfinite().all()
    assert int8_vnni.argmax(argmax, x, packed, scale, 64, 32) is None


@pytest.mark.parametrize("rows", [1, 3, 4, 9])
@pytest.mark.parametrize("group", [32, 128])
def test_int4_avx2_products_follow_the_reference(avx2, rows, group):
    entry = avx2["int4_vnni_cpu"].int4_vnni_gemm
    entry.argtypes, entry.restype = [_PTR, _I64, _I64, _PTR, _PTR, _PTR, _PTR, _I64, _I64], ctypes.c_int
    g = torch.Generator().manual_seed(rows * group)
    out_features, in_features = 48, 256
    q = torch.randint(0, 16, (out_features, in_features), generator=g)
    scale = torch.rand(out_features, in_features // group, generator=g) * 0.01
    zero = torch.randn(out_features, in_features // group, generator=g) * 0.01
    x = torch.randn(rows, in_features, generator=g)
    got = int4_vnni.product(entry, x, *int4_vnni.pack(q, scale, zero, group), out_features, group)
    ref = int4_vnni.reference_product(x, q, scale, zero, group)
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4 * ref.abs().max().item())
