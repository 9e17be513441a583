"""What a decode worker streams of a request's outputs (decode_svc/generate.py ``stream_outputs``): an
output whose request ended with an error naming why (its grammar failed mid-generation) goes out as
that error -- after the tokens before it, without the token its grammar refused -- and the handler
answers it as the client's error ("invalid": a 400 before the stream started, an error frame after)."""
from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

import pytest

from common.cluster.messages import TokenFrame, decode
from common.engine.engine import RequestOutput
from decode_svc import generate


def frames_of(data: bytes) -> list[TokenFrame]:
    frames = []
    while data:
        length = int.from_bytes(data[:4], "big")
        frames.append(decode(data[4:4 + length], TokenFrame))
        data = data[4 + length:]
    return frames


class Written:
    def __init__(self):
        self.data = b""

    async def write(self, data: bytes) -> None:
        self.data += data


def output(tokens: list[int], error: str | None = None) -> RequestOutput:
    return RequestOutput("r", tokens, finished=error is not None, finish_reason="error" if error else None,
                         num_prompt_tokens=3, num_cached_tokens=0, num_output_tokens=len(tokens), error=error)


async def test_an_output_whose_grammar_failed_goes_out_as_its_error_after_the_tokens_before_it():
    stream = asyncio.Queue()
    for item in (output([5]), output([6]), output([9], error="structured_outputs: the grammar could not be followed")):
        stream.put_nowait(item)
    response = Written()
    context = SimpleNamespace(ttft=SimpleNamespace(add=lambda s: None), tpot=SimpleNamespace(add=lambda s: None))
    opened = generate.OpenStream(SimpleNamespace(inc=lambda: None, dec=lambda: None))
    with pytest.raises(ValueError, match="^structured_outputs: the grammar could not be followed"):
        await generate.stream_outputs(context, stream, response, time.monotonic(), opened, fallback=False)
    frames = frames_of(response.data)
    assert [f.token_ids for f in frames] == [[5], [6]] and not any(f.finished for f in frames)
