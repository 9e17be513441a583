"""The prefill worker: chunked prefill, ships KV blocks to the decode worker, returns the first token."""
