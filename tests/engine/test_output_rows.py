"""A step's last layer past its K/V for the sampling rows alone (``OutputRows``): the same hidden
states for those rows and the same cache as the full forward, and the runner asks for it exactly
where some tokens do not sample."""
from __future__ import annotations

import pytest
import torch

from common.engine.attention.interface import AttentionRequest, OutputRows, trailing_queries
from common.engine.config import EngineConfig
from common.engine.engine import Engine
from tests.support.checkpoints import tiny_gemma3_config, tiny_llama_config, write_checkpoint

BLOCK = 4


def test_trailing_queries_keep_each_requests_context_and_blocks_and_drop_empty_ones():
    requests = [AttentionRequest(0, 5, 9, [0, 1, 2], 3), AttentionRequest(5, 1, 7, [4, 5]),
                AttentionRequest(6, 4, 4, [6])]
    assert trailing_queries(requests, [2, 0, 1]) == [AttentionRequest(0, 2, 9, [0, 1, 2], 3),
                                                     AttentionRequest(2, 1, 4, [6])]
    assert trailing_queries(requests, [0, 0, 0]) == []
    with pytest.raises(ValueError, match="2 of a request's 1 queries"):
        trailing_queries(requests, [1, 2, 0])


@pytest.fixture(scope="module", params=["gemma3", "llama"])
def checkpoint(request, tmp_path_factory):
    config = tiny_gemma3_config() if request.param == "gemma3" else tiny_llama_config()
    return write_checkpoint(config, tmp_path_factory.mktemp(request.param))


def engine_for(checkpoint, backend: str) -> Engine:
    engine = Engine(EngineConfig(model=str(checkpoint), dtype="float32", block_size=BLOCK, attention_backend=backend,
                                 max_num_batched_tokens=256, num_blocks=64, compile=False), load_tokenizer=False)
    engine.model.fuse_layers = False  # the layer-by-layer path, whatever the step's size
    return engine


def blocks(first: int, tokens: int) -> list[int]:
    return list(range(first, first + -(-tokens // BLOCK)))


# (tokens cached before the step, tokens in it, rows it samples): a chunk that ends mid-prompt, a
# prompt's last chunk over a cached prefix, a decode, a fresh prompt, a verification of 2 drafts
STEP = [(0, 7, 0), (6, 9, 1), (12, 1, 1), (0, 11, 1), (5, 3, 3)]


def forward(engine, step, output_counts=None):
    """Fill each request's cached prefix, then run ``step``: all hidden states, or the ``OutputRows``'."""
    model, attention, cache = engine.model, engine.attention, engine.kv_cache
    requests, ids, positions, first_block = [], [], [], 0
    prefixes = []
    for cached, new, _ in step:
        block_ids = blocks(first_block, cached + new)
        first_block += len(block_ids)
        if cached:
            prefixes.append(AttentionRequest(sum(r.num_query_tokens for r in prefixes), cached, cached, block_ids))
        requests.append(AttentionRequest(len(ids), new, cached + new, block_ids))
        ids += [(7 * len(ids) + 3 * i) % 500 + 3 for i in range(new)]
        positions += range(cached, cached + new)
    if prefixes:
        prefix_ids = [(5 * i) % 400 + 3 for i in range(sum(r.num_query_tokens for r in prefixes))]
        prefix_positions = [p for r in prefixes for p in range(r.num_query_tokens)]
        model(torch.tensor(prefix_ids), torch.tensor(prefix_positions), cache, attention.prepare(prefixes, "cpu"),
              attention)
    meta = attention.prepare(requests, "cpu")
    output = None
    if output_counts is not None:
        rows = [r.query_start + r.num_query_tokens - c + j for r, c in zip(requests, output_counts) for j in range(c)]
        trailing = trailing_queries(requests, output_counts)
        output = OutputRows(torch.tensor(rows, dtype=torch.long),
                            attention.prepare(trailing, "cpu") if trailing else None)
    hidden = model(torch.tensor(ids), torch.tensor(positions), cache, meta, attention, output)
    return hidden, output


@pytest.mark.parametrize("backend", ["cpu", "torch"])
def test_the_output_rows_hidden_states_and_the_cache_equal_the_full_forwards(checkpoint, backend, request):
    if backend == "cpu":
        request.getfixturevalue("cpu_kernel")
    engine = engine_for(checkpoint, backend)
    counts = [rows for _, _, rows in STEP]
    engine.kv_cache.buffer.zero_()
    full, _ = forward(engine, STEP)
    full_cache = engine.kv_cache.buffer.clone()
    engine.kv_cache.buffer.zero_()
    only, output = forward(engine, STEP, counts)
    assert only.shape == (sum(counts), full.shape[1])
    torch.testing.assert_close(only, full[output.rows], rtol=1e-5, atol=1e-5)
    assert torch.equal(engine.kv_cache.buffer, full_cache)  # every token's K/V, the last layer's too


def test_a_step_with_no_output_rows_writes_every_layers_kv_and_returns_nothing(checkpoint):
    engine = engine_for(checkpoint, "torch")
    step = [(0, 7, 0), (4, 6, 0)]
    engine.kv_cache.buffer.zero_()
    forward(engine, step)
    full_cache = engine.kv_cache.buffer.clone()
    engine.kv_cache.buffer.zero_()
    hidden, output = forward(engine, step, [0, 0])
    assert output.meta is None and hidden.shape[0] == 0
    assert torch.equal(engine.kv_cache.buffer, full_cache)


def test_the_runner_asks_for_the_sampling_rows_where_some_tokens_do_not_sample(checkpoint, monkeypatch):
    engine = engine_for(checkpoint, "torch")
    seen = []
    model_forward = type(engine.model).forward

    def spy(model, input_ids, positions, cache, meta, backend, output=None):
        seen.append((input_ids.shape[0], None if output is None else output.rows.tolist()))
        return model_forward(model, input_ids, positions, cache, meta, backend, output)

    monkeypatch.setattr(type(engine.model), "forward", spy)
    prompt = list(range(3, 14))  # 11 tokens
    [result] = engine.generate([prompt], {"max_tokens": 3, "temperature": 0.0, "ignore_eos": True})
    assert len(result.token_ids) == 3
    assert seen[0] == (11, [10])  # the prompt step: its last token alone goes past the last layer's K/V
    assert all(rows is None for _, rows in seen[1:])  # decodes: every token samples
