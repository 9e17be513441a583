"""Triton paged attention: one launch over the whole packed batch, reading the block table directly.

Prompt chunks and decodes share the launch. The grid is ``(query blocks, kv heads)``: every
request's new tokens are cut into blocks of ``BLOCK_Q`` tokens, and one program computes one
query block for one KV head, i.e. for the ``BLOCK_Q x QUERIES_PER_KV`` query rows (GQA: the query
heads that share that KV head) that read the same keys::

    packed tokens   [ r0 chunk: 37 tokens            | r1 | r2 | r3 chunk: 12      ]
    query blocks    [ q0 q0 .. | q1 .. | q2 .. (5)   | q3 | q4 | q5 ..  | q6 (4)  ]   (BLOCK_Q = 8)
    program rows    BLOCK_M = BLOCK_Q * QUERIES_PER_KV  (token-major, then the heads of the group)

The number of query blocks depends on how the tokens fall into requests, so the grid is the upper
bound ``num_tokens // BLOCK_Q + num_seqs`` and each program finds its request by a binary search
over ``query_start`` (request ``i`` owns programs from ``query_start[i] // BLOCK_Q + i``); programs
past the end of their request return at once. The grid therefore depends only on the token and
request counts, which is what a CUDA graph needs.

Each program walks its request's keys in tiles of ``TILE`` positions, from the first key any of
its queries may see (sliding window) to its last query's own position (causal: a query at
absolute position p sees keys <= p, and only keys > p - window on sliding layers). Each key
position is looked up in the block table (``block_table[seq, pos // BLOCK_SIZE]``, offset
``pos % BLOCK_SIZE``), so the cache block size is independent of the tile size: any block size
works, powers of two or not. Softmax is the online (flash) form in fp32.

The cache is block-major (``common.engine.kv.kv_cache``): ``key(layer)`` is the strided view
``[num_blocks, block_size, kv_heads, head_dim]`` whose block stride skips the other layers; the
kernel takes its strides, so nothing is copied.

Tests run this kernel on CPU under Triton's interpreter (``TRITON_INTERPRET=1``). The kernels
are built on first use, so that variable only has to be set before the first launch.
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from common.engine.attention.interface import AttentionRequest, PagedMetadata
from common.engine.kv.kv_cache import KVCache


class TritonAttention:
    """Paged attention in Triton: the new K/V go to their slots (one kernel), then one launch
    attends every query of the packed batch over the cache in place (``paged_attention``)."""

    name = "triton"
    supports_cuda_graphs = True  # the launch grid depends only on token and request counts

    def __init__(self, windows: set[int | None], block_size: int):
        self.windows = windows
        self.block_size = block_size
        self.block_table = None  # the KV manager's persistent ``BlockTable`` (``Engine`` hands it over)

    def prepare(self, requests: list[AttentionRequest], device) -> PagedMetadata:
        return PagedMetadata.build(requests, self.block_size, device, self.block_table)

    def write_kv(self, k, v, cache: KVCache, layer: int, meta: PagedMetadata) -> None:
        """k, v: [T, KVH, D] for the new tokens, into their slots (``forward`` does this first)."""
        write_kv(k, v, cache.key(layer), cache.value(layer), meta.slots)

    def forward(self, q, k, v, cache: KVCache, layer: int, meta: PagedMetadata, window, scale) -> torch.Tensor:
        """q: [T, H, D]; k, v: [T, KVH, D] for the new tokens.  Returns [T, H, D]."""
        key_cache, value_cache = cache.key(layer), cache.value(layer)
        self.write_kv(k, v, cache, layer, meta)
        return paged_attention(q, key_cache, value_cache, torch.empty_like(q), meta.block_table, meta.seq_lens,
                               meta.query_start, meta.max_query_len, scale, window)


def _attention_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr,
    block_table_ptr, seq_lens_ptr, query_start_ptr,
    scale, window, num_seqs,
    stride_q_tok, stride_q_head, stride_o_tok, stride_o_head,
    stride_k_block, stride_k_tok, stride_k_head,
    stride_v_block, stride_v_tok, stride_v_head,
    stride_table,
    QUERIES_PER_KV: tl.constexpr,
    HEAD_DIM: tl.constexpr, HEAD_DIM_P: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr, TILE: tl.constexpr,
    SLIDING: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    program = tl.program_id(0)
    kv_head = tl.program_id(1)

    # Which request owns this query block: the last i with query_start[i] // BLOCK_Q + i <= program.
    lo: tl.int32 = 0
    hi = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        first_block = tl.load(query_start_ptr + mid) // BLOCK_Q + mid
        if first_block <= program:
            lo = mid + 1
        else:
            hi = mid
    seq = lo - 1
    q_start = tl.load(query_start_ptr + seq)
    q_len = tl.load(query_start_ptr + seq + 1) - q_start
    q_block = program - (q_start // BLOCK_Q + seq)
    if q_block * BLOCK_Q < q_len:
        context_len = tl.load(seq_lens_ptr + seq)
        rows = tl.arange(0, BLOCK_M)
        q_tok = q_block * BLOCK_Q + rows // QUERIES_PER_KV  # token index inside the request's chunk
        head = kv_head * QUERIES_PER_KV + rows % QUERIES_PER_KV
        row_ok = (rows < BLOCK_Q * QUERIES_PER_KV) & (q_tok < q_len)
        q_pos = context_len - q_len + q_tok  # absolute position of each row's token
        dims = tl.arange(0, HEAD_DIM_P)
        dim_ok = dims < HEAD_DIM

        q_offsets = (q_start + q_tok)[:, None] * stride_q_tok + head[:, None] * stride_q_head + dims[None, :]
        query = tl.load(q_ptr + q_offsets, mask=row_ok[:, None] & dim_ok[None, :], other=0.0)

        last_tok = tl.minimum(q_len, (q_block + 1) * BLOCK_Q) - 1
        kv_end = context_len - q_len + last_tok + 1  # keys [.., kv_end) cover every row's causal range
        kv_begin = 0
        if SLIDING:
            first_pos = context_len - q_len + q_block * BLOCK_Q
            kv_begin = tl.maximum(first_pos - window + 1, 0) // TILE * TILE

        qk_scale = scale * 1.4426950408889634  # exp2 below: fold log2(e) into the scale
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, HEAD_DIM_P], tl.float32)
        table_row = block_table_ptr + seq.to(tl.int64) * stride_table
        for tile_start in range(kv_begin, kv_end, TILE):
            k_pos = tile_start + tl.arange(0, TILE)
            k_ok = k_pos < kv_end
            block = tl.load(table_row + k_pos // BLOCK_SIZE, mask=k_ok, other=0).to(tl.int64)
            slot = k_pos % BLOCK_SIZE
            k_offsets = block * stride_k_block + slot * stride_k_tok + kv_head * stride_k_head
            v_offsets = block * stride_v_block + slot * stride_v_tok + kv_head * stride_v_head
            keys = tl.load(k_cache_ptr + k_offsets[None, :] + dims[:, None],
                           mask=k_ok[None, :] & dim_ok[:, None], other=0.0)  # [HEAD_DIM_P, TILE]
            values = tl.load(v_cache_ptr + v_offsets[:, None] + dims[None, :],
                             mask=k_ok[:, None] & dim_ok[None, :], other=0.0)  # [TILE, HEAD_DIM_P]

            keys = keys.to(query.dtype)  # a cache in another dtype (--kv-cache-dtype): computed in q's
            values = values.to(query.dtype)
            scores = tl.dot(query, keys, input_precision=DOT_PRECISION) * qk_scale
            visible = (k_pos[None, :] <= q_pos[:, None]) & k_ok[None, :]
            if SLIDING:
                visible = visible & (k_pos[None, :] > q_pos[:, None] - window)
            scores = tl.where(visible, scores, float("-inf"))

            m_new = tl.maximum(m_i, tl.max(scores, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows that see nothing yet
            p = tl.exp2(scores - m_safe[:, None])
            alpha = tl.exp2(m_i - m_safe)
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None] + tl.dot(p.to(values.dtype), values, input_precision=DOT_PRECISION)
            m_i = m_new

        l_i = tl.where(l_i == 0.0, 1.0, l_i)  # rows past the chunk (masked out of the store)
        result = acc / l_i[:, None]
        o_offsets = (q_start + q_tok)[:, None] * stride_o_tok + head[:, None] * stride_o_head + dims[None, :]
        tl.store(out_ptr + o_offsets, result.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & dim_ok[None, :])


def _write_kv_kernel(
    k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slots_ptr,
    stride_k_tok, stride_k_head, stride_v_tok, stride_v_head,
    stride_kc_block, stride_kc_tok, stride_kc_head,
    stride_vc_block, stride_vc_tok, stride_vc_head,
    NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_P: tl.constexpr,
    HEADS_P: tl.constexpr, BLOCK_SIZE: tl.constexpr,
):
    """One program per new token: copy its K and V (every KV head) into its cache slot.
    A negative slot is a padding row (CUDA-graph batches) and writes nothing."""
    token = tl.program_id(0)
    slot = tl.load(slots_ptr + token)
    if slot >= 0:
        block = (slot // BLOCK_SIZE).to(tl.int64)
        offset = slot % BLOCK_SIZE
        heads = tl.arange(0, HEADS_P)
        dims = tl.arange(0, HEAD_DIM_P)
        ok = (heads[:, None] < NUM_KV_HEADS) & (dims[None, :] < HEAD_DIM)
        key = tl.load(k_ptr + token * stride_k_tok + heads[:, None] * stride_k_head + dims[None, :], mask=ok)
        value = tl.load(v_ptr + token * stride_v_tok + heads[:, None] * stride_v_head + dims[None, :], mask=ok)
        k_dst = block * stride_kc_block + offset * stride_kc_tok + heads[:, None] * stride_kc_head + dims[None, :]
        v_dst = block * stride_vc_block + offset * stride_vc_tok + heads[:, None] * stride_vc_head + dims[None, :]
        tl.store(k_cache_ptr + k_dst, key, mask=ok)
        tl.store(v_cache_ptr + v_dst, value, mask=ok)


@functools.cache
def _kernels():
    """The jitted kernels, built on first use: ``triton.jit`` reads ``TRITON_INTERPRET`` when it
    wraps a function, so a test (or ``gpu_check --cpu-interpret``) can set it after import."""
    return triton.jit(_attention_kernel), triton.jit(_write_kv_kernel)


def _pow2(n: int, at_least: int = 1) -> int:
    return max(at_least, 1 << max(n - 1, 0).bit_length())


def launch_config(queries_per_kv: int, head_dim: int, max_query_len: int) -> tuple[int, int, int]:
    """``(BLOCK_M, BLOCK_Q, TILE)`` for a launch.

    Decode-only launches need only ``QUERIES_PER_KV`` rows per program (16 is ``tl.dot``'s
    minimum); launches with prompt chunks take more query tokens per program so each key tile
    loaded serves more rows. Head dims above 128 (Gemma 3: 256) get smaller tiles to stay in
    registers."""
    wide = _pow2(head_dim, 16) > 128
    block_m = 16 if max_query_len <= 1 else (32 if wide else 64)
    block_m = max(block_m, _pow2(queries_per_kv, 16))
    return block_m, block_m // queries_per_kv, 32 if wide else 64


def paged_attention(
    q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, out: torch.Tensor,
    block_table: torch.Tensor, seq_lens: torch.Tensor, query_start: torch.Tensor, max_query_len: int,
    scale: float, window: int | None,
) -> torch.Tensor:
    """Attention of the packed queries over the paged cache, written into ``out``.

    q, out: ``[num_tokens, heads, head_dim]``; key_cache, value_cache: ``[num_blocks, block_size,
    kv_heads, head_dim]`` (strided views are fine; the last dim must be contiguous);
    block_table: int32 ``[num_seqs, max_blocks]``; seq_lens: int32 ``[num_seqs]``, keys per request
    after this step (0 for a padding row: its output is zeros); query_start: int32
    ``[num_seqs + 1]``, where each request's tokens start in the packed batch; ``max_query_len``
    (a host int) only picks the launch shape.
    """
    attention_kernel, _ = _kernels()
    num_tokens, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = key_cache.shape
    assert num_heads % num_kv_heads == 0, f"{num_heads} query heads do not group over {num_kv_heads} KV heads"
    assert q.stride(-1) == out.stride(-1) == key_cache.stride(-1) == value_cache.stride(-1) == 1, \
        "attention tensors need a contiguous head dim"
    queries_per_kv = num_heads // num_kv_heads
    block_m, block_q, tile = launch_config(queries_per_kv, head_dim, max_query_len)
    num_seqs = seq_lens.shape[0]
    grid = (num_tokens // block_q + num_seqs, num_kv_heads)
    attention_kernel[grid](
        q, key_cache, value_cache, out,
        block_table, seq_lens, query_start,
        scale, window or 0, num_seqs,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        value_cache.stride(0), value_cache.stride(1), value_cache.stride(2),
        block_table.stride(0),
        QUERIES_PER_KV=queries_per_kv,
        HEAD_DIM=head_dim, HEAD_DIM_P=_pow2(head_dim, 16),
        BLOCK_SIZE=block_size, BLOCK_Q=block_q, BLOCK_M=block_m, TILE=tile,
        SLIDING=window is not None,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
    )
    return out


def write_kv(k: torch.Tensor, v: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
             slots: torch.Tensor) -> None:
    """Store the new tokens' K/V (``[num_tokens, kv_heads, head_dim]``) at their flat cache slots
    (``block_id * block_size + offset``, int64; negative: skip), rounded to the cache's dtype where
    it differs (by torch, to nearest even, as every backend rounds them)."""
    _, write_kernel = _kernels()
    num_tokens, num_kv_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    k, v = k.to(key_cache.dtype), v.to(value_cache.dtype)
    assert k.stride(-1) == v.stride(-1) == 1, "K/V need a contiguous head dim"
    write_kernel[(num_tokens,)](
        k, v, key_cache, value_cache, slots,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        value_cache.stride(0), value_cache.stride(1), value_cache.stride(2),
        NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim, HEAD_DIM_P=_pow2(head_dim),
        HEADS_P=_pow2(num_kv_heads), BLOCK_SIZE=key_cache.shape[1],
    )
