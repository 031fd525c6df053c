"""The OpenAI-compatible speech API in front of Triton: ``POST /v1/audio/speech`` streams encoded audio
as the ``tts`` model makes it (gRPC streaming underneath; ``instructions`` design a voice); ``GET /v1/models``,
``GET /v1/audio/voices`` (and ``POST`` a recording or a description), ``POST /v1/audio/edits``
(:mod:`gateway.instruct`) and ``GET /health``. Errors come in OpenAI's shape,
``{"error": {"message", "type", "param", "code"}}``.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from client.aio import AsyncTTSClient
from client.request import TTSError
from client.voices import VoiceClient
from gateway.body import BODY_TIMEOUT, MAX_BODY_BYTES, MAX_UPLOAD_BYTES, read_capped, uploaded_audio
from gateway.errors import UNAVAILABLE_TYPE, APIError, from_http_error, from_tts_error
from gateway.fields import from_query, parse_json, speech_request
from gateway.instruct import add_edit_routes, design_voice
from gateway.streaming import stream_response

MODEL_ID = "fireredtts3"
PAGE = Path(__file__).with_name("page.html")  # the web page at /: one file, no build step
VOICE_LIST_SECONDS = 5.0  # how long a fetched voice list is reused
DECODING_AT_ONCE = 2  # uploads decoded at the same time: each may take up to 60 s x 192 kHz of float32


def create_app(triton: str, timeout: float = 60.0, body_timeout: float = BODY_TIMEOUT) -> FastAPI:
    """``triton``: host:port of Triton's gRPC endpoint; ``timeout``: seconds without a chunk before a
    stream fails; ``body_timeout``: seconds for a request body to arrive."""
    app = FastAPI(title="FireRedTTS3 speech API", docs_url=None, redoc_url=None)
    tts = AsyncTTSClient(triton, timeout=timeout)
    voice_list = VoiceList(triton, timeout)

    @app.exception_handler(APIError)
    async def api_error(_request, e: APIError):
        return e.response()

    @app.exception_handler(StarletteHTTPException)  # Starlette's own: too many form fields, unknown route, ...
    async def http_error(_request, e: StarletteHTTPException):
        return from_http_error(e.status_code, str(e.detail), e.headers).response()

    @app.exception_handler(RequestValidationError)
    async def validation_error(_request, e: RequestValidationError):
        return from_http_error(422, str(e.errors())).response()

    decoding = asyncio.Semaphore(DECODING_AT_ONCE)  # concurrent uploads must not multiply the peak
    add_page_routes(app, tts)
    add_voice_routes(app, tts, voice_list, decoding, body_timeout)
    add_speech_routes(app, tts, voice_list, body_timeout)
    add_edit_routes(app, tts, decoding, body_timeout)
    return app


class VoiceList:
    """The server's registered voices, fetched at most once per :data:`VOICE_LIST_SECONDS` (the speech
    route checks a ``voice`` against it) and again after a voice was added or removed here."""

    def __init__(self, triton: str, timeout: float):
        self.triton, self.timeout = triton, timeout
        self.fetched_at, self.voices = -1e9, []

    async def get(self) -> list[dict]:
        if time.monotonic() - self.fetched_at > VOICE_LIST_SECONDS:
            listed = await asyncio.to_thread(VoiceClient(self.triton, timeout=self.timeout).list)
            self.fetched_at, self.voices = time.monotonic(), listed
        return self.voices

    def changed(self) -> None:
        self.fetched_at = -1e9


def add_page_routes(app: FastAPI, tts: AsyncTTSClient) -> None:
    """``GET /`` (the web page), ``GET /health`` and ``GET /v1/models``."""
    page_html = PAGE.read_text()  # read once: GET / is open to anyone, and the file never changes in a run

    @app.get("/", response_class=HTMLResponse)
    async def page():
        return page_html

    @app.get("/health")
    async def health():
        try:
            ready = await tts._channel().is_server_ready()
        except Exception as e:  # the server cannot be reached: that is the answer
            raise APIError(503, f"the TTS server is unavailable: {e}", kind=UNAVAILABLE_TYPE) from None
        if not ready:
            raise APIError(503, "the TTS server is not ready", kind=UNAVAILABLE_TYPE)
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models():
        model = {"id": MODEL_ID, "object": "model", "created": 0, "owned_by": "fireredtts3"}
        return {"object": "list", "data": [model]}


def admin_key(request: Request) -> str:
    """The caller's ``Authorization: Bearer <admin key>``, passed on to the voices model, which checks it."""
    scheme, _, key = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not key:
        raise APIError(401, "adding and removing voices needs the admin key: Authorization: Bearer <key>",
                       kind="authentication_error")  # fmt: skip
    return key


