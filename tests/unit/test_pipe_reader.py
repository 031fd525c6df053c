"""The reading end of a generator pipe (serving.stub.pipe_reader) without Triton: one watch for all its
streams fails a stream the generator marked lost and one that waited past the BLS timeout, each once,
and leaves a stream with something to read alone; a pipe that ends fails its own streams only, and the
next stream opens a new one. The pipe end to end: tests/unit/test_models_in_process.py."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from engine.protocol import LATENT_DIM, UNAVAILABLE, Chunk, StreamFailed
from serving.flow.receipts import Receipts
from serving.flow.side_channel import SideChannel
from serving.stub import pipe_reader
from serving.stub.pipe_reader import Inbox, PipeReader


class FakeBLS:
    timeout = 0.5  # seconds a stream may wait for its next chunk


def reader(tmp_path) -> PipeReader:
    return PipeReader(FakeBLS(), SideChannel(tmp_path), "generator", Receipts(tmp_path, "tts"), lambda: 7)


def test_one_watch_fails_lost_and_silent_streams_and_leaves_the_others(tmp_path, monkeypatch):
    monkeypatch.setattr(pipe_reader, "WATCH_SECONDS", 0.05)

    async def main():
        r = reader(tmp_path)
        lost, silent, served = Inbox(), Inbox(), Inbox()
        r.inboxes = {1: (9, lost), 2: (9, silent), 3: (9, served)}
        r.watcher = asyncio.get_running_loop().call_later(pipe_reader.WATCH_SECONDS, r._watch)
        r.channel.mark("lost", 1)
        waits = [asyncio.ensure_future(i.get()) for i in (lost, silent)]
        served.put("a chunk")
        with pytest.raises(StreamFailed, match="lost this stream"):
            await asyncio.wait_for(waits[0], 0.4)  # within a few watches, well before the timeout
        assert not waits[1].done()
        with pytest.raises(TimeoutError, match=f"^{UNAVAILABLE}generator sent nothing for 0 s"):
            await asyncio.wait_for(waits[1], 2)
        assert not r.channel.take("lost", 1)  # the mark was taken
        assert await served.get() == "a chunk" and not served.items  # failed nothing while not waiting
        assert not r.watcher.cancelled()  # it goes on looking
        r.watcher.cancel()

    asyncio.run(main())


def test_a_pipe_that_ends_fails_its_own_streams_only(tmp_path):
    async def main():
        r = reader(tmp_path)
        r.pipe_id = 9
        old, new = Inbox(), Inbox()
        r.inboxes = {1: (8, old), 2: (9, new)}
        r.riding = {8: {1}, 9: {2}}  # neither pipe has carried its stream's last chunk yet
        r._ended(8, object(), "the generator restarted")  # an older pipe's end
        assert r.pipe_id == 9 and not new.items
        with pytest.raises(StreamFailed, match="pipe ended .the generator restarted.; retry"):
            await old.get()
        r._ended(9, object(), "gone")
        assert r.pipe_id == 0  # the next stream opens a new one
        with pytest.raises(StreamFailed):
            await new.get()

    asyncio.run(main())


def test_a_worn_pipe_is_rotated_and_ended_once_its_own_streams_left(tmp_path, monkeypatch):
    """T25: past ROTATE_BYTES (or ROTATE_RESPONSES) new streams go on a new pipe; the old one carries its
    own streams on and is ended (a cancel mark for the generator) once it carried the last chunk of the
    last of them or they left, whether or not their readers have read it all; at most
    MAX_DRAINING old pipes wait at once, past which the open pipe carries on."""
    monkeypatch.setattr(pipe_reader, "MAX_DRAINING", 2)

    async def main():
        r = reader(tmp_path)
        ids = iter(range(10, 100))

        async def fake_open():
            r.pipe_id = next(ids)
            r.carried[r.pipe_id] = [0, 0]

        r._open = fake_open
        a, _ = await r.join(1)
        b, _ = await r.join(2)
        assert a == b == 10
        r.carried[10][0] = pipe_reader.ROTATE_BYTES  # worn by its tensors
        c, _ = await r.join(3)
        assert c == 11 and r.draining == {10}
        r.leave(1)
        assert 10 not in r.channel.poll()["cancel"]  # stream 2 is still on it
        r._deliver([Chunk(2, np.zeros((4, LATENT_DIM), np.float32), np.zeros((0, LATENT_DIM), np.float32), last=True)])
        assert 10 in r.channel.poll()["cancel"] and not r.draining  # it carried stream 2's last chunk: ended
        assert 2 in r.inboxes  # stream 2's reader has yet to read it: that holds no pipe
        r._ended(10, object(), "its reader closed it")
        assert len(r.inboxes[2][1].items) == 1  # its last chunk alone: a stream carried to its end is not failed
        r.leave(2)
        r.draining = {10}  # as if it had not ended yet
        r.carried[11][1] = pipe_reader.ROTATE_RESPONSES  # worn by its responses, no stream left on it
        r.leave(3)
        d, _ = await r.join(4)
        assert d == 12 and 11 in r.channel.poll()["cancel"] and r.draining == {10}  # ended at once: nobody on it
        r.draining = {10, 11}
        r.carried[12][0] = pipe_reader.ROTATE_BYTES
        e, _ = await r.join(5)
        assert e == 12  # two old pipes wait already: the open one carries on
        r.carried[10] = [0, 0]
        r._ended(10, object(), "its reader closed it")  # the generator ended it: its iterator let go
        f, _ = await r.join(6)
        assert f == 13 and r.draining == {11, 12} and 10 not in r.carried

    asyncio.run(main())
