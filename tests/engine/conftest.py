"""Fixtures of the engine's tests."""
from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def cpu_kernel():
    """The CPU paged-attention kernel (``csrc/paged_attention_cpu.c``), built once; the test is
    skipped where it cannot be built."""
    from common.engine.attention import backend_cpu

    kernel = backend_cpu.build_kernel()
    if kernel is None:
        pytest.skip("no C compiler: the CPU kernel cannot be built")
    return kernel
