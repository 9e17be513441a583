"""Paged attention over the block-major KV cache.

    interface.py       the packed batch every backend sees, and its metadata (step_layout, PagedMetadata)
    selection.py       make_attention: the backend for a device, dtype and what is installed
    backend_cpu.py     a C kernel that reads the cache in place (csrc/paged_attention_cpu.c)
    backend_torch.py   pure torch: the reference, and the CPU fallback
    backend_triton.py  Triton: one launch over the whole packed batch (CUDA, or its CPU interpreter)
    backend_flash.py   flash-attn 2 over the paged cache (CUDA)
    check.py           a backend checked against the torch path on a set of batches
"""
