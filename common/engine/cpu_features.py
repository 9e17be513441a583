"""What this CPU's matrix units are, as torch probes them (cached: they do not change in a process)."""
from __future__ import annotations

import functools

import torch


def _probe(name: str) -> bool:
    fn = getattr(torch.cpu, name, None)  # a torch without the probe: say no
    return bool(fn is not None and fn())


@functools.cache
def has_amx() -> bool:
    """AMX tiles (Intel Sapphire Rapids and later): oneDNN's bf16 products run on them."""
    return _probe("_is_amx_tile_supported")


@functools.cache
def has_native_bf16() -> bool:
    """AVX512-BF16 or AMX: the CPUs where bf16 matmuls beat fp32 (oneDNN's bf16 kernels)."""
    return _probe("_is_avx512_bf16_supported") or has_amx()
