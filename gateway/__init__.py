"""The gateway process: the OpenAI-compatible HTTP API, tokenizing, routing to the pools,
backpressure, streaming back, metrics.  ``python -m gateway``."""
