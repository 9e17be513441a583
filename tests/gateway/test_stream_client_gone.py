"""A client that leaves mid-stream, seen by a write before aiohttp has cancelled the handler (a
race: the write finds the transport closing): the stream ends counted ``client_disconnected``, not
as an error with a traceback in the log (``ClientConnectionResetError`` escaped the handler)."""
from __future__ import annotations

import types

from aiohttp import web
from aiohttp.test_utils import make_mocked_request

from gateway.handlers import OpenAIHandlers


class LeavingClient:
    """A stream's events; the connection resets at the second write."""

    def opening(self) -> bytes:
        return b"data: first\n\n"

    def batch(self, _gen, _batch) -> bytes:
        return b"data: more\n\n"

    async def keep(self) -> None:
        pass

    def closing(self) -> bytes:
        return b"data: [DONE]\n\n"

    def failure(self, _error) -> bytes:
        return b"data: error\n\n"


async def test_a_reset_while_streaming_ends_the_stream_as_the_client_leaving(monkeypatch):
    writes = []

    async def write(self, data: bytes) -> None:
        writes.append(data)
        if len(writes) == 2:
            raise ConnectionResetError("Cannot write to closing transport")

    monkeypatch.setattr(web.StreamResponse, "write", write)
    handlers = OpenAIHandlers.__new__(OpenAIHandlers)
    handlers.services = types.SimpleNamespace(config=types.SimpleNamespace(client_write_timeout=30.0))
    request = make_mocked_request("POST", "/v1/completions")

    async def frames():
        for _ in range(3):
            yield None, [("x", None)]

    gen = types.SimpleNamespace(request_id="r1")
    response = await handlers._stream(request, [gen], frames(), [("x", None)], LeavingClient())
    assert isinstance(response, web.StreamResponse)
    assert request["outcome"] == "client_disconnected"
    assert len(writes) == 2  # nothing written after the reset
