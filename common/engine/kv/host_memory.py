"""Host memory for the KV cache, backed by transparent huge pages where the kernel allows (Linux).

KV blocks move between two processes on one host through CMA (UCX's shared-memory path reads
the sender's cache with ``process_vm_readv``), which pins every page of the region for each
transfer. With 4 KiB pages that costs about as much CPU as the copy itself: CMA then reaches
~0.55x memcpy; with 2 MiB pages it pins 512x fewer and reaches ~0.9x (measured on 64 MiB, see
``benchmarks/kv_transfer.py``). Attention reading the cache also takes fewer TLB misses.

The default THP mode of most distributions is ``madvise``: only regions that ask get huge pages,
and torch's allocator does not ask. So the region is over-allocated by 2 MiB, aligned, advised
(``MADV_HUGEPAGE``) and only then touched. Where that is not possible (another OS, THP off, a
small region) it is ordinary memory: a performance hint, never a requirement.
"""
from __future__ import annotations

import ctypes
import logging
import math
import sys

import torch

log = logging.getLogger(__name__)

HUGE_PAGE_BYTES = 2 << 20
_MADV_HUGEPAGE = 14


def _advise_huge_pages(address: int, nbytes: int) -> bool:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.madvise(ctypes.c_void_p(address), ctypes.c_size_t(nbytes), _MADV_HUGEPAGE) == 0
    except (OSError, AttributeError):
        return False


def huge_page_zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zeroed, contiguous CPU tensor whose memory is advised for transparent huge pages."""
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if nbytes < HUGE_PAGE_BYTES or not sys.platform.startswith("linux"):
        return torch.zeros(shape, dtype=dtype)
    raw = torch.empty(nbytes + HUGE_PAGE_BYTES, dtype=torch.uint8)
    offset = -raw.data_ptr() % HUGE_PAGE_BYTES
    region = raw[offset : offset + nbytes]
    if not _advise_huge_pages(region.data_ptr(), nbytes):
        log.debug("madvise(MADV_HUGEPAGE) refused; the KV cache uses ordinary pages")
    return region.view(dtype).view(shape).zero_()  # first touch: huge pages where granted
