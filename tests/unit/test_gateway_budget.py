"""The gateway's totals over the requests in flight (issue 30, item 3): uploads held together past
``Bounds.upload_bytes``, or decoded audio past ``Bounds.decoded_bytes``, get 503 with Retry-After in OpenAI's
shape, and every byte a request took is given back when it is over, refused or not."""

from __future__ import annotations

import asyncio
import io
import threading
import time

import httpx
import numpy as np
import pytest
import soundfile as sf

import gateway.app
import gateway.body
from gateway.body import decoded_bytes
from gateway.budget import Bounds
from serving.supervision.triton_env import free_port

MB = 2**20


def wav(seconds: float, rate: int = 16000) -> bytes:
    out = io.BytesIO()
    sf.write(out, np.zeros(int(seconds * rate), np.float32), rate, format="WAV", subtype="PCM_16")
    return out.getvalue()


def test_bounds_refuse_nonsense():
    with pytest.raises(ValueError, match="upload_bytes"):
        Bounds(upload_bytes=0)
    with pytest.raises(ValueError, match="unsent_seconds"):
        Bounds(unsent_seconds=-1)


def test_decoded_bytes_counts_float32_mono_from_the_header():
    assert decoded_bytes(wav(2.0), 60) == 4 * 32000
    assert decoded_bytes(wav(2.0), 1) == 0  # refused from its header as too long: nothing is decoded
    assert decoded_bytes(b"not audio", 60) == 0


def uploads_at_once(monkeypatch, bounds: Bounds, sizes: list[int]) -> tuple[list, dict]:
    """Edit uploads of ``sizes`` bytes of 16-bit 16 kHz WAV sent together to a gateway with ``bounds``, each decode held until all
    were answered or are decoding -> (their answers, the app's budgets' holdings after all ended)."""
    release, decoding = threading.Event(), [0]

    def decode(data, **limits):
        decoding[0] += 1
        assert release.wait(30)
        return np.zeros(8000, np.float32), 8000

    monkeypatch.setattr(gateway.body, "decode_upload", decode)
    app = gateway.app.create_app(f"127.0.0.1:{free_port()}", timeout=5, bounds=bounds)

    async def go():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://gw", timeout=60) as client:
            tasks = [asyncio.create_task(client.post(
                "/v1/audio/edits", data={"type": "acoustic", "instructions": "adjust the speed to 1.5"},
                files={"file": ("a.wav", wav(n / 32000))})) for n in sizes]  # fmt: skip
            deadline = time.monotonic() + 30
            while decoding[0] + sum(t.done() for t in tasks) < len(tasks) and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
            release.set()
            return [await t for t in tasks]

    answers = asyncio.run(go())
    budgets = app.state.budgets
    return answers, {"uploads": budgets.uploads.held, "decoded": budgets.decoded.held}


def test_uploads_past_the_total_get_503_and_every_byte_comes_back(monkeypatch):
    bounds = Bounds(upload_bytes=int(2.5 * MB))  # room for two 1 MB uploads, not three
    answers, held = uploads_at_once(monkeypatch, bounds, [MB] * 4)  # each 1 MB of 16-bit WAV
    refused = [r for r in answers if r.status_code == 503 and "request bodies" in r.text]
    assert len(refused) == 2, [(r.status_code, r.text[:200]) for r in answers]
    for r in refused:
        assert r.headers["retry-after"] == "1" and r.json()["error"]["type"] == "service_unavailable"
        assert r.headers["connection"] == "close"
    assert held == {"uploads": 0, "decoded": 0}


def test_decoded_audio_past_the_total_gets_503(monkeypatch):
    bounds = Bounds(decoded_bytes=int(1.5 * MB))  # one 1 MB decode at a time, not two
    answers, held = uploads_at_once(monkeypatch, bounds, [MB // 2] * 3)  # 256 Ki samples: 1 MB of float32 each
    refused = [r for r in answers if r.status_code == 503 and "decoded uploads" in r.text]
    assert len(refused) == 2, [(r.status_code, r.text[:200]) for r in answers]
    assert held == {"uploads": 0, "decoded": 0}
