"""Each address's share of Triton streams (gateway/shares.py) without a server: the owner's counts, the
share given back on every way a stream ends (done, failed, closed early, cancelled, refused at open), an
HTTP stream refused with 429 by name, and an agent socket's context refused by name then served once the
address's other context is cancelled."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging

import numpy as np
import pytest
from fastapi import FastAPI
from starlette.testclient import TestClient

from client.request import ServerBusy
from client.tts_client import Chunk
from gateway import socket_bounds
from gateway.app import add_agent_routes
from gateway.budget import Bounds
from gateway.errors import APIError
from gateway.shares import TOO_MANY_STREAMS, StreamShares, held, held_text
from gateway.streaming import stream_response
from tests.unit.test_agent_socket import GOOD, FakeStreams, Voices, until_done

REFUSED = TOO_MANY_STREAMS.format(n=2)


def test_a_peer_gets_at_most_its_share_and_other_peers_are_not_counted_against_it():
    shares = StreamShares(2)
    a, b = shares.take("10.0.0.1"), shares.take("10.0.0.1")
    with pytest.raises(APIError) as refused:
        shares.take("10.0.0.1")
    assert refused.value.status == 429 and refused.value.message == REFUSED
    assert refused.value.response().headers["Retry-After"] == "1"
    other = shares.take("10.0.0.2")  # another address is not refused
    assert shares.held == {"10.0.0.1": 2, "10.0.0.2": 1}
    a.give_back()
    a.give_back()  # twice (two end paths): counted once, never below zero
    assert shares.held == {"10.0.0.1": 1, "10.0.0.2": 1}
    shares.take("10.0.0.1")  # the freed place is taken again
    b.give_back(), other.give_back()
    assert shares.held == {"10.0.0.1": 1}


def test_a_share_below_one_is_refused():
    with pytest.raises(ValueError, match="streams_per_peer"):
        StreamShares(0)


def test_a_refused_peer_is_logged_once_in_ten_seconds_with_the_holdings(caplog):
    shares = StreamShares(1)
    shares.take("10.0.0.1")
    with caplog.at_level(logging.WARNING, logger="gateway"):
        for _ in range(5):
            with contextlib.suppress(APIError):
                shares.take("10.0.0.1")
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and lines[0].startswith(
        "refused a Triton stream (--streams-per-peer) from 10.0.0.1: it has 1 in progress, at most 1 per address"
    ), lines
    assert lines[0].endswith("in progress by address: 10.0.0.1 1")


def chunks(n: int, fail: Exception | None = None):
    def open_stream(**kw):
        async def stream():
            for _ in range(n):
                yield Chunk(np.zeros(4, np.float32), 0.0)
            if fail is not None:
                raise fail

        return stream()

    return open_stream


@pytest.mark.parametrize("way", ["done", "failed", "closed early"])
def test_an_http_stream_gives_its_share_back_however_it_ends(way):
    shares = StreamShares(1)

    async def run():
        stream = held(chunks(3, ServerBusy("busy") if way == "failed" else None), shares, "p")()
        assert await anext(stream) is not None and shares.held == {"p": 1}
        if way == "closed early":
            await stream.aclose()
        else:
            with contextlib.suppress(ServerBusy):
                async for _ in stream:
                    pass

    asyncio.run(run())
    assert shares.held == {}


def test_an_http_stream_over_the_share_is_a_429_and_the_next_after_one_ends_is_served():
    shares = StreamShares(2)
    scope = {"client": ("10.0.0.1", 5555)}

    async def run():
        first = [await stream_response(chunks(2), {}, "pcm", "audio", scope=scope, shares=shares) for _ in range(2)]
        with pytest.raises(APIError) as refused:
            await stream_response(chunks(2), {}, "pcm", "audio", scope=scope, shares=shares)
        other = await stream_response(chunks(2), {}, "pcm", "audio", scope={"client": ("10.0.0.2", 1)}, shares=shares)
        body = b"".join([part async for part in first[0].body_iterator])  # one answer read to its end
        again = await stream_response(chunks(2), {}, "pcm", "audio", scope=scope, shares=shares)
        for response in (first[1], other, again):
            async for _ in response.body_iterator:
                pass
        return refused.value, body

    refused, body = asyncio.run(run())
    assert refused.status == 429 and refused.message == REFUSED and len(body) == 2 * 4 * 2  # 16-bit PCM
    assert shares.held == {}


def test_a_text_stream_gives_its_share_back_at_its_end_its_cancel_and_a_failed_open():
    shares = StreamShares(1)

    async def failing(**fields):
        raise ServerBusy("server busy")

    async def run():
        streams = FakeStreams()
        open_text = held_text(streams, shares, "p")
        stream = await open_text()
        with pytest.raises(APIError):
            await open_text()  # the share is taken
        await stream.end()
        async for _ in stream:  # the end: the iteration stops
            pass
        assert shares.held == {}
        stream = await open_text()
        await stream.cancel()
        await stream.cancel()
        assert shares.held == {}
        with pytest.raises(ServerBusy):
            await held_text(failing, shares, "p")()
        assert shares.held == {}

    asyncio.run(run())


def test_a_sockets_context_over_the_share_is_refused_by_name_and_served_once_another_is_cancelled():
    streams, shares = FakeStreams(), StreamShares(2)
    app = FastAPI()
    add_agent_routes(app, streams, Voices(), socket_bounds.SocketBounds(), shares=shares)
    waiting = {**GOOD, "continue": True, "transcript": "Still speaking"}
    with TestClient(app).websocket_connect("/tts/websocket") as ws, \
            TestClient(app).websocket_connect("/tts/websocket") as second:  # fmt: skip
        ws.send_text(json.dumps({**waiting, "context_id": "a"}))
        second.send_text(json.dumps({**waiting, "context_id": "b"}))  # the address's share: any of its sockets
        second.send_text(json.dumps({**GOOD, "context_id": "c"}))
        refused = until_done(second, "c")
        assert [r["type"] for r in refused] == ["error", "done"]
        assert refused[0]["error"] == REFUSED and refused[0]["status_code"] == 429
        assert shares.held == {"testclient": 2}
        ws.send_text(json.dumps({"context_id": "a", "cancel": True}))
        ws.send_text(json.dumps({**GOOD, "context_id": "d"}))
        served = until_done(ws, "d")
        assert "error" not in [r["type"] for r in served] and "chunk" in [r["type"] for r in served]
    assert streams.opened[0].cancelled and len(streams.opened) == 3  # a, b, d: c never opened a stream
    assert shares.held == {}


def test_the_gateways_flag_sets_the_share_and_refuses_zero():
    import argparse

    from gateway import server

    ap = argparse.ArgumentParser()
    server.add_arguments(ap)
    assert server.options(ap.parse_args([])).bounds.streams_per_peer == Bounds().streams_per_peer == 8
    assert server.options(ap.parse_args(["--streams-per-peer", "3"])).bounds.streams_per_peer == 3
    with pytest.raises(ValueError, match="streams_per_peer"):
        server.options(ap.parse_args(["--streams-per-peer", "0"]))
