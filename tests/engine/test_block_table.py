"""The persistent block table: rows appended to, released and reused, grown; the attention
metadata (CPU kernel, Triton/flash-attn) gathered from it equals the one built from block id
lists; the engine's steps use it."""
import random

import pytest
import torch

from common.engine.attention.interface import AttentionRequest
from common.engine.attention.backend_cpu import step_metadata
from common.engine.kv.block_table import BlockTable


def test_rows_grow_by_appending_and_are_reused_after_release():
    table = BlockTable(rows=2, max_blocks=2)
    table.append("a", [12, 5])
    table.append("b", [7])
    table.append("a", [31])  # past the columns: the table grows
    assert table.ids("a") == [12, 5, 31] and table.ids("b") == [7]
    assert table.row_ids("a") == [12, 5, 31] and table.row_ids("b") == [7]  # the tensor holds the same
    assert table.table.shape[1] >= 3
    table.ids("a").append(99)  # a copy: the caller cannot change the table
    assert table.ids("a") == [12, 5, 31]
    row_a = table.row("a")
    table.release("a")
    assert table.row("a") is None and table.ids("a") == [] and table.row_ids("a") == []
    assert table.table[row_a].tolist() == [0] * table.table.shape[1]
    table.append("c", [3, 4])  # takes the freed row
    assert table.row("c") == row_a and table.ids("c") == [3, 4]
    table.append("d", [9])  # past the rows: the table grows, every row keeps its ids
    assert table.ids("b") == [7] and table.ids("c") == [3, 4] and table.ids("d") == [9]
    assert [table.row_ids(r) for r in "bcd"] == [[7], [3, 4], [9]]
    assert len({table.row(r) for r in "bcd"}) == 3
    table.append("e", [])
    assert table.row("e") is None  # no blocks, no row


def test_gather_takes_rows_in_step_order():
    table = BlockTable()
    table.append("a", [1, 2, 3])
    table.append("b", [4])
    gathered = table.gather([table.row("b"), table.row("a")], 3)
    assert gathered.tolist() == [[4, 0, 0], [1, 2, 3]]


@pytest.mark.parametrize("seed", range(5))
def test_cpu_metadata_from_the_table_equals_the_one_from_lists(seed):
    rng = random.Random(seed)
    table, requests, start = BlockTable(rows=4, max_blocks=4), [], 0
    for i in range(rng.randint(1, 9)):
        context = rng.randint(1, 90)
        new = rng.choice([1, 1, rng.randint(1, context)])
        blocks = rng.sample(range(1000), -(-context // 4))
        table.append(f"r{i}", blocks[:2])  # rows written over several steps
        table.append(f"r{i}", blocks[2:])
        requests.append(AttentionRequest(start, new, context, blocks, table.row(f"r{i}")))
        start += new
    built, gathered = step_metadata(requests, 4), step_metadata(requests, 4, table)
    for field in ("slot_blocks", "slot_offsets", "block_table", "query_start", "context_lens"):
        assert torch.equal(getattr(built, field), getattr(gathered, field)), field
    from common.engine.attention.interface import PagedMetadata  # the Triton and flash-attn backends' metadata

    paged_built, paged_gathered = PagedMetadata.build(requests, 4, "cpu"), PagedMetadata.build(requests, 4, "cpu", table)
    for field in ("slots", "block_table", "seq_lens", "query_start", "max_query_len", "max_seq_len"):
        assert torch.equal(torch.as_tensor(getattr(paged_built, field)), torch.as_tensor(getattr(paged_gathered, field)))
    expected_slots = [r.block_ids[p // 4] * 4 + p % 4 for r in requests
                      for p in range(r.context_len - r.num_query_tokens, r.context_len)]
    assert paged_built.slots.tolist() == expected_slots
    requests[0].table_row = None  # a request without a row: built from the lists for the whole step
    assert torch.equal(step_metadata(requests, 4, table).block_table, built.block_table)


def test_engine_steps_gather_the_persistent_table(monkeypatch, tmp_path):
    from common.engine.kv import block_table as module
    from common.engine.attention.backend_cpu import CpuPagedAttention
    from common.engine.config import EngineConfig
    from common.engine.engine import Engine
    from tests.support.checkpoints import hf_greedy, tiny_llama_config, write_checkpoint

    directory = write_checkpoint(tiny_llama_config(), tmp_path / "llama")
    engine = Engine(EngineConfig(model=str(directory), num_blocks=64, block_size=4, max_num_batched_tokens=16),
                    load_tokenizer=False)
    if not isinstance(engine.attention, CpuPagedAttention):
        pytest.skip("the CPU attention kernel did not build here")
    assert engine.attention.block_table is engine.scheduler.kv_manager.table
    gathers = []
    real_gather = module.BlockTable.gather
    monkeypatch.setattr(module.BlockTable, "gather", lambda self, rows, n: gathers.append(rows) or real_gather(self, rows, n))
    prompts = [[5, 9, 11, 3, 7, 21, 30, 2, 8], [4, 4, 19, 23, 50]]
    results = engine.generate(prompts, {"temperature": 0.0, "ignore_eos": True, "max_tokens": 6})
    assert gathers, "no step read the persistent table"
    for prompt, result in zip(prompts, results):
        assert result.token_ids == hf_greedy(directory, prompt, 6)
    engine.scheduler.check_integrity()
    assert engine.scheduler.kv_manager.table.lengths == {}  # finished requests gave their rows back
