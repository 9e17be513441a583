"""CUDA graphs for decode-only steps, on CPU: the bucketing, the padding and the persistent buffers.

The only CUDA-specific call (``cuda_graphs.capture``) is replaced by one that re-runs the captured
step over the same persistent buffers, so what a replay reads is exactly what a graph would read.
The Triton backend runs under Triton's interpreter; flash-attn through its torch stand-in.
"""
import os

os.environ["TRITON_INTERPRET"] = "1"

import math  # noqa: E402
import sys  # noqa: E402
import types  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

from common.engine import cuda_graphs  # noqa: E402
from common.engine.attention.interface import AttentionRequest, PagedMetadata  # noqa: E402
from common.engine.attention.selection import make_attention  # noqa: E402
from common.engine.attention.backend_flash import FlashAttention  # noqa: E402
from common.engine.config import EngineConfig  # noqa: E402
from common.engine.cuda_graphs import CudaGraphs, batch_buckets, bucket_for, copy_into, padded_requests  # noqa: E402
from common.engine.engine import Engine  # noqa: E402
from common.engine.kv.kv_cache import KVCache, KVLayout  # noqa: E402
from common.engine.loading.model_loader import load_model  # noqa: E402
from tests.support.checkpoints import VOCAB, tiny_llama_config, write_checkpoint  # noqa: E402
from tests.support.attention_reference import kvcache_reference, varlen_reference  # noqa: E402


class EagerCapture:
    """Stands in for ``torch.cuda.graph``: a replay re-runs the step into the captured output."""

    def __init__(self):
        self.captured: list[int] = []
        self.replays = 0

    def __call__(self, step, pool):
        output = step()
        self.captured.append(output.shape[0])

        def replay():
            self.replays += 1
            with torch.inference_mode():
                output.copy_(step())

        return replay, output


def test_batch_buckets_and_the_bucket_of_a_batch():
    assert batch_buckets(128) == [1, 2, 4] + list(range(8, 129, 8))
    assert batch_buckets(1) == [1] and batch_buckets(5) == [1, 2, 4, 5] and batch_buckets(20) == [1, 2, 4, 8, 16, 20]
    buckets = batch_buckets(20)
    assert [bucket_for(n, buckets) for n in (1, 3, 4, 9, 17, 20)] == [1, 4, 4, 16, 20, 20]
    assert bucket_for(21, buckets) is None


def test_graphs_are_captured_on_cuda_for_the_triton_and_flash_backends_only(monkeypatch):
    cuda = torch.device("cuda")
    assert cuda_graphs.supported(cuda, make_attention("triton", "cpu", {None}, 16))
    assert cuda_graphs.supported(cuda, fake_flash(monkeypatch))
    assert not cuda_graphs.supported(cuda, make_attention("torch", "cpu", {None}, 16))
    assert not cuda_graphs.supported(torch.device("cpu"), make_attention("triton", "cpu", {None}, 16))


def test_padding_rows_point_at_the_scratch_block_only():
    real = [AttentionRequest(0, 1, 20, [5, 2]), AttentionRequest(1, 1, 3, [7])]
    padded = padded_requests(real, 4, scratch_block=9)
    assert padded[:2] == real
    assert [(r.query_start, r.num_query_tokens, r.context_len, r.block_ids) for r in padded[2:]] == \
        [(2, 1, 1, [9]), (3, 1, 1, [9])]
    meta = PagedMetadata.build(padded, 16, "cpu")
    assert meta.slots.tolist() == [2 * 16 + 3, 7 * 16 + 2, 9 * 16, 9 * 16]
    with pytest.raises(AssertionError):
        padded_requests([AttentionRequest(0, 2, 2, [1])], 2, 9)


def test_copy_into_fills_the_leading_corner_and_refuses_what_does_not_fit():
    persistent = PagedMetadata.build([AttentionRequest(i, 1, 64, [0, 0, 0, 0]) for i in range(4)], 16, "cpu")
    persistent.block_table.fill_(-7)
    step = PagedMetadata.build(padded_requests([AttentionRequest(0, 1, 20, [5, 2])], 4, 9), 16, "cpu")
    copy_into(persistent, step)
    assert persistent.block_table[:, :2].tolist() == [[5, 2], [9, 0], [9, 0], [9, 0]]
    assert persistent.block_table[:, 2:].eq(-7).all()  # beyond each row's keys: never read
    assert persistent.seq_lens.tolist() == [20, 1, 1, 1] and persistent.query_start.tolist() == [0, 1, 2, 3, 4]
    wider = PagedMetadata.build([AttentionRequest(0, 1, 80, [1] * 5)], 16, "cpu")
    with pytest.raises(AssertionError, match="does not fit"):
        copy_into(persistent, wider)


def fake_flash(monkeypatch):
    module = types.ModuleType("flash_attn")
    module.flash_attn_varlen_func = varlen_reference
    module.flash_attn_with_kvcache = kvcache_reference
    monkeypatch.setitem(sys.modules, "flash_attn", module)
    return FlashAttention({None}, 256)


