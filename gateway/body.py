"""What a client sends, bounded before it costs anything: a request body in bytes and seconds, an uploaded
reference recording in rate, channels and length from its header before decoding, and in length again
while it decodes. These run for anyone who reaches the port (the voices model checks the admin key later).
"""

from __future__ import annotations

import asyncio
import io

import numpy as np
from fastapi import Request

from engine.audio import REFERENCE_RATES, downmix
from engine.protocol import MAX_REFERENCE_SECONDS
from gateway.errors import APIError

MAX_BODY_BYTES = 64 * 1024  # a speech request's JSON
MAX_UPLOAD_BYTES = 20 * 2**20  # a reference recording (60 s of 48 kHz stereo 16-bit WAV is 11 MB)
BODY_TIMEOUT = 30.0  # seconds for a body to arrive once its headers have (20 MB at 0.7 MB/s)
MAX_UPLOAD_CHANNELS = 2
DECODE_BLOCK_FRAMES = 2**16  # frames decoded at a time: 512 KB of float32 stereo
UNKNOWN_FRAMES = 2**63 - 1  # libsndfile's frame count for a file that does not say (SF_COUNT_MAX)


async def read_capped(request: Request, limit: int, too_big: str, seconds: float = BODY_TIMEOUT) -> bytes:
    """The request body, refused (413) as soon as it passes ``limit`` bytes, whatever Content-Length
    says or whether it is there (a chunked body has none), and (408) if it has not all arrived within
    ``seconds``; nothing more is read or kept, and the connection is closed after either answer."""
    length = request.headers.get("content-length", "")
    if length.isdigit() and int(length) > limit:  # (uvicorn refuses a malformed one)
        raise APIError(413, too_big, close=True)
    budget = budgets(request).uploads if budgets(request) else None
    declared = int(length) if length.isdigit() else None
    if budget is not None and declared is not None:
        budget.take(request.scope, declared)  # the whole body it announced, before reading any of it
    parts = []

    async def read() -> None:
        size = 0
        async for part in request.stream():
            size += len(part)
            if size > limit:
                raise APIError(413, too_big, close=True)
            if budget is not None and declared is None:  # a chunked body: taken as it comes
                budget.take(request.scope, len(part))
            parts.append(part)

    try:
        async with asyncio.timeout(seconds):
            await read()
    except TimeoutError:
        raise APIError(408, f"the request body did not arrive within {seconds:g} s", close=True) from None
    request._body = b"".join(parts)  # Starlette's cache of the body: form() and body() read it from here
    return request._body


async def uploaded_audio(
    upload, decoding: asyncio.Semaphore, meaning: str, field: str = "file", request: Request | None = None, **decode
) -> tuple[np.ndarray, int]:
    """A form's ``field`` (``file``; OpenAI's voices call it ``audio_sample``) -> ((n,) float32 mono, rate):
    APIError 400 when it is missing, 413 over MAX_UPLOAD_BYTES; decoded off the event loop, at most
    ``decoding``'s count at a time (concurrent uploads must not multiply the peak), and only if what it
    decodes to fits the gateway's total for decoded audio (``request``'s app's :class:`Budgets`; 503
    beyond). ``meaning``: the field's, for the message ("the recording to edit"); ``decode``:
    :func:`decode_upload`'s limits and wording."""
    if upload is None or isinstance(upload, str):
        raise APIError(400, f"{field} ({meaning}) is required", field)
    data = await upload.read(MAX_UPLOAD_BYTES + 1)
    if len(data) > MAX_UPLOAD_BYTES:
        raise APIError(413, f"the upload is over {MAX_UPLOAD_BYTES // 2**20} MB", field)
    if request is not None and budgets(request):
        seconds = decode.get("seconds", MAX_REFERENCE_SECONDS)
        budgets(request).decoded.take(request.scope, decoded_bytes(data, seconds))
    async with decoding:
        return await asyncio.to_thread(decode_upload, data, **decode)


