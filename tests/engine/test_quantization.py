"""Weight-only quantization (``common/engine/models/quantized.py``): each scheme's product equals
the product with the weight it stands for, stays near the full-precision product, and a quantized
engine holds fewer bytes and generates close to the full-precision one."""
from __future__ import annotations

import pytest
import torch

from common.engine.config import EngineConfig
from common.engine.engine import Engine
from common.engine.models import int4_vnni, int8_vnni, quantized
from common.engine.models.linear import Linear
from common.engine.models.quantization_scheme import Quantization
from common.engine.models.quantized import Fp8Weight, Int4Weight, Int8Weight, QuantizedEmbedding, quantize_weight
from tests.support.checkpoints import tiny_gemma3_config, tiny_llama_config, write_checkpoint
from tests.support.cpu_flags import cpu_has

pytestmark = pytest.mark.slow(seconds=16)  # a long file: scheduled by its length (tests/conftest.py)

PROMPTS = [[5, 17, 99, 230, 11] * 4, list(range(3, 60))]


def weights(out_features=96, in_features=256, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(out_features, in_features, generator=g) * 0.05, torch.randn(7, in_features, generator=g)


HAS_VNNI = cpu_has("avx512_vnni")
# the int8 and int4 kernels' CPUs: AVX512-VNNI, or AVX2 with FMA (the same layouts and sums)
HAS_INT8_KERNEL = HAS_INT4_KERNEL = HAS_VNNI or (cpu_has("avx2") and cpu_has("fma"))


def product_reference(q, x: torch.Tensor) -> torch.Tensor:
    """What ``q.matmul(x)`` must compute: the product with the dequantized weight, or on the int8
    VNNI kernel the same arithmetic in torch (its activations quantized per row and group)."""
    if isinstance(q, Int8Weight) and q._vnni is not None:
        return int8_vnni.reference_product(x.float(), q.q, q.scale)
    if isinstance(q, Int4Weight) and q._vnni is not None:
        return int4_vnni.reference_product(x.float(), *q._groups(), q.group_size)
    return x.float() @ q.dequantize().float().t()


@pytest.mark.parametrize("make,tolerance", [
    (Int8Weight, 0.01), (lambda w: Int8Weight(w, vnni=False), 0.01), (lambda w: Int4Weight(w, 32), 0.1),
    (lambda w: Int4Weight(w, 64), 0.12), (lambda w: Int4Weight(w, 128), 0.15), (Fp8Weight, 0.05)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_product_is_the_dequantized_weights_and_near_the_original(make, tolerance, dtype):
    w, x = weights()
    q = make(w.to(dtype))
    got = q.matmul(x.to(dtype)).float()
    exact = product_reference(q, x.to(dtype))
    bf16_product = dtype == torch.bfloat16 or isinstance(q, Int4Weight)  # int4's kernel takes bf16 activations
    assert torch.allclose(got, exact, atol=0.02 if bf16_product else 1e-4, rtol=0.02), \
        "the kernel does not compute with the weight it stores"
    full = x @ w.t()
    assert (got - full).norm() / full.norm() < tolerance


@pytest.mark.parametrize("vnni", [True, False])
@pytest.mark.parametrize("rows", [1, 5, 8, 13, 16, 40, 200])
def test_int8_takes_a_c_kernel_and_agrees_with_the_reference_for_any_rows(rows, vnni):
    w, _ = weights(out_features=203, in_features=98)  # partial blocks of 8 and 16 channels, a partial quad
    q = Int8Weight(w, vnni=vnni)
    if vnni and HAS_INT8_KERNEL:
        assert q._vnni is not None and q._gemv is None, "the VNNI kernel did not build"
    else:
        assert q._vnni is None and q._gemv is not None, "the C kernel did not build"
    x = torch.randn(rows, 98)
    x[:, 3] *= 300  # one huge channel: it coarsens the activations' first group only
    assert torch.allclose(q.matmul(x), product_reference(q, x), atol=1e-4, rtol=1e-5)
    if vnni and HAS_INT8_KERNEL and rows > 1:  # a row alone: one-block tiles; from 64 rows two-block ones
        assert torch.equal(torch.cat([q.matmul(x[i : i + 1]) for i in range(rows)]), q.matmul(x))
    ids = torch.tensor([0, 7, 8, 202])
    assert torch.equal(q.rows(ids), q.dequantize()[ids])
    assert torch.equal(Int8Weight.from_packed(q.packed, q.scale, 203, torch.float32, vnni=vnni).q, q.q)


@pytest.mark.skipif(not HAS_INT8_KERNEL, reason="neither AVX512-VNNI nor AVX2 on this CPU")
def test_int8_vnni_embedding_rows_come_from_the_kernel_as_torch_computes_them(monkeypatch):
    """A tied head's embedding lookup (``int8_vnni_rows``): the dequantized rows bit for bit, any
    shape of ids, every lane of a block and a partial quad; an id outside the vocabulary refused."""
    from common.engine.models import int8_vnni

    w, _ = weights(out_features=203, in_features=98)
    q = Int8Weight(w, vnni=True)
    calls = []
    scaled_rows = int8_vnni.scaled_rows
    monkeypatch.setattr(int8_vnni, "scaled_rows", lambda *a: calls.append(1) or scaled_rows(*a))
    ids = torch.tensor([[0, 15, 16, 202], [31, 200, 7, 7]])
    assert torch.equal(q.rows(ids), q.dequantize()[ids]) and calls
    assert torch.equal(q.rows(torch.arange(203)), q.dequantize())
    for bad in (203, -1):
        with pytest.raises(IndexError, match="outside"):
            q.rows(torch.tensor([4, bad]))


@pytest.mark.skipif(not HAS_INT8_KERNEL, reason="neither AVX512-VNNI nor AVX2 on this CPU")
@pytest.mark.parametrize("in_features", [200, 130, 264])  # a partial last group (of 2 inputs: a partial quad)
def test_int8_vnni_keeps_a_huge_channel_to_its_own_group_of_activations(in_features):
    """Each group of inputs has its own scale: a channel 1000 times the rest, alone in its group,
    leaves the other groups' products as precise as without it (one scale a row would round every
    other input to zero: an error of ~0.7 here)."""
    w, _ = weights(out_features=48, in_features=in_features)
    q = Int8Weight(w)
    x = torch.randn(6, in_features)
    group = int8_vnni.ACTIVATION_GROUP
    x[:, (in_features - 1) // group * group :] = 0.0  # the last group: nothing but the huge channel
    x[:, -1] = 1000.0  # exactly 127 steps of its group's scale
    assert (q.matmul(x) - x @ q.dequantize().t()).abs().max() < 0.05


@pytest.mark.skipif(not HAS_INT4_KERNEL, reason="neither AVX512-VNNI nor AVX2 on this CPU")
@pytest.mark.parametrize("group", [32, 64, 128])
@pytest.mark.parametrize("rows", [1, 3, 5, 8, 13, 40])
def test_int4_takes_the_vnni_kernel_holding_the_same_groups_and_agrees_with_the_reference(rows, group):
    w, _ = weights(out_features=48, in_features=256)  # 3 blocks of 16 channels: a partial pass of 2 and 4
    q, aten = Int4Weight(w, group), Int4Weight(w, group, vnni=False)
    assert q._vnni is not None and aten._vnni is None, "the int4 VNNI kernel did not build"
    for mine, theirs in zip(q._groups(), aten._groups()):
        assert torch.equal(mine.float(), theirs.float()), "the two layouts hold different weights"
    x = torch.randn(rows, 256)
    x[:, 5] *= 100  # one huge channel
    torch.testing.assert_close(q.matmul(x), product_reference(q, x), atol=1e-4, rtol=1e-5)
    alone = torch.cat([q.matmul(x[i : i + 1]) for i in range(rows)])
    assert torch.equal(alone, q.matmul(x)), "a row depends on the rows beside it"
    stored = Int4Weight.from_packed(**q.packed_tensors(), out_features=48, in_features=256, group_size=group,
                                    dtype=torch.float32)
    assert all(torch.equal(a, b) for a, b in zip(stored._vnni_weight, q._vnni_weight)), "the stored layout round-trip"
    torch.testing.assert_close(q.dequantize(), aten.dequantize(), atol=1e-6, rtol=0)


@pytest.mark.parametrize("make", [Int8Weight, lambda w: Int8Weight(w, vnni=False), lambda w: Int4Weight(w, 32),
                                  lambda w: Int4Weight(w, 32, vnni=False)], ids=["int8", "int8-fp32-sums", "int4", "int4-torch"])
def test_a_c_kernel_product_refuses_rows_of_another_width(make):
    """The C kernels read by the rows' width: a wrong width is refused, never read past."""
    q = make(weights(out_features=48, in_features=256)[0])
    for bad in (torch.randn(3, 320), torch.randn(3, 128), torch.randn(256)):
        with pytest.raises(ValueError, match="expected rows of 256 inputs"):
            q.matmul(bad)


@pytest.mark.parametrize("make", [Int8Weight, lambda w: Int8Weight(w, vnni=False), lambda w: Int4Weight(w, 32)],
                         ids=["int8", "int8-fp32-sums", "int4"])
def test_a_non_finite_input_makes_its_own_row_non_finite(make):
    """As a float product would: NaN or inf in a row's inputs leaves that row non-finite (the sampler
    then treats it as broken), and the other rows as they were."""
    q = make(weights(out_features=48, in_features=256)[0])
    x = torch.randn(3, 256)
    clean = q.matmul(x)
    x[0, 7], x[2, 200] = float("nan"), float("inf")
    got = q.matmul(x)
    assert not torch.isfinite(got[0]).any() and not torch.isfinite(got[2]).any()
    assert torch.equal(got[1], clean[1])


# whole blocks of 64 (AVX-512) or 32 (AVX2) channels, a last partial one
@pytest.mark.parametrize("out_features", [16, 48, 64, 80, 208])
def test_int4_values_come_back_from_pytorchs_layout_or_through_its_kernel(out_features, monkeypatch):
    """A stored int4 weight is in PyTorch's packed layout, whose blocks depend on the CPU: read back by
    reshapes (checked by packing again), or where that check fails, through PyTorch's own kernel --
    the same values either way, a group of equal weights (scale 0) included."""
    q = torch.randint(0, 16, (out_features, 64), dtype=torch.int32, generator=torch.Generator().manual_seed(5))
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
    assert torch.equal(quantized._torch_int4_values(packed, out_features, 64).int(), q)
    scale, zero = torch.rand(out_features, 2) + 0.1, torch.randn(out_features, 2)
    q[0, :32], scale[0, 0] = 8, 0.0  # the one q a zero scale can come back as: the zero point's
    stored = Int4Weight.from_groups(q, scale, zero, 32, torch.float32).packed_tensors()
    monkeypatch.setattr(quantized, "_torch_int4_values", lambda *args: None)
    slow = Int4Weight.from_packed(**stored, out_features=out_features, in_features=64, group_size=32,
                                  dtype=torch.float32, vnni=False)
    assert torch.equal(slow._groups()[0].int(), q)


@pytest.mark.skipif(not HAS_INT4_KERNEL, reason="neither AVX512-VNNI nor AVX2 on this CPU")
def test_int4_vnni_zero_points_multiply_the_activations_exact_sums():
    """Groups whose weights share a large offset (the zero point): the offset multiplies each
    group's exact sum of activations, so the activations' rounding is scaled by the small spread of
    the weights alone (through the quantized sums the error here is ~0.04)."""
    g = torch.Generator().manual_seed(3)
    w = 0.5 + 0.01 * torch.randn(32, 256, generator=g)  # every weight near 0.5
    q = Int4Weight(w, 32)
    x = torch.randn(4, 256, generator=g)
    assert (q.matmul(x) - x @ q.dequantize().t()).abs().max() < 0.01


@pytest.mark.parametrize("vnni", [True, False])
@pytest.mark.parametrize("out_features", [203, 256, 8, 24])  # partial groups of blocks and a partial block
def test_int8_rows_do_not_depend_on_the_rows_beside_them(out_features, vnni):
    """1-2 rows take four blocks of channels a pass and 3-4 rows two (more accumulator chains in
    flight), more rows one (or, on the fp32 kernel with AVX-512, two 8-channel blocks in one 16-lane
    vector), a last odd block one: every output must still be the same sum in the same order,
    whatever the pass."""
    w, _ = weights(out_features=out_features, in_features=97)
    q = Int8Weight(w, vnni=vnni)
    assert q._vnni is not None or q._gemv is not None, "no C kernel built"
    x = torch.randn(9, 97)
    alone = torch.cat([q.matmul(x[i : i + 1]) for i in range(9)])
    for rows in range(1, 10):
        assert torch.equal(q.matmul(x[:rows]), alone[:rows]), f"{rows} rows"
        assert torch.equal(q.matmul(x[9 - rows :]), alone[9 - rows :]), f"the last {rows} rows"
    assert torch.allclose(alone, product_reference(q, x), atol=1e-4)


# whole blocks of 16 channels; a partial last one (int8 only: int4 packs whole blocks); int8 on the VNNI
# and (where the CPU has them) the AMX tiles -- int4 takes the VNNI tiles either way
@pytest.mark.parametrize("make,out_features,allow_amx", [
    (Int8Weight, 1024, False), (Int8Weight, 1024, True), (Int8Weight, 1000, False), (Int8Weight, 1000, True),
    (lambda w: Int4Weight(w, 32), 1024, True)])
def test_a_large_product_written_past_the_caches_is_its_rows_computed_apart(out_features, make, allow_amx):
    """The VNNI and AMX tiles write an output of 4 MB and more (``STREAM_MIN_BYTES``,
    ``csrc/vnni_rows.h``) by streaming stores where its rows' blocks are whole lines; a smaller one,
    or one with a partial block, as before: the values must be the same bit for bit."""
    if not HAS_VNNI:
        pytest.skip("no AVX512-VNNI: the AVX2 build stores every output through the caches")
    try:
        int8_vnni.product_path(allow_amx)
        q = make(weights(out_features=out_features, in_features=128)[0])
        assert q._vnni is not None, "no VNNI kernel built"
        x = torch.randn(1100, 128, generator=torch.Generator().manual_seed(out_features))
        x[:, 3] *= 300  # a huge channel: its group's scale differs from the others'
        whole = q.matmul(x)  # 1100 x 1024 fp32: 4.5 MB
        apart = torch.cat([q.matmul(x[i : i + 100]) for i in range(0, 1100, 100)])  # 400 KB each
        assert torch.equal(whole, apart)
        torch.testing.assert_close(whole, product_reference(q, x), rtol=1e-4, atol=1e-3)
    finally:
        int8_vnni.product_path(True)


@pytest.mark.parametrize("rows", [1, 5, 8, 13, 40])
@pytest.mark.parametrize("in_features", [96, 97])  # an odd count: the kernel reads inputs in pairs
def test_int8_takes_bf16_rows_as_pairs_on_cpus_with_avx512_bf16(rows, in_features):
    w, _ = weights(out_features=203, in_features=in_features)  # a partial pair of 8-channel blocks
    q = Int8Weight(w, vnni=False)
    if not cpu_has("avx512_bf16"):
        assert q._gemv_bf16 is None
        pytest.skip("no AVX512-BF16 on this CPU: bf16 rows take the fp32 loop")
    assert q._gemv_bf16 is not None, "the bf16 entry of the C kernel did not build"
    x = torch.randn(rows, in_features).to(torch.bfloat16)
    got = q.matmul(x)
    assert got.dtype == torch.bfloat16
    reference = x.float() @ q.dequantize().t()
    # fp32 sums of exact products; the only rounding is the bf16 output's
    assert torch.allclose(got.float(), reference, atol=2e-3, rtol=2 ** -8)


def test_quantized_bytes_are_a_fraction_of_the_weight():
    w, _ = weights(256, 512)
    full = w.numel() * 4
    assert Int8Weight(w).nbytes < 0.27 * full and Int4Weight(w, 128).nbytes < 0.15 * full
    assert Fp8Weight(w).nbytes < 0.27 * full


def test_an_lm_head_is_int8_under_int4_and_bad_settings_are_named():
    w, _ = weights()
    assert isinstance(quantize_weight(w, "int4", 32, head=True), Int8Weight)
    assert isinstance(quantize_weight(w, "int4", 32), Int4Weight)
    with pytest.raises(ValueError, match="group size must be one of"):
        Quantization("int4", 48)
    with pytest.raises(ValueError, match="quantization must be one of"):
        EngineConfig(model="x", quantization="int3")
    with pytest.raises(ValueError, match="24 outputs are not a multiple of 16"):
        Int4Weight(w[:24], 32)
    layer = Linear(256, 96, bias=True)
    with torch.no_grad():
        layer.weight.copy_(w)
        layer.bias.fill_(0.5)
    _, x = weights()
    full = layer(x)
    layer.quantize("int8", 128)
    assert layer.weight.numel() == 0 and torch.allclose(layer(x), full, atol=0.05)


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return write_checkpoint(tiny_llama_config(), tmp_path_factory.mktemp("q-llama"))


@pytest.fixture(scope="module")
def gemma(tmp_path_factory):
    return write_checkpoint(tiny_gemma3_config(), tmp_path_factory.mktemp("q-gemma"))


def engine(checkpoint, scheme: str, group: int = 32) -> Engine:
    return Engine(EngineConfig(model=str(checkpoint), num_blocks=64, block_size=4, quantization=scheme,
                               quantization_group_size=group), load_tokenizer=False)


@pytest.mark.parametrize("checkpoint", ["llama", "gemma"])
@pytest.mark.parametrize("scheme", ["int8", "int4", "fp8"])
def test_a_quantized_engine_is_smaller_and_its_logits_follow_full_precision(request, checkpoint, scheme):
    directory = request.getfixturevalue(checkpoint)
    full, quantized = engine(directory, "none"), engine(directory, scheme)
    assert isinstance(quantized.model.model.embed_tokens, QuantizedEmbedding), "the embedding is quantized"
    assert quantized.model.weight_bytes() < 0.6 * full.model.weight_bytes()
    a, b = top_logprobs(full, PROMPTS[1]), top_logprobs(quantized, PROMPTS[1])
    overlap = len(set(a) & set(b)) / len(a)
    shift = max(abs(a[t] - b[t]) for t in set(a) & set(b))
    # Loose: tiny random models have nearly flat logits (the real model's quality is measured in
    # benchmarks/quant_quality.py); a wrong scale, zero point or layout leaves next to no overlap.
    assert overlap >= (0.9 if scheme == "int8" else 0.5) and shift < (0.25 if scheme == "int8" else 1.5), \
        f"{scheme}: the next token's top 20 drift (overlap {overlap:.2f}, largest log-prob change {shift:.3f})"
    out = quantized.generate(PROMPTS, {"max_tokens": 8, "temperature": 0, "ignore_eos": True})
    assert all(len(r.token_ids) == 8 for r in out)


def top_logprobs(e: Engine, prompt: list[int]) -> dict[int, float]:
    """The next token's 20 likeliest ids and their log-probabilities."""
    first = e.generate([prompt], {"max_tokens": 1, "temperature": 0, "logprobs": 20})[0].logprobs[0]
    return dict(first.top)
