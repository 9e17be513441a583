"""FrameReader: every complete frame that has arrived comes out in one batch, a partial one waits
for the rest, and a hostile header never makes it buffer more than a frame (aiohttp's real
StreamReader, fed by hand)."""
import asyncio
from unittest import mock

import pytest
from aiohttp import StreamReader

from common.cluster.messages import MAX_FRAME_BYTES, FrameReader, TokenFrame, frame


def reader() -> StreamReader:
    protocol = mock.Mock(_reading_paused=False)
    return StreamReader(protocol, limit=2**16, loop=asyncio.get_running_loop())


async def test_frames_that_arrived_together_come_out_together():
    stream = reader()
    frames = FrameReader(stream, TokenFrame)
    data = frame(TokenFrame(token_ids=[1])) + frame(TokenFrame(token_ids=[2])) + frame(TokenFrame(token_ids=[3]))
    stream.feed_data(data[:-3])  # the third frame is cut: it waits for its tail
    assert [f.token_ids for f in await frames.next_batch()] == [[1], [2]]
    pending = asyncio.ensure_future(frames.next_batch())
    await asyncio.sleep(0)
    assert not pending.done()
    stream.feed_data(data[-3:] + frame(TokenFrame(token_ids=[4], finished=True)))
    batch = await pending
    assert [f.token_ids for f in batch] == [[3], [4]] and batch[-1].finished
    stream.feed_eof()
    assert await frames.next_batch() == []


async def test_cut_inside_a_frame_is_a_connection_error():
    stream = reader()
    frames = FrameReader(stream, TokenFrame)
    stream.feed_data(frame(TokenFrame(token_ids=[1]))[:5])
    stream.feed_eof()
    with pytest.raises(ConnectionError):
        await frames.next_batch()


async def test_oversized_header_is_refused_before_buffering():
    stream = reader()
    frames = FrameReader(stream, TokenFrame)
    stream.feed_data((MAX_FRAME_BYTES + 1).to_bytes(4, "big") + b"x" * 16)
    with pytest.raises(ValueError, match="exceeds"):
        await frames.next_batch()
