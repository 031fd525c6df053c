"""The one bound on unsent audio (gateway/outbox.py) and the agent socket's writer over it, without a
server: a peer that never reads (every send waits forever) is cut within the socket's bounds, whichever
comes first (the unsent audio, a send that makes no progress, an idle socket's closing error), its
contexts are cancelled, the transport is aborted, and one log line names the peer and the reason."""

from __future__ import annotations

import asyncio
import json
import logging

import pytest

from client.pace import Pace
from gateway.dialects.cartesia_socket import CartesiaSocket
from gateway.outbox import ABORT, ClientNotReading, Cut, Outbox
from gateway.socket_bounds import OpenSockets, SocketBounds
from gateway.text_socket import TextSocket
from tests.unit.test_agent_socket import PCM24, FakeStreams, Voices

PEER = "192.0.2.7:4711"


def test_the_outbox_holds_at_most_its_seconds_of_audio_and_counts_what_is_taken():
    async def run():
        box = Outbox(0.5)  # 12,000 samples at 24 kHz
        box.put("a", 8000)
        box.put("marker")  # replies without audio cost nothing
        with pytest.raises(ClientNotReading, match=r"left 0\.6 s of audio untaken \(the bound: 0\.5 s\)"):
            box.put("b", 6000)  # 14,000 would wait
        assert await box.get() == "a" and box.waiting == 0
        box.put("b", 6000)  # taken audio makes room again
        box.put("c", 6000)
        return [await box.get() for _ in range(3)], box.waiting

    assert asyncio.run(run()) == (["marker", "b", "c"], 0)


def test_the_outbox_reports_what_its_writer_takes_to_each_streams_pace():
    """Audio counts as delivered when the writer takes it; a report goes out per second taken, and at once
    when the writer finds the outbox empty (its client took all it was given)."""
    reports: dict[str, list[float]] = {"a": [], "b": []}
    paces = {k: Pace(report_seconds=1.0) for k in reports}
    for k, pace in paces.items():
        pace.attach(reports[k].append)

    async def run():
        box = Outbox(10.0)
        for _ in range(3):
            box.put("a", 12_000, paces["a"])  # 0.5 s each
        box.put("b", 6_000, paces["b"])
        box.put("marker")
        await box.get()
        assert reports == {"a": [], "b": []}  # 0.5 s taken: not reported yet
        await box.get()
        assert reports["a"] == [1.0]  # a second taken
        for _ in range(3):
            await box.get()
        assert reports == {"a": [1.0], "b": []}  # the rest waits for a report...
        getting = asyncio.ensure_future(box.get())  # ... until the writer finds the outbox empty
        await asyncio.sleep(0)
        assert reports == {"a": [1.0, 1.5], "b": [0.25]}
        box.put("late", 2_400, paces["b"])
        assert await getting == "late"

    asyncio.run(run())
    assert paces["b"].taken == 8_400


def test_a_cut_aborts_once_and_logs_one_line(caplog):
    aborts = []

    async def run():
        cut = Cut(lambda: aborts.append(1), PEER, "an agent socket")
        cut.closing("socket idle")  # a polite close, then the peer does not take it either
        cut("not reading")
        cut("not reading again")
        return cut.done.is_set(), cut.reason

    with caplog.at_level(logging.WARNING, logger="gateway"):
        assert asyncio.run(run()) == (True, "socket idle")
    assert aborts == [1]
    assert [r.getMessage() for r in caplog.records] == [f"an agent socket from {PEER} closed: socket idle"]


class StuckPeer:
    """A WebSocket whose peer never reads: every send and the close wait forever, until the transport is
    aborted (then the receive side says the peer is gone, as uvicorn's does)."""

    def __init__(self, messages: list[dict]):
        self.scope = {"extensions": {ABORT: self.abort}}
        self.inbox: asyncio.Queue = asyncio.Queue()
        for m in messages:
            self.inbox.put_nowait({"type": "websocket.receive", "text": json.dumps(m)})
        self.aborted, self.sends = False, 0

    async def receive(self) -> dict:
        return await self.inbox.get()

    async def send_text(self, text: str) -> None:
        self.sends += 1
        await asyncio.Event().wait()

    async def close(self, code: int = 1000) -> None:
        await asyncio.Event().wait()

    def abort(self) -> None:
        self.aborted = True
        self.inbox.put_nowait({"type": "websocket.disconnect", "code": 1006})


def stuck_socket(messages: list[dict], unsent_seconds: float = 30.0, **bounds) -> tuple[StuckPeer, FakeStreams, float]:
    """Run an agent socket over a :class:`StuckPeer` -> the peer, the streams, the seconds until it ended."""
    peer, streams = StuckPeer(messages), FakeStreams(hold_first=True)

    async def run():
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        socket = TextSocket(peer, CartesiaSocket(), streams, Voices().get, SocketBounds(**bounds), unsent_seconds, PEER)
        await asyncio.wait_for(socket.run(), 10)
        return loop.time() - t0

    return peer, streams, asyncio.run(run())


SPEAKING = {**PCM24, "continue": True, "max_buffer_delay_ms": 0}  # flushed: its audio comes at once


def test_a_peer_that_takes_no_reply_is_cut_after_send_seconds(caplog):
    with caplog.at_level(logging.WARNING, logger="gateway"):
        peer, streams, took = stuck_socket([SPEAKING], send_seconds=0.3)
    assert peer.aborted and 0.3 <= took < 2 and streams.opened[0].cancelled
    lines = [r.getMessage() for r in caplog.records]
    assert lines == [f"an agent socket from {PEER} cut: not reading: a reply waited 0.3 s for its socket to take it"]


def test_audio_past_the_unsent_bound_cuts_the_socket_at_once(caplog):
    # the fake's audio is 100 samples a character: "Hello there. " is 1,300 samples, over 0.05 s (1,200)
    with caplog.at_level(logging.WARNING, logger="gateway"):
        peer, streams, took = stuck_socket([SPEAKING], unsent_seconds=0.05, send_seconds=60)
    assert peer.aborted and took < 2 and streams.opened[0].cancelled
    assert len(caplog.records) == 1 and "its client left 0.1 s of audio untaken" in caplog.text and PEER in caplog.text


def test_an_idle_sockets_watchdog_is_not_held_by_a_send_that_never_completes(caplog):
    """Issue 47, row 2: the watchdog sent its idle error itself and waited on it forever."""
    with caplog.at_level(logging.WARNING, logger="gateway"):
        peer, _, took = stuck_socket([], idle_seconds=0.2, send_seconds=0.5)
    assert peer.aborted and took < 2
    assert [r.getMessage() for r in caplog.records] == [
        f"an agent socket from {PEER} closed: socket idle: no message for 0.2 s and no context open; closing"]  # fmt: skip


def test_the_per_peer_share_and_the_gateways_bound_are_both_kept():
    sockets = OpenSockets(SocketBounds(sockets=3, sockets_per_peer=2))
    for peer in ("a", "a", "b"):
        assert sockets.take(peer) is None
    assert sockets.take("c").startswith("too many sockets: the server has 3")
    sockets.leave("b")
    assert sockets.take("a").startswith("too many sockets from your address: at most 2")
    assert sockets.take("c") is None
    sockets.leave("c")
    sockets.leave("a")
    assert sockets.take("a") is None and sockets.held == {"a": 2}
    assert sockets.take("a").startswith("too many sockets from your address")
