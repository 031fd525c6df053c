"""One address's share of the Triton streams (gateway/shares.py), against a real gateway and tritonserver:
with a share of 2, two socket contexts from one address hold it; that address's next context, OpenAI speech
request and vendor HTTP requests are refused by name (429, each in its dialect's shape) while another
address (127.0.0.2, through a source relay) is served; once the contexts are cancelled the address is
served again, and every gauge is back at 0."""

from __future__ import annotations

import httpx
import pytest

from gateway.budget import Bounds
from gateway.server import ServerOptions, in_thread
from loadtest.source_relay import SourceRelay
from tests.integration.helpers import wait_gauges_zero
from tests.integration.test_agent_socket_server import GOOD, SHORT, Socket
from tests.integration.test_vendor_http import send

pytestmark = pytest.mark.integration
REFUSED = "too many streams from your address: at most 2 at once"
SPEECH = {"model": "fireredtts3", "input": "Served.", "response_format": "pcm", "seed": 7, **SHORT}
# a context that speaks its first words, then waits for more text: its Triton stream stays open
WAITING = {**GOOD, "continue": True, "max_buffer_delay_ms": 0, "transcript": "Still speaking", "parameters": SHORT}


@pytest.fixture(scope="module")
def shared(server):
    """A gateway whose addresses have 2 Triton streams each."""
    options = ServerOptions(bounds=Bounds(streams_per_peer=2))
    with in_thread(f"127.0.0.1:{server.ports.grpc}", options=options) as url:
        yield url


def speech(url: str) -> httpx.Response:
    return httpx.post(f"{url}/v1/audio/speech", json=SPEECH, timeout=60)


def test_one_address_holds_at_most_its_share_and_another_address_is_served_meanwhile(shared, server):
    relay = SourceRelay(("127.0.0.1", int(shared.rsplit(":", 1)[1])))
    mine = Socket(shared)
    try:
        for context_id in ("a", "b"):
            mine.send({**WAITING, "context_id": context_id})
        assert mine.receive()["type"] == "chunk"  # the contexts are open and speaking
        mine.send({**GOOD, "context_id": "c", "parameters": SHORT})
        refused = []
        while not (refused and refused[-1]["type"] == "done" and refused[-1]["context_id"] == "c"):
            reply = mine.receive()
            if reply["context_id"] == "c":
                refused.append(reply)
        assert [r["type"] for r in refused] == ["error", "done"], refused
        assert refused[0]["error"] == REFUSED and refused[0]["status_code"] == 429

        r = speech(shared)  # the same address over HTTP: the share is every route's
        assert r.status_code == 429 and r.headers["retry-after"] == "1", r.text
        assert r.json()["error"]["message"] == REFUSED and r.json()["error"]["type"] == "rate_limit_error"
        cartesia, eleven = send(shared, "sdk-generate"), send(shared, "sdk-stream")
        assert cartesia.status_code == 429 and cartesia.json()["message"] == REFUSED, cartesia.text
        assert eleven.status_code == 429 and eleven.json()["detail"]["message"] == REFUSED, eleven.text
        assert eleven.json()["detail"]["status"] == "too_many_requests"

        other = speech(f"http://{relay.address}")  # another address is served meanwhile
        assert other.status_code == 200 and len(other.content) > 0, other.text

        for context_id in ("a", "b"):
            mine.send({"context_id": context_id, "cancel": True})
        mine.send({**GOOD, "context_id": "d", "parameters": SHORT})  # the share is free again: served
        served = mine.until_done("d")
        assert "error" not in [r["type"] for r in served if r["context_id"] == "d"], served
    finally:
        mine.close()
        relay.close()
    again = speech(shared)
    assert again.status_code == 200 and again.content == other.content  # the same seed, the same audio
    m = wait_gauges_zero(server, 30)
    assert m["tts_generator_active_slots"] == 0 and m["tts_vocoder_active_streams"] == 0
