"""KV memory: the paged cache and who holds which of its blocks.

    block_pool.py        fixed-size blocks, reference counts, an LRU of cached free blocks
    prefix_hash.py       chained hashes of full blocks (the prefix cache's keys, shared with Redis)
    kv_cache_manager.py  each request's blocks: prefix lookup, growth, commit, pins, release
    block_table.py       every request's block ids in one persistent int32 table
    kv_cache.py          the cache tensors, block-major (one block of every layer is one region)
    host_memory.py       host memory for the cache, on transparent huge pages where allowed
"""