def add_voice_routes(
    app: FastAPI, tts: AsyncTTSClient, voice_list: VoiceList, decoding: asyncio.Semaphore, body_timeout: float
) -> None:
    """``GET /v1/audio/voices``, ``POST /v1/audio/voices`` (an upload, or a description to design a voice
    from: :func:`gateway.instruct.design_voice`) and ``DELETE /v1/audio/voices/{name}``."""
    triton, timeout = voice_list.triton, voice_list.timeout

    async def voice_call(fn, *args, param: str | None = None):
        try:
            result = await asyncio.to_thread(fn, *args)
        except (TTSError, ConnectionError, TimeoutError) as e:
            raise from_tts_error(e, param) from None
        voice_list.changed()
        return result

    @app.get("/v1/audio/voices")
    async def list_voices():
        try:
            return {"voices": await voice_list.get()}
        except (TTSError, ConnectionError, TimeoutError) as e:
            raise from_tts_error(e) from None

    @app.post("/v1/audio/voices")
    async def add_voice(request: Request):
        key = admin_key(request)
        too_big = f"the upload is over {MAX_UPLOAD_BYTES // 2**20} MB"
        raw = await read_capped(request, MAX_UPLOAD_BYTES, too_big, body_timeout)
        voices_client = VoiceClient(triton, timeout=timeout, admin_key=key)
        if request.headers.get("content-type", "").startswith("application/json"):
            designed = await design_voice(tts, voices_client, parse_json(raw))
            voice_list.changed()
            return designed
        form = await request.form()  # parses the body read above
        if "instructions" in form:
            if "file" in form:
                raise APIError(400, "give either file (a recording) or instructions (to design a voice), not both",
                               "instructions")  # fmt: skip
            designed = await design_voice(tts, voices_client, form)
            voice_list.changed()
            return designed
        name, text, upload = form.get("name"), form.get("text", ""), form.get("file")
        if not isinstance(name, str) or not name:
            raise APIError(400, "name is required", "name")
        if not isinstance(text, str):
            raise APIError(400, "text (the transcript) must be a form field, not a file", "text")
        # bounded from the header before any decoding: the key is checked by the voices model, so this runs
        # for any Bearer header
        audio, sr = await uploaded_audio(upload, decoding, "the reference recording")
        return await voice_call(voices_client.add, name, audio, sr, text)

    @app.delete("/v1/audio/voices/{name}")
    async def remove_voice(name: str, request: Request):
        voices_client = VoiceClient(triton, timeout=timeout, admin_key=admin_key(request))
        return await voice_call(voices_client.remove, name, param="name")


def add_speech_routes(app: FastAPI, tts: AsyncTTSClient, voice_list: VoiceList, body_timeout: float) -> None:
    """``POST /v1/audio/speech`` (a JSON body) and ``GET /v1/audio/speech`` (the same fields as a query)."""

    async def speak(body: dict):
        kw = await speech_request(body, voice_list.get)
        return await stream_response(tts.stream, kw, body.get("response_format") or "mp3",
                                     body.get("stream_format") or "audio")  # fmt: skip

    @app.get("/v1/audio/speech")
    async def speech_get(request: Request):
        """The same as POST with the fields as query parameters (what an audio element can ask for)."""
        return await speak(from_query(request.query_params))

    @app.post("/v1/audio/speech")
    async def speech(request: Request):
        too_big = f"the request body is over {MAX_BODY_BYTES} bytes"
        return await speak(parse_json(await read_capped(request, MAX_BODY_BYTES, too_big, body_timeout)))
