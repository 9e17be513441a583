"""A step's grammar masks: each constrained row's allowed tokens, applied to the logits at once.

Rows fill their bitmask words (the backend, in C, rows in parallel where it can, and ahead of the
sampler: ``prefetch`` starts it before the step's forward, which runs meanwhile).  The masks are then
applied in place by a C kernel (csrc/token_bitmask_cpu.c: one pass over each row's words, a word
of 32 allowed tokens skipped at once); without a compiler, or off the CPU, each row touches few
tokens one by one: a row that allows few (a key, a literal) is set to -inf but for those; a row that
allows most (inside a string) has its few forbidden set to -inf.
Where a row's grammar lets the output end (its EOS bit is set), every stop token of the request is
allowed too (a chat model ends its turn with its own end-of-turn token, not the tokenizer's EOS).
"""
from __future__ import annotations

import concurrent.futures
import ctypes
from typing import Sequence

import numpy as np
import torch

from common.engine.structured.backend import GrammarMatcher, bitmask_words


def fill_bitmasks(matchers: Sequence[GrammarMatcher], words: torch.Tensor) -> None:
    """Row ``i`` of ``words``: what ``matchers[i]`` allows next (all rows at once, in parallel,
    where the backend can: ``fill_many``)."""
    words.fill_(0)
    kinds = {type(m) for m in matchers}
    if len(kinds) == 1 and hasattr(next(iter(kinds)), "fill_many"):
        next(iter(kinds)).fill_many(matchers, words)
        return
    for i, matcher in enumerate(matchers):
        matcher.fill_bitmask(words, i)


class TokenMasks:
    """Bitmask storage, and the step's masks filled ahead: ``prefetch`` (before the forward, from
    the matchers' state after the last token) fills them in a thread while the model runs;
    ``apply`` takes them if the matchers are the same, else fills them itself."""

    def __init__(self) -> None:
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._ahead: tuple[tuple[int, ...], concurrent.futures.Future, torch.Tensor] | None = None

    def prefetch(self, matchers: Sequence[GrammarMatcher], vocab: int) -> None:
        if self._pool is None:
            self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="grammar-mask")
        words = torch.empty(len(matchers), bitmask_words(vocab), dtype=torch.int32)
        self._ahead = (tuple(map(id, matchers)), self._pool.submit(fill_bitmasks, list(matchers), words), words)

    def _filled(self, matchers: Sequence[GrammarMatcher], vocab: int) -> torch.Tensor:
        ahead, self._ahead = self._ahead, None
        if ahead is not None:
            ids, future, words = ahead
            future.result()  # the fill must be over before its matchers may move, whatever happens
            if ids == tuple(map(id, matchers)) and words.shape[1] == bitmask_words(vocab):
                return words
        words = torch.empty(len(matchers), bitmask_words(vocab), dtype=torch.int32)
        fill_bitmasks(matchers, words)
        return words

    def apply(self, logits: torch.Tensor, rows: Sequence[int], matchers: Sequence[GrammarMatcher],
              stop_token_ids: Sequence[Sequence[int]], holding: Sequence[bool] = ()) -> None:
        """Mask ``logits[rows[i]]`` (in place) to what ``matchers[i]`` allows next.

        ``stop_token_ids[i]``: the request's stop tokens.  Where the grammar lets the output end
        (``may_end``), all of them are allowed; where ``holding[i]`` (``min_tokens`` not reached
        yet) none is, unless the grammar allows nothing else (it is complete: ending early beats an
        empty row).  Elsewhere a stop token is allowed only where the grammar takes it as text (a
        user's stop token inside a string), and it alone."""
        vocab = logits.shape[1]
        packed = self._filled(matchers, vocab).numpy()
        for i, stops in enumerate(stop_token_ids):
            inside = [t for t in stops if t < vocab]
            if not inside:
                continue
            set_bits = [t for t in inside if packed[i, t >> 5] >> (t & 31) & 1]
            if holding and holding[i] and len(set_bits) < np.bitwise_count(packed[i].view(np.uint32)).sum():
                for t in set_bits:
                    packed[i, t >> 5] &= ~_bit(t)
            elif set_bits and matchers[i].may_end():
                for t in inside:  # the output may end: any of its stop tokens ends it
                    packed[i, t >> 5] |= _bit(t)
        kernel = _kernel(logits)
        if kernel is not None:
            index = torch.tensor(list(rows), dtype=torch.int64)
            kernel(ctypes.c_void_p(logits.data_ptr()), logits.stride(0), vocab, ctypes.c_void_p(packed.ctypes.data),
                   packed.shape[1], ctypes.c_void_p(index.data_ptr()), len(rows))
            return
        words = packed.view(np.uint32)
        allowed_counts = np.bitwise_count(words).sum(axis=1)
        for i, row in enumerate(rows):
            target = logits[row]
            if allowed_counts[i] * 2 <= vocab:
                # Few tokens allowed (a key, a literal, a digit): keep theirs, the rest -inf.
                keep = torch.from_numpy(_bit_ids(words[i], vocab)).to(target.device)
                kept = target.index_select(0, keep)
                target.fill_(float("-inf"))
                target.index_copy_(0, keep, kept)
            else:  # most allowed (inside a string): mask the few forbidden
                forbidden = torch.from_numpy(_bit_ids(~words[i], vocab)).to(target.device)
                target.index_fill_(0, forbidden, float("-inf"))


def _kernel(logits: torch.Tensor):
    """The compiled mask kernel (csrc/token_bitmask_cpu.c) for contiguous CPU fp32 rows, else None."""
    if logits.device.type != "cpu" or logits.dtype != torch.float32 or logits.stride(1) != 1:
        return None
    from common.engine.cpu_kernels import kernel_function

    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    return kernel_function("token_bitmask_cpu", "apply_token_bitmask", [ptr, i64, i64, ptr, i64, ptr, i64])


_BITS = np.arange(32, dtype=np.uint32)


def _bit(token_id: int) -> np.int32:
    """Token ``token_id``'s bit in its int32 word."""
    return np.uint32(1 << (token_id & 31)).view(np.int32)


def _bit_ids(words: np.ndarray, vocab: int) -> np.ndarray:
    """The positions of the set bits of ``words`` (uint32, bit ``i % 32`` of word ``i // 32``) below ``vocab``."""
    nonzero = np.flatnonzero(words)
    word, bit = np.nonzero((words[nonzero, None] >> _BITS) & 1)
    ids = nonzero[word].astype(np.int64) * 32 + bit
    return ids[ids < vocab]
