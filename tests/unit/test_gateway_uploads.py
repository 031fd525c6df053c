"""An uploaded reference recording is bounded from its header before any decoding (rate, channels, length),
then decoded a block at a time and stopped at the length limit; uploads decode a few at a time."""

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
from engine.audio import MAX_REFERENCE_SECONDS, REFERENCE_RATES
from gateway.body import decode_blocks, decode_upload
from gateway.errors import APIError
from serving.supervision.triton_env import free_port


def encoded(frames: int, rate: int, channels: int = 1, fmt: str = "FLAC", subtype: str | None = None) -> bytes:
    out = io.BytesIO()
    sf.write(out, np.zeros((frames, channels), np.float32), rate, format=fmt, subtype=subtype)
    return out.getvalue()


def refusal(data: bytes) -> str:
    with pytest.raises(APIError) as refused:
        decode_upload(data)
    assert (refused.value.status, refused.value.param) == (400, "file")
    return refused.value.message


@pytest.fixture
def no_decoding(monkeypatch):
    """Any decoding fails the test: what is refused here is refused from the header alone."""

    def read(*args, **kwargs):
        raise AssertionError("the upload was decoded")

    monkeypatch.setattr(sf.SoundFile, "read", read)


@pytest.mark.parametrize(
    ("frames", "rate", "channels", "fmt", "needle"),
    [
        (100, 655_350, 8, "FLAC", "sample rate is 655350 Hz"),  # the bomb's header: 8 channels at 655,350 Hz
        (100, REFERENCE_RATES[1] + 1, 1, "WAV", f"sample rate is {REFERENCE_RATES[1] + 1} Hz"),
        (100, REFERENCE_RATES[0] - 1, 1, "FLAC", f"sample rate is {REFERENCE_RATES[0] - 1} Hz"),
        (100, 16_000, 3, "FLAC", "3 channels"),
        (100, 48_000, 8, "WAV", "8 channels"),
        (int(MAX_REFERENCE_SECONDS * 8000) + 1, 8000, 1, "FLAC", "60.0 s long"),
        (int(MAX_REFERENCE_SECONDS * 8000) * 10, 8000, 2, "FLAC", "600.0 s long"),
    ],
)  # fmt: skip
def test_the_header_alone_refuses(no_decoding, frames, rate, channels, fmt, needle):
    data = encoded(frames, rate, channels, fmt)
    assert len(data) < 100_000
    assert needle in refusal(data)


def test_what_is_not_audio_is_refused():
    assert "not audio" in refusal(b"not audio at all")
    assert "no audio samples" in refusal(encoded(0, 16_000, fmt="WAV"))


def test_a_good_recording_decodes_to_the_mean_of_its_channels():
    rng = np.random.default_rng(3)
    stereo = (0.2 * rng.standard_normal((int(MAX_REFERENCE_SECONDS * 8000), 2))).astype(np.float32)
    out = io.BytesIO()
    sf.write(out, stereo, 8000, format="WAV", subtype="FLOAT")  # exact samples: the mean is checkable
    audio, rate = decode_upload(out.getvalue(), block=4096)  # the limit exactly, in blocks that do not divide it
    assert rate == 8000 and audio.dtype == np.float32
    np.testing.assert_allclose(audio, stereo.mean(axis=1), rtol=0, atol=1e-7)


def test_decoding_stops_at_the_limit_whatever_the_header_said():
    """The block loop alone (the header check is another line of defence): 2.5 s against a 1 s limit."""
    with sf.SoundFile(io.BytesIO(encoded(20_000, 8000, 2))) as f:
        with pytest.raises(APIError) as refused:
            decode_blocks(f, limit=8000, block=1000)
        assert f.tell() <= 8000 + 1000  # at most one block past the limit was decoded
    assert (refused.value.status, refused.value.param) == (400, "file")


def test_a_flac_that_leaves_its_length_out_is_refused():
    data = bytearray(encoded(int(MAX_REFERENCE_SECONDS * 8000) + 8000, 8000))
    streaminfo = int.from_bytes(data[18:26], "big") & ~((1 << 36) - 1)  # total samples: 0, "unknown"
    data[18:26] = streaminfo.to_bytes(8, "big")
    assert sf.info(io.BytesIO(bytes(data))).frames == 2**63 - 1  # libsndfile: it does not know
    refusal(bytes(data))


def test_uploads_decode_at_most_two_at_a_time(monkeypatch):
    lock, running, peak, release = threading.Lock(), [0], [0], threading.Semaphore(0)

    def decode(data, **limits):
        with lock:
            running[0] += 1
            peak[0] = max(peak[0], running[0])
        try:
            assert release.acquire(timeout=30)
        finally:
            with lock:
                running[0] -= 1
        return np.zeros(8000, np.float32), 8000

    monkeypatch.setattr(gateway.body, "decode_upload", decode)  # what gateway.body.uploaded_audio calls
    app = gateway.app.create_app(f"127.0.0.1:{free_port()}", timeout=5)

    async def go():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://gw", timeout=60) as client:
            form = {"files": {"file": ("a.wav", b"RIFF")}, "headers": {"Authorization": "Bearer k"}}
            uploads = [asyncio.create_task(client.post("/v1/audio/voices", data={"name": f"v{i}"}, **form))
                       for i in range(5)]  # fmt: skip
            for _ in range(5):  # let one decode finish each time two are running (or the rest are)
                deadline = time.monotonic() + 30
                while running[0] < min(2, 5 - sum(t.done() for t in uploads)) and time.monotonic() < deadline:
                    await asyncio.sleep(0.01)
                release.release()
            return [(await t).status_code for t in uploads]

    statuses = asyncio.run(go())
    assert statuses == [503] * 5  # decoded, then the (closed) server was unreachable
    assert peak[0] == gateway.app.DECODING_AT_ONCE == 2
