"""The gateway: OpenAI-compatible HTTP API, routing, streaming, metrics."""