@pytest.mark.parametrize("backend_name, block_size", [("triton", 16), ("flash", 256)])
def test_replays_match_eager_steps_and_padding_writes_only_the_scratch_block(backend_name, block_size, tmp_path,
                                                                              monkeypatch):
    directory = write_checkpoint(tiny_llama_config(), tmp_path / "ckpt")
    model, mc = load_model(directory, torch.float32, torch.device("cpu"))
    backend = make_attention("triton", "cpu", {None}, block_size) if backend_name == "triton" else \
        fake_flash(monkeypatch)
    layout = KVLayout("m", "float32", block_size, mc.num_layers, mc.num_kv_heads, mc.head_dim)
    num_blocks = 24
    g = torch.Generator().manual_seed(0)
    graph_cache = KVCache(layout, num_blocks, scratch_block=True)
    graph_cache.buffer.copy_(torch.randn(graph_cache.buffer.shape, generator=g))
    eager_cache = KVCache(layout, num_blocks)
    eager_cache.buffer.copy_(graph_cache.buffer[:num_blocks])
    fake = EagerCapture()
    max_blocks = 4
    graphs = CudaGraphs(model, graph_cache, backend, max_batch=4, max_blocks_per_request=max_blocks,
                        device=torch.device("cpu"), capture_fn=fake).capture_all()
    assert sorted(fake.captured) == [1, 2, 4]
    assert graph_cache.buffer[:num_blocks].equal(eager_cache.buffer), "capture touched real blocks"

    free = torch.randperm(num_blocks, generator=g).tolist()
    steps = [[3 * block_size + 5, 2, block_size + 1], [40, block_size], [1, 7, 2 * block_size]]  # keys after step
    for contexts in steps:  # 3 requests (bucket 4, one padding row), then 2 (bucket 2), then 3 again
        requests = [AttentionRequest(i, 1, ctx, [free.pop() for _ in range(math.ceil(ctx / block_size))])
                    for i, ctx in enumerate(contexts)]
        input_ids = torch.randint(3, VOCAB, (len(requests),), generator=g).tolist()
        positions = [ctx - 1 for ctx in contexts]
        before = graph_cache.buffer.clone()
        hidden = graphs.run(input_ids, positions, requests)
        expected = model(torch.tensor(input_ids), torch.tensor(positions), eager_cache,
                         backend.prepare(requests, "cpu"), backend)
        torch.testing.assert_close(hidden, expected, rtol=1e-5, atol=1e-5)
        # The same slots written (values within rounding: the padded batch's matmuls have more rows) ...
        torch.testing.assert_close(graph_cache.buffer[:num_blocks], eager_cache.buffer, rtol=1e-5, atol=1e-5)
        # ... and no other real block touched at all.
        touched = {b for r in requests for b in r.block_ids}
        others = [b for b in range(num_blocks) if b not in touched]
        assert graph_cache.buffer[others].equal(before[others]), "a padding row wrote a real block"
        graph_cache.buffer[:num_blocks].copy_(eager_cache.buffer)
        for r in requests:
            free.extend(r.block_ids)
    assert fake.replays == 3

    too_long = [AttentionRequest(0, 1, (max_blocks + 1) * block_size, list(range(max_blocks + 1)))]
    assert graphs.run([5], [0], too_long) is None  # longer than the captured block tables: eager
    assert graphs.run([5, 6], [3, 4], [AttentionRequest(0, 2, 5, [1])]) is None  # a prompt chunk: eager
    assert graphs.run([5] * 5, [3] * 5, [AttentionRequest(i, 1, 5, [1]) for i in range(5)]) is None  # > 4


def test_engine_with_cuda_graphs_gives_the_same_greedy_tokens(tmp_path, monkeypatch):
    """The whole engine, decode-only steps replayed (on CPU through the stand-in capture), prompt
    chunks eager: the same greedy tokens as the torch path without graphs."""
    directory = write_checkpoint(tiny_llama_config(), tmp_path / "ckpt")
    fake = EagerCapture()
    monkeypatch.setattr(cuda_graphs, "supported", lambda device, attention: attention.name == "triton")
    monkeypatch.setattr(cuda_graphs, "capture", fake)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in (5, 37, 11)]
    params = {"temperature": 0.0, "ignore_eos": True, "max_tokens": 5}
    outputs = {}
    for backend in ("torch", "triton"):
        engine = Engine(EngineConfig(model=str(directory), num_blocks=32, block_size=16, max_num_batched_tokens=24,
                                     max_num_seqs=4, attention_backend=backend), load_tokenizer=False)
        assert (engine.runner.graphs is not None) == (backend == "triton")
        outputs[backend] = [r.token_ids for r in engine.generate(prompts, params)]
    assert fake.replays > 0
    assert outputs["triton"] == outputs["torch"]

    off = Engine(EngineConfig(model=str(directory), num_blocks=8, attention_backend="triton", cuda_graphs=False),
                 load_tokenizer=False)
    assert off.runner.graphs is None and off.kv_cache.scratch_block is None
