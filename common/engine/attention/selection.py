"""Which attention backend a model runs with: ``make_attention("auto" | "cpu" | "torch" | "triton" |
"flash", ...)``, from the device, the dtype and what is installed."""
from __future__ import annotations

import os

import torch

from common.engine.attention.backend_torch import TorchAttention
from common.engine.attention.interface import flash_pages


def triton_available(device: torch.device) -> bool:
    """Triton runs on CUDA, or anywhere under its CPU interpreter (``TRITON_INTERPRET=1``, tests)."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"


def make_attention(backend: str, device: torch.device, windows: set[int | None], block_size: int,
                   dtype: torch.dtype = torch.float32, kv_dtype: torch.dtype | None = None):
    """``auto``: on CUDA flash-attn when it is installed, the block size suits its paged KV and
    the cache is in the model's dtype (``kv_dtype``; None: the same), else Triton (but over an fp8
    cache: the torch path); on CPU the C kernel that reads the cache in place (``backend_cpu``) where
    it builds and supports both dtypes, else the torch path."""
    device = torch.device(device)
    kv_dtype = dtype if kv_dtype is None else kv_dtype
    fp8_cache = kv_dtype == torch.float8_e4m3fn
    if backend == "auto":
        backend = "torch"
        if device.type == "cuda":
            flash = flash_attn_installed() and flash_pages(block_size) and kv_dtype == dtype
            backend = "flash" if flash else "torch" if fp8_cache else "triton"
        elif device.type == "cpu":
            from common.engine.attention import backend_cpu

            both = backend_cpu.supports(dtype) and backend_cpu.supports(kv_dtype)
            if both and backend_cpu.build_kernel() is not None:
                backend = "cpu"
    if backend == "flash":
        if device.type != "cuda":
            raise ValueError("attention_backend 'flash' needs a CUDA device")
        if kv_dtype != dtype:
            other = "the torch backend" if fp8_cache else "the triton backend"
            raise ValueError(f"attention_backend 'flash' needs the KV cache in the model's dtype ({dtype}), got "
                             f"{kv_dtype}: use kv_cache_dtype auto, or {other}")
        from common.engine.attention.backend_flash import FlashAttention

        return FlashAttention(windows, block_size)
    if backend == "triton":
        if fp8_cache:
            raise ValueError("attention_backend 'triton' does not read an fp8 KV cache: use the torch backend (or cpu)")
        if not triton_available(device):
            raise ValueError("attention_backend 'triton' needs the triton package and a CUDA device "
                             "(or TRITON_INTERPRET=1, Triton's CPU interpreter, for tests)")
        from common.engine.attention.backend_triton import TritonAttention

        return TritonAttention(windows, block_size)
    if backend == "cpu":
        from common.engine.attention import backend_cpu

        if device.type != "cpu" or not backend_cpu.supports(dtype) or not backend_cpu.supports(kv_dtype):
            raise ValueError(f"attention_backend 'cpu' needs a CPU device and float32 or bfloat16 (model; KV "
                             f"cache: those or fp8), got {device}, {dtype} and a {kv_dtype} cache")
        kernel = backend_cpu.build_kernel()
        if kernel is None:
            raise ValueError("attention_backend 'cpu': its kernel could not be built (no C compiler?); see the log")
        return backend_cpu.CpuPagedAttention(windows, block_size, kernel)
    return TorchAttention(windows, block_size)


def flash_attn_installed() -> bool:
    try:
        import flash_attn  # noqa: F401
    except ImportError:
        return False
    return True
