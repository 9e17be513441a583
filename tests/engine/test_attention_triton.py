"""The Triton paged-attention backend on CPU, under Triton's interpreter, against the torch path.

``TRITON_INTERPRET=1`` is set before anything builds a kernel (the backend builds its kernels on
first use, when ``triton.jit`` reads the variable), so the GPU kernels run here unchanged.
Shapes are tiny: the interpreter runs every program in Python.
"""
import os

os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402

from common.engine.attention.interface import AttentionRequest, PagedMetadata  # noqa: E402
from common.engine.attention.check import SMALL_CASES, run_case  # noqa: E402
from common.engine.attention.backend_triton import paged_attention, write_kv  # noqa: E402
from common.engine.config import EngineConfig  # noqa: E402
from common.engine.engine import Engine  # noqa: E402
from common.engine.kv.kv_cache import KVCache, KVLayout  # noqa: E402
from tests.support.checkpoints import VOCAB, tiny_gemma3_config, tiny_llama_config, write_checkpoint  # noqa: E402

TOLERANCE = 1e-3  # issue 13: every case within 1e-3 of the torch path in fp32


@pytest.mark.parametrize("case", SMALL_CASES, ids=lambda c: c.name)
def test_triton_matches_torch_path(case):
    result = run_case(case, "triton", "cpu", torch.float32)
    assert result.cache_matches, "the new K/V landed in other slots than the torch path writes"
    assert result.max_abs_err < TOLERANCE, f"{case.name}: max abs error {result.max_abs_err}"


def test_a_bf16_cache_under_fp32_queries_reads_as_the_torch_path_does():
    """--kv-cache-dtype bfloat16 under an fp32 model: the new K/V stored rounded, the attention in
    fp32 over what the cache holds -- as the torch path (tests/engine/test_kv_cache_dtype.py)."""
    from common.engine.attention.backend_torch import TorchAttention
    from common.engine.attention.backend_triton import TritonAttention

    g = torch.Generator().manual_seed(4)
    requests = [AttentionRequest(0, 3, 21, [5, 2]), AttentionRequest(3, 1, 9, [7])]
    q, k, v = (torch.randn(4, h, 16, generator=g) for h in (4, 1, 1))
    outs, caches = [], []
    for backend in (TritonAttention({None}, 16), TorchAttention({None}, 16)):
        cache = KVCache(KVLayout("m", "bfloat16", 16, 1, 1, 16), 8)
        cache.buffer.copy_(torch.randn(cache.buffer.shape, generator=torch.Generator().manual_seed(5)))
        outs.append(backend.forward(q, k, v, cache, 0, backend.prepare(requests, "cpu"), None, 0.25))
        caches.append(cache.buffer)
    assert outs[0].dtype == torch.float32 and torch.equal(caches[0], caches[1])
    torch.testing.assert_close(outs[0], outs[1], rtol=TOLERANCE, atol=TOLERANCE)


def test_padding_rows_write_nothing_and_attend_to_nothing():
    """CUDA-graph batches pad with rows whose slot is -1 and whose request has no keys: they must
    leave the cache alone, output zeros, and not disturb the real rows beside them."""
    g = torch.Generator().manual_seed(1)
    layout = KVLayout("m", "float32", 16, 1, 2, 16)
    cache = KVCache(layout, 8)
    cache.buffer.copy_(torch.randn(cache.buffer.shape, generator=g))
    before = cache.buffer.clone()
    real = AttentionRequest(0, 1, 20, [5, 2])
    meta = PagedMetadata.build([real], 16, "cpu")
    q = torch.randn(3, 4, 16, generator=g)
    k = torch.randn(3, 2, 16, generator=g)
    v = torch.randn(3, 2, 16, generator=g)
    slots = torch.cat([meta.slots, torch.tensor([-1, -1])])
    write_kv(k, v, cache.key(0), cache.value(0), slots)
    changed = (cache.buffer != before).any(dim=(1, 2, 4, 5)).nonzero().tolist()
    assert changed == [[2, 3]], "only block 2, offset 3 (position 19 of the real request) may change"

    table = torch.zeros(3, 2, dtype=torch.int32)
    table[0] = meta.block_table[0]
    out = paged_attention(q, cache.key(0), cache.value(0), torch.full_like(q, float("nan")), table,
                          torch.tensor([20, 0, 0], dtype=torch.int32), torch.arange(4, dtype=torch.int32), 1,
                          16**-0.5, None)
    alone = paged_attention(q[:1], cache.key(0), cache.value(0), torch.empty_like(q[:1]), meta.block_table,
                            meta.seq_lens, meta.query_start, 1, 16**-0.5, None)
    assert torch.equal(out[1:], torch.zeros_like(out[1:]))
    torch.testing.assert_close(out[:1], alone)


@pytest.mark.parametrize("make_config", [tiny_llama_config, tiny_gemma3_config], ids=["llama", "gemma3"])
def test_engine_greedy_output_with_triton_equals_torch_path(make_config, tmp_path):
    """The whole engine with the Triton backend: chunked prompts beside decodes, block size 16
    (Gemma 3: sliding-window layers), same greedy tokens as with the torch path."""
    directory = write_checkpoint(make_config(), tmp_path / "ckpt")
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in (5, 37)]
    params = {"temperature": 0.0, "ignore_eos": True, "max_tokens": 4}
    outputs = {}
    for backend in ("torch", "triton"):
        engine = Engine(EngineConfig(model=str(directory), num_blocks=32, block_size=16, max_num_batched_tokens=24,
                                     attention_backend=backend), load_tokenizer=False)
        assert engine.attention.name == backend
        outputs[backend] = [r.token_ids for r in engine.generate(prompts, params)]
    assert outputs["triton"] == outputs["torch"]
