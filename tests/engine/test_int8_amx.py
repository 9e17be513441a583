"""The int8 products on AMX tiles (``csrc/int8_amx.h``): the VNNI tiles' results bit for bit."""
from __future__ import annotations

import pytest
import torch

from common.engine.models import int8_vnni

AMX = int8_vnni.product_path(True) == "amx"
pytestmark = pytest.mark.skipif(not AMX, reason="no AMX-INT8 on this CPU (or Linux does not grant it)")


@pytest.fixture(autouse=True)
def amx_allowed_after():
    yield
    int8_vnni.product_path(True)


def _weight(out_features: int, in_features: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(-127, 128, (out_features, in_features), dtype=torch.int8, generator=g)
    scale = torch.rand(out_features, generator=g) * 0.02 + 1e-3
    return q, scale, int8_vnni.pack(q)


def _both_paths(fn):
    out = {}
    for allow in (False, True):
        assert int8_vnni.product_path(allow) == ("amx" if allow else "vnni")
        out[allow] = fn()
    return out[False], out[True]


@pytest.mark.parametrize("out_features", [16, 40, 200, 1000])  # one block; a pass's second block partial; odd blocks
@pytest.mark.parametrize("in_features", [64, 640])
# from the AMX threshold; one row tile, two (a pass of 32 rows), a pass and a remainder of one row;
# several blocks of 128 rows (vnni_rows.h's ROW_BLOCK), the last one partial
@pytest.mark.parametrize("rows", [5, 8, 16, 17, 32, 33, 161])
def test_amx_products_and_greedy_tokens_are_the_vnni_ones_bit_for_bit(out_features, in_features, rows):
    q, scale, packed = _weight(out_features, in_features, seed=out_features * 7 + rows)
    x = torch.randn(rows, in_features, generator=torch.Generator().manual_seed(rows))
    x[:, 5] *= 300  # a huge channel: its group's scale differs from the others'
    entry, argmax = int8_vnni.kernel(), int8_vnni.argmax_kernel()
    vnni, amx = _both_paths(lambda: int8_vnni.product(entry, x, packed, scale, out_features, in_features))
    assert torch.equal(vnni, amx)
    ref = int8_vnni.reference_product(x, q, scale)
    torch.testing.assert_close(amx, ref, rtol=1e-5, atol=1e-4 * ref.abs().max().item())
    tokens = _both_paths(lambda: int8_vnni.argmax(argmax, x, packed, scale, out_features, in_features))
    assert torch.equal(tokens[0], tokens[1]) and torch.equal(tokens[1], amx.argmax(-1))


@pytest.mark.parametrize("in_features,rows", [(100, 8), (640, 4)])  # inputs off the tiles' 64; fewer rows
def test_shapes_the_tiles_do_not_take_still_give_the_vnni_products(in_features, rows):
    q, scale, packed = _weight(48, in_features, seed=3)
    x = torch.randn(rows, in_features, generator=torch.Generator().manual_seed(4))
    entry = int8_vnni.kernel()
    vnni, amx = _both_paths(lambda: int8_vnni.product(entry, x, packed, scale, 48, in_features))
    assert torch.equal(vnni, amx)
    torch.testing.assert_close(amx, int8_vnni.reference_product(x, q, scale), rtol=1e-5, atol=1e-3)


def test_a_non_finite_row_stays_its_own_on_the_tiles():
    q, scale, packed = _weight(64, 128, seed=5)
    x = torch.randn(8, 128, generator=torch.Generator().manual_seed(6))
    x[3, 10] = float("nan")
    y = int8_vnni.product(int8_vnni.kernel(), x, packed, scale, 64, 128)
    assert y[3].isnan().all() and y[torch.arange(8) != 3].isfinite().all()
    assert int8_vnni.argmax(int8_vnni.argmax_kernel(), x, packed, scale, 64, 128) is None


@pytest.mark.parametrize("group", [16, 32, 64, 128, 256])  # a tile product a group's quarter ... four a group
@pytest.mark.parametrize("in_features", [256, 320])  # whole groups; a last group shorter than the rest
@pytest.mark.parametrize("rows", [5, 17])
def test_other_activation_groups_give_the_vnni_products_too(group, in_features, rows):
    q, scale, packed = _weight(40, in_features, seed=group + rows)
    x = torch.randn(rows, in_features, generator=torch.Generator().manual_seed(rows))
    x[:, 9] *= 300
    entry = int8_vnni.kernel()
    vnni, amx = _both_paths(lambda: int8_vnni.run_entry("int8", entry, x, in_features, (packed, scale), 40, group))
    assert torch.equal(vnni, amx)
    ref = int8_vnni.reference_product(x, q, scale, group)
    torch.testing.assert_close(amx, ref, rtol=1e-5, atol=1e-4 * ref.abs().max().item())