def budgets(request: Request):
    """The app's :class:`gateway.budget.Budgets`, if it has them."""
    return getattr(request.app.state, "budgets", None)


def decoded_bytes(data: bytes, seconds: float) -> int:
    """What :func:`decode_upload` may hold for ``data``: float32 mono of its length from the header, at most
    ``seconds`` (the whole ``seconds`` when the header leaves the length out); 0 for what is not audio
    (refused before decoding)."""
    import soundfile as sf

    try:
        info = sf.info(io.BytesIO(data))
    except Exception:  # noqa: BLE001 (not audio: decode_upload says so, at no cost)
        return 0
    lo, hi = REFERENCE_RATES
    limit = int(seconds * info.samplerate)
    if not lo <= info.samplerate <= hi or info.channels > MAX_UPLOAD_CHANNELS or limit < info.frames < UNKNOWN_FRAMES:
        return 0  # refused from its header
    return 4 * (info.frames if 0 <= info.frames < UNKNOWN_FRAMES else limit)


def decode_upload(
    data: bytes, block: int = DECODE_BLOCK_FRAMES, seconds: float = MAX_REFERENCE_SECONDS, what: str = "a reference"
) -> tuple[np.ndarray, int]:
    """An uploaded reference recording -> ((n,) float32 mono, rate in Hz); APIError 400 naming ``file``
    for what is not audio, or what a reference may not be (``seconds``: its longest; ``what``: what the
    messages call it, e.g. "a recording to edit").

    The header decides first, before any decoding: the rate must be one the server takes
    (``engine.audio.REFERENCE_RATES``), at most 2 channels, at most ``seconds`` (60 s for a reference: 338 KB of
    FLAC, 8 channels at 655,350 Hz for 59 s of silence, decoded to 1.24 GB of float32). Then it decodes
    ``block`` frames at a time, averaged to mono as they come, and stops as soon as more frames than
    the limit arrive: a header can leave its length out.
    """
    import soundfile as sf

    try:
        f = sf.SoundFile(io.BytesIO(data))
    except Exception as e:  # whatever libsndfile makes of it, it is not audio we can read
        raise APIError(400, f"file is not audio that libsndfile reads: {e}", "file") from None
    with f:
        rate, channels, frames = f.samplerate, f.channels, f.frames
        lo, hi = REFERENCE_RATES
        if not lo <= rate <= hi:
            raise APIError(400, f"file's sample rate is {rate} Hz; a reference must be {lo}..{hi} Hz", "file")
        if channels > MAX_UPLOAD_CHANNELS:
            raise APIError(400, f"file has {channels} channels; a reference may have at most {MAX_UPLOAD_CHANNELS}",
                           "file")  # fmt: skip
        limit = int(seconds * rate)
        too_long = f"{what} may be at most {seconds:g} s"
        if limit < frames < UNKNOWN_FRAMES:
            raise APIError(400, f"file is {frames / rate:.1f} s long; {too_long}", "file")
        try:
            return decode_blocks(f, limit, block, too_long), rate
        except APIError:
            raise
        except Exception as e:
            raise APIError(400, f"file is not audio that libsndfile reads: {e}", "file") from None


def decode_blocks(f, limit: int, block: int = DECODE_BLOCK_FRAMES, too_long: str = "") -> np.ndarray:
    """An open ``soundfile.SoundFile`` -> (n,) float32 mono, n <= ``limit`` frames; 400 as soon as more
    arrive (having decoded at most one block past the limit)."""
    out = np.empty(limit, np.float32)  # pages are touched, so counted, only as samples land in them
    n = 0
    while len(samples := f.read(block, dtype="float32", always_2d=True)):
        if n + len(samples) > limit:
            too_long = too_long or f"a reference may be at most {MAX_REFERENCE_SECONDS:g} s"
            raise APIError(400, f"file decodes to more than {limit / f.samplerate:g} s; {too_long}", "file")
        out[n : n + len(samples)] = downmix(samples)
        n += len(samples)
    if n == 0:
        raise APIError(400, "file has no audio samples", "file")
    return out[:n]
