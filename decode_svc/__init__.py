"""The decode worker: reserves blocks, receives KV from the prefill pool, decodes in continuous batches."""
