"""What a prefill worker checks in a PrefillRequest before it computes or ships anything.

The caller is authenticated (signed request), but a bug or a compromised peer must still not be
able to reach the engine thread with a negative slice, ship KV to an arbitrary address, or break
the KV connection shared with a decode worker.  Every field is checked here; a failure is a
ValueError naming the field, answered 400 before the request is tracked or admitted.

    prompt_token_ids   each in [0, vocab_size)   (msgspec: non-empty list of ints >= 0)
    resume_token_ids   each in [0, vocab_size); the KV shipped covers the prompt and these
    decode_worker_id   a verified registry entry of this model -> where the KV goes
    num_skip_blocks    0 <= skip < blocks of the KV (the last token is always computed)
    dst_block_ids      one per shipped block (blocks - skip), unique, each inside the decode
                       worker's pool as it registered it
    sampling_params    validated by msgspec on decode (ranges), then by the engine
"""
from __future__ import annotations

from common.cluster.messages import PrefillRequest
from common.cluster.registry import KVAddress, WorkerInfo
from common.engine.kv.kv_cache_manager import cdiv


def check_prefill_request(body: PrefillRequest, decode_entry: WorkerInfo | None, *, vocab_size: int,
                          block_size: int, transport: str) -> KVAddress:
    """The KV address to ship to, once every field of ``body`` is consistent; else ValueError."""
    prompt = body.prompt_token_ids
    if not prompt:
        raise ValueError("prompt_token_ids: the prompt is empty")
    for name, tokens in (("prompt_token_ids", prompt), ("resume_token_ids", body.resume_token_ids)):
        if tokens and max(tokens) >= vocab_size:
            raise ValueError(f"{name}: token id {max(tokens)} is outside the vocabulary [0, {vocab_size})")
    if decode_entry is None:
        raise ValueError(f"decode_worker_id {body.decode_worker_id!r}: no verified registry entry for this model")
    if decode_entry.capacity.block_size != block_size:
        raise ValueError(f"decode_worker_id {body.decode_worker_id!r}: its block size is "
                         f"{decode_entry.capacity.block_size}, this worker's is {block_size}")
    if decode_entry.kv_address.transport != transport:
        raise ValueError(f"decode_worker_id {body.decode_worker_id!r}: it receives KV over "
                         f"{decode_entry.kv_address.transport}, this worker ships over {transport}")
    num_blocks = cdiv(len(prompt) + len(body.resume_token_ids), block_size)
    if not 0 <= body.num_skip_blocks < num_blocks:
        raise ValueError(f"num_skip_blocks: {body.num_skip_blocks} is outside [0, {num_blocks}) for a prompt of "
                         f"{num_blocks} blocks (the last token is always computed here)")
    expected = num_blocks - body.num_skip_blocks
    dst = body.dst_block_ids
    if len(dst) != expected:
        raise ValueError(f"dst_block_ids: {len(dst)} ids for {expected} blocks to ship ({num_blocks} blocks, "
                         f"{body.num_skip_blocks} skipped)")
    if len(set(dst)) != len(dst):
        raise ValueError("dst_block_ids: the same destination block appears twice")
    capacity = decode_entry.capacity.num_kv_blocks
    if dst and (min(dst) < 0 or max(dst) >= capacity):
        raise ValueError(f"dst_block_ids: ids must be in [0, {capacity}), the decode worker's pool")
    return decode_entry.kv_address
