"""Tokens from an fp32 LM head without computing every logit in fp32: ``csrc/greedy_screen_cpu.c``.

A step whose rows all take their argmax (greedy, no penalties, logit rules or logprobs) or sample
softmax(logits / T) plainly (``sampler.screen_inverse_temperatures``) needs each row's token, not
the logits.  For an argmax, the kernel
computes all of them approximately from a bf16 copy of the head, with a proven bound on each one's
distance from its fp32 value, then in fp32 only the panels of 16 rows that can still hold the
maximum (a few per token) -- on the head's fp32 panels, in ``panel_gemm``'s order, so the token is
the one the full fp32 product gives (the kernel's comment has the bound).  For a sample, the same
bounds give each panel an upper bound on its share of the softmax: the kernel proposes a panel by
those, computes its 16 logits in fp32 and accepts with the ratio of its true share to the bound
(rejection sampling, so the token is distributed as softmax of the fp32 logits), then draws the row.

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


@functools.cache  # looked up once: it is called on every screened step
def _screen_fn():
    return kernel_function("greedy_screen_cpu", "screen_tokens",
                           [_PTR, _I64, _I64, _PTR, _PTR, _PTR, _PTR, _I64, _I64, _PTR, _PTR, _PTR, _PTR, _INT], _I64)


@functools.cache
def uniforms_per_row() -> int:
    """The uniform numbers ``GreedyHead.sample`` takes for each row (the kernel's trials, 3 each)."""
    return kernel_function("greedy_screen_cpu", "screen_sample_uniforms", [], _I64)()


class GreedyHead:
    """An fp32 LM head's panels with the bf16 copy and row norms the screen needs.

    ``exact_rows`` counts the rows computed in fp32 so far (the candidates), ``fallbacks`` the
    calls that returned ``None`` (a row of the input or a greedy candidate's logit not finite);
    ``sampled_rows`` and ``sample_trials`` the sampled rows ``sample`` was given and the
    rejection-sampling trials they took, ``undecided_rows`` those it left to the caller.
    """

    def __init__(self, panels: PanelWeight, pairs: torch.Tensor, norm: torch.Tensor, residual: torch.Tensor):
        self.panels = panels
        self.pairs = pairs
        self.norm = norm
        self.residual = residual
        self.exact_rows = 0
        self.fallbacks = 0
        self.sampled_rows = 0
        self.sample_trials = 0
        self.undecided_rows = 0
        # Calls with more rows than this gain nothing on this CPU (the kernel's greedy_screen_max_tokens)
        self.max_rows = kernel_function("greedy_screen_cpu", "greedy_screen_max_tokens", [], _I64)()

    @classmethod
    def build(cls, panels: PanelWeight | None) -> "GreedyHead | None":
        """From the head's fp32 panels; ``None`` where the screen does not apply (no panels, no
        vector code for this CPU, or a weight that is not finite in fp32 or bf16)."""
        if panels is None or panels.dtype != torch.float32 or not _native():
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
        return self._tokens(x, None)

    def sample(self, x: torch.Tensor, inv_temperature: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor | None:
        """For each row of ``x``: a sample of softmax(logits / T) where ``inv_temperature`` [rows]
        (1 / T, fp32) is > 0, the argmax where it is 0.  A sampled row takes its randomness from its
        row of ``uniforms`` [rows, ``uniforms_per_row()``] (fp64 in [0, 1)): rejection sampling
        against the screen's bounds, exact for the fp32 logits (the kernel's comment); -1 for a
        sampled row that no trial decided, which the caller samples from its logits (the draw stays
        exact).  ``None`` where the caller must compute every row's logits (as ``argmax``)."""
        rows = x.shape[0] if x.dim() == 2 else -1
        if inv_temperature.shape != (rows,) or inv_temperature.dtype != torch.float32:
            raise ValueError(f"greedy head: expected fp32 inverse temperatures [{rows}], got "
                             f"{inv_temperature.dtype} {list(inv_temperature.shape)}")
        if uniforms.shape != (rows, uniforms_per_row()) or uniforms.dtype != torch.float64:
            raise ValueError(f"greedy head: expected fp64 uniforms [{rows}, {uniforms_per_row()}], got "
                             f"{uniforms.dtype} {list(uniforms.shape)}")
        trials = torch.empty(rows, dtype=torch.int64)  # the kernel writes every row's
        tokens = self._tokens(x, (inv_temperature.contiguous(), uniforms.contiguous(), trials))
        if tokens is not None:
            self.sampled_rows += int((inv_temperature > 0).sum())
            self.undecided_rows += int((tokens < 0).sum())
            self.sample_trials += int(trials.sum())
        return tokens

    def _tokens(self, x: torch.Tensor, sampling: tuple[torch.Tensor, ...] | None) -> torch.Tensor | None:
        """The kernel's tokens; ``sampling``: (inverse temperatures, uniforms, trials out) or None."""
        if x.dim() != 2 or x.dtype != torch.float32 or x.shape[1] != self.panels.in_features:
            raise ValueError(f"greedy head: expected fp32 [rows, {self.panels.in_features}], got "
                             f"{x.dtype} {list(x.shape)}")
        if x.stride(1) != 1:
            x = x.contiguous()
        tokens = torch.empty(x.shape[0], dtype=torch.int64)
        if x.shape[0] == 0:
            return tokens
        inv_t, uniforms, trials = (t.data_ptr() for t in sampling) if sampling else (None, None, None)
        with profiled(PROFILER_LABEL):
            status = _screen_fn()(x.data_ptr(), x.stride(0), x.shape[0], self.panels.panels.data_ptr(),
                                  self.pairs.data_ptr(), self.norm.data_ptr(), self.residual.data_ptr(),
                                  self.panels.out_features, self.panels.in_features, inv_t, uniforms,
                                  trials, tokens.data_ptr(),
                                  torch.get_num_threads())
        if status == -1:
            raise MemoryError("greedy head: scratch allocation failed")
        if status < 0:
            self.fallbacks += 1
            return None
        self.exact_rows += status
        return tokens
