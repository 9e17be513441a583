"""Greedy tokens from an fp32 LM head without computing every logit in fp32: ``csrc/greedy_screen_cpu.c``.

A step whose rows all take their argmax (greedy, no penalties, logit rules or logprobs:
``sampler.argmax_suffices``) needs each row's first maximal logit, not the logits.  The kernel
computes all of them approximately from a bf16 copy of the head, with a proven bound on each one's
distance from its fp32 value, then in fp32 only the panels of 16 rows that can still hold the
maximum (a few per token) -- on the head's fp32 panels, in ``panel_gemm``'s order, so the token is
the one the full fp32 product gives (the kernel's comment has the bound).

The bf16 copy is half the fp32 head's size (Gemma 3 270M: +338 MB).  Only where the kernel has
vector code (AMX tiles, AVX-512 -- with AVX512-BF16 its dot products are the CPU's -- or AVX2 with
FMA) and the head is an fp32 one with panels; ``None`` elsewhere, and the caller computes the logits.
"""
from __future__ import annotations

import ctypes
import functools

import torch

from common.engine.cpu_kernels import kernel_function, profiled
from common.engine.models.panels import PanelWeight

PROFILER_LABEL = "greedy_screen"
_I64, _PTR, _INT = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int


def _native() -> bool:
    fn = kernel_function("greedy_screen_cpu", "greedy_screen_native", [], _INT)
    return fn is not None and fn() == 1


def screen_path(allow_amx: bool = True) -> str:
    """Which pass 1 the kernel runs from now on in this process: ``"amx"`` (tiles, where the CPU
    has them and Linux grants them), ``"avx512"``, ``"avx2"`` or ``"none"``; ``allow_amx=False``
    keeps AMX out (tests compare the two)."""
    fn = kernel_function("greedy_screen_cpu", "greedy_screen_path", [_INT], _INT)
    return ("none", "avx512", "amx", "avx2")[fn(int(allow_amx)) if fn is not None else 0]


def _pack_fn():
    return kernel_function("greedy_screen_cpu", "greedy_screen_pack", [_PTR, _I64, _I64, _PTR, _PTR, _PTR, _INT], _I64)


@functools.cache  # looked up once: it is called on every greedy step
def _screen_fn():
    return kernel_function("greedy_screen_cpu", "greedy_screen",
                           [_PTR, _I64, _I64, _PTR, _PTR, _PTR, _PTR, _I64, _I64, _PTR, _INT], _I64)


class GreedyHead:
    """An fp32 LM head's panels with the bf16 copy and row norms the screen needs.

    ``exact_rows`` counts the rows computed in fp32 so far (the candidates), ``fallbacks`` the
    calls that returned ``None`` (a row of the input or a candidate's logit not finite).
    """

    def __init__(self, panels: PanelWeight, pairs: torch.Tensor, norm: torch.Tensor, residual: torch.Tensor):
        self.panels = panels
        self.pairs = pairs
        self.norm = norm
        self.residual = residual
        self.exact_rows = 0
        self.fallbacks = 0

    @classmethod
    def build(cls, panels: PanelWeight | None) -> "GreedyHead | None":
        """From the head's fp32 panels; ``None`` where the screen does not apply (no panels, no
        vector code for this CPU, or a weight that is not finite in fp32 or bf16)."""
        if panels is None or not _native():
            return None
        rows, width = panels.out_features, panels.in_features
        pair_elems = kernel_function("greedy_screen_cpu", "greedy_screen_pair_elems", [_I64, _I64], _I64)
        row_slots = kernel_function("greedy_screen_cpu", "greedy_screen_row_slots", [_I64], _I64)
        pairs = torch.empty(pair_elems(rows, width), dtype=torch.int16)  # the kernel's padding
        norm = torch.empty(row_slots(rows), dtype=torch.float32)
        residual = torch.empty(row_slots(rows), dtype=torch.float32)
        bad = _pack_fn()(panels.panels.data_ptr(), rows, width, pairs.data_ptr(), norm.data_ptr(),
                         residual.data_ptr(), torch.get_num_threads())
        return cls(panels, pairs, norm, residual) if bad == 0 else None

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.pairs, self.norm, self.residual))

    def argmax(self, x: torch.Tensor) -> torch.Tensor | None:
        """For each row of ``x`` [rows, in_features] (fp32): the first index of its largest logit,
        as ``(x @ W.T).max(dim=-1)`` with the fp32 panels' product gives it; ``None`` where a row
        of ``x`` or a candidate logit is not finite (the caller then computes the logits)."""
        if x.dim() != 2 or x.dtype != torch.float32 or x.shape[1] != self.panels.in_features:
            raise ValueError(f"greedy head: expected fp32 [rows, {self.panels.in_features}], got "
                             f"{x.dtype} {list(x.shape)}")
        if x.stride(1) != 1:
            x = x.contiguous()
        tokens = torch.empty(x.shape[0], dtype=torch.int64)
        if x.shape[0] == 0:
            return tokens
        with profiled(PROFILER_LABEL):
            status = _screen_fn()(x.data_ptr(), x.stride(0), x.shape[0], self.panels.panels.data_ptr(),
                                  self.pairs.data_ptr(), self.norm.data_ptr(), self.residual.data_ptr(),
                                  self.panels.out_features, self.panels.in_features, tokens.data_ptr(),
                                  torch.get_num_threads())
        if status == -1:
            raise MemoryError("greedy head: scratch allocation failed")
        if status < 0:
            self.fallbacks += 1
            return None
        self.exact_rows += status
        return tokens
