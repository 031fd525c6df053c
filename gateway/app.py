"""The OpenAI-compatible speech API in front of Triton: ``POST /v1/audio/speech`` streams encoded audio
as the ``tts`` model makes it (gRPC streaming underneath; ``instructions`` design a voice); ``GET /v1/models``,
``GET /v1/audio/voices`` (and ``POST`` a recording or a description), ``POST /v1/audio/edits``
(:mod:`gateway.instruct`) and ``GET /health``. Errors come in OpenAI's shape,
``{"error": {"message", "type", "param", "code"}}``.
"""

from __future__ import annotations

import asyncio
import contextlib
import html
import re
import time
import uuid
from pathlib import Path

from fastapi import FastAPI, Request, WebSocket
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from client.aio import AsyncTTSClient
from client.request import TTSError
from client.voices import VoiceClient
from engine.params import shown
from engine.random_weights import RANDOM_WEIGHTS_NOTE
from gateway.agent_sockets import Sockets, serve
from gateway.body import BODY_TIMEOUT, MAX_UPLOAD_BYTES, read_capped, uploaded_audio
from gateway.budget import DEFAULT_BOUNDS, Bounds, Budgets, ReleaseHolds
from gateway.dialects import cartesia_http, elevenlabs_http, elevenlabs_socket
from gateway.dialects.cartesia_socket import CartesiaSocket
from gateway.dialects.whole_text import Core
from gateway.errors import STARTING, UNAVAILABLE_TYPE, APIError, from_http_error, from_tts_error
from gateway.fields import from_query, parse_json
from gateway.instruct import add_edit_routes, check_fields, design_voice
from gateway.jobs.options import JobOptions
from gateway.jobs.routes import add_job_routes
from gateway.jobs.runner import JobRunner
from gateway.jobs.store import JobStore
from gateway.shares import StreamShares, host_of
from gateway.socket_bounds import OpenSockets, SocketBounds
from gateway.text_streams import TextStreams

MODEL_ID = "fireredtts3"
PAGE = Path(__file__).with_name("page.html")  # the web page at /: one file, no build step
VOICE_LIST_SECONDS = 5.0  # how long a fetched voice list is reused
DECODING_AT_ONCE = 2  # uploads decoded at the same time: each may take up to 60 s x 192 kHz of float32


def create_app(
    triton: str,
    timeout: float = 60.0,
    body_timeout: float = BODY_TIMEOUT,
    random_weights: bool = False,
    socket_bounds: SocketBounds | None = None,
    bounds: Bounds = DEFAULT_BOUNDS,
    jobs: JobOptions | None = None,
) -> FastAPI:
    """``triton``: host:port of Triton's gRPC endpoint; ``timeout``: seconds without a chunk before a
    stream fails; ``body_timeout``: seconds for a request body to arrive; ``random_weights``: the server
    runs a random-weight checkpoint, and the web page says what that sounds like; ``socket_bounds``: the
    agent WebSocket's (:class:`gateway.socket_bounds.SocketBounds`); ``bounds``: what the requests in
    flight may hold together (:mod:`gateway.budget`) and a stream's unsent audio; ``jobs``: the job API's
    folder and bounds (:mod:`gateway.jobs`; None: no job routes)."""
    app = FastAPI(title="FireRedTTS3 speech API", docs_url=None, redoc_url=None, lifespan=lifespan)
    app.state.budgets = Budgets(bounds)
    app.state.shares = StreamShares(bounds.streams_per_peer)  # every route's Triton streams, by address
    tts = AsyncTTSClient(triton, timeout=timeout)
    voice_list = VoiceList(triton, timeout)

    @app.exception_handler(APIError)
    async def api_error(_request, e: APIError):
        return e.response()

    app.add_middleware(ReleaseHolds)  # what a request took from app.state.budgets, given back once it is over
    app.add_middleware(RequestIdMiddleware)

    @app.exception_handler(StarletteHTTPException)  # Starlette's own: too many form fields, unknown route, ...
    async def http_error(_request, e: StarletteHTTPException):
        return from_http_error(e.status_code, str(e.detail), e.headers).response()

    @app.exception_handler(RequestValidationError)
    async def validation_error(_request, e: RequestValidationError):
        return from_http_error(422, str(e.errors())).response()

    decoding = asyncio.Semaphore(DECODING_AT_ONCE)  # concurrent uploads must not multiply the peak
    add_page_routes(app, tts, RANDOM_WEIGHTS_NOTE if random_weights else None)
    add_voice_routes(app, tts, voice_list, decoding, body_timeout)
    core = Core(tts, voice_list.get, body_timeout)  # the speech route's, and the vendors' dialects' (gateway.dialects)
    add_speech_routes(app, core)
    add_edit_routes(app, tts, decoding, body_timeout)
    add_agent_routes(app, tts.open_text, voice_list, socket_bounds or SocketBounds(), bounds.unsent_seconds,
                     app.state.shares)  # fmt: skip
    for dialect in (cartesia_http, elevenlabs_http):
        dialect.add_routes(app, core)
    if jobs is not None:
        store = JobStore(jobs.path / "jobs.sqlite3")
        app.state.jobs = JobRunner(store, tts, app.state.shares, jobs)  # started and stopped by lifespan
        add_job_routes(app, core, app.state.jobs, store, jobs)
    return app


@contextlib.asynccontextmanager
async def lifespan(app: FastAPI):
    """The job runner (if the app has one) runs while the app serves: it resumes the jobs a stopped gateway
    left running, and stops its own where they are (the next start resumes them)."""
    runner = getattr(app.state, "jobs", None)
    if runner is not None:
        runner.start()
    try:
        yield
    finally:
        if runner is not None:
            await runner.stop()
            runner.store.close()


def add_agent_routes(app: FastAPI, open_text: TextStreams, voice_list: VoiceList, bounds: SocketBounds,
                     unsent_seconds: float = DEFAULT_BOUNDS.unsent_seconds,
                     shares: StreamShares | None = None) -> None:  # fmt: skip
    """The agent sockets (docs/agents.md), every vendor's on one text-socket core (:mod:`gateway.text_socket`):
    ``/tts/websocket``, Cartesia's, and ElevenLabs' ``/v1/text-to-speech/{voice_id}/stream-input`` and
    ``/multi-stream-input`` (:mod:`gateway.dialects.elevenlabs_socket`). The gateway has no API
    keys of its own: the plugins' ``X-API-Key`` header (or ``?api_key=``) and ``cartesia_version`` are taken
    and not checked, as the speech route takes any ``Authorization``. ``unsent_seconds``: the audio a
    socket's peer may leave untaken, all its contexts together (:mod:`gateway.outbox`); ``shares``: the
    Triton streams each address may have open, shared with the HTTP routes (:mod:`gateway.shares`)."""
    shares = shares or StreamShares(DEFAULT_BOUNDS.streams_per_peer)
    sockets = Sockets(open_text, voice_list.get, bounds, OpenSockets(bounds), unsent_seconds, shares)
    dialect = CartesiaSocket()  # it holds nothing per socket

    @app.websocket("/tts/websocket")
    async def agent_socket(ws: WebSocket):
        await serve(ws, dialect, sockets)

    elevenlabs_socket.add_routes(app, sockets)  # the agent sockets' share (OpenSockets) is one for all vendors


REQUEST_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")  # a caller's x-request-id that is echoed back as it came


class RequestIdMiddleware:
    """``x-request-id`` on every answer, streams and errors included (LiveKit's and OpenAI's SDKs log it; LiveKit
    warns "no request_id provided for TTS" without it): the caller's own, when it sent a plausible one, else
    a new ``req_<hex>``. A plain ASGI middleware: it touches only the response's start, never the body."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        sent = dict(scope["headers"]).get(b"x-request-id", b"").decode("latin-1")
        request_id = (sent if REQUEST_ID.fullmatch(sent) else f"req_{uuid.uuid4().hex}").encode()

        async def send_with_id(message):
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", []), (b"x-request-id", request_id)]
            await send(message)

        await self.app(scope, receive, send_with_id)


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


def add_page_routes(app: FastAPI, tts: AsyncTTSClient, notice: str | None = None) -> None:
    """``GET /`` (the web page, with ``notice`` at its top if one is given), ``GET /health`` and ``GET /v1/models``."""
    notice_html = f'<p id="notice" class="notice">{html.escape(notice)}</p>' if notice else ""
    page_html = PAGE.read_text().replace("<!--NOTICE-->", notice_html)  # read once: GET / is open to anyone

    @app.get("/", response_class=HTMLResponse)
    async def page():
        return page_html

    @app.get("/health")
    async def health():
        try:
            ready = await tts.is_ready()
        except (TTSError, ConnectionError) as e:  # the server cannot be reached: that is the answer
            raise from_tts_error(e) from None
        if not ready:
            raise APIError(503, STARTING, kind=UNAVAILABLE_TYPE)
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models(request: Request):
        if elevenlabs_http.asks_for_models(request):  # the same path in ElevenLabs' API, told by its key header
            return elevenlabs_http.models()
        model = {"id": MODEL_ID, "object": "model", "created": 0, "owned_by": "fireredtts3"}
        return {"object": "list", "data": [model]}


def admin_key(request: Request) -> str:
    """The caller's ``Authorization: Bearer <admin key>``, passed on to the voices model, which checks it."""
    scheme, _, key = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not key:
        raise APIError(401, ADMIN_KEY_NEEDED, kind="authentication_error")
    return key


# In a user's words, with where the key is: the launcher prints the file's path at start ("admin key: ...").
ADMIN_KEY_NEEDED = (
    "adding and removing voices needs the server's admin key: the launcher prints where it keeps it at start "
    '("admin key: ...", by default ~/.cache/fireredtts3-triton/admin_key); send it as Authorization: Bearer <key>'
)
AUDIO_FIELDS = {"name", "audio_sample", "file", "text", "consent", "type"}  # OpenAI's (SDK 3.57), and ours
PROMPT_FIELDS = {"name", "prompt", "type", "model", "script_hint", "language", "seed"}
DESIGN_SAMPLE = "Hello! This is the voice you described, speaking a sample sentence."


def voice_object(voice: dict, kind: str = "audio_sample", prompt: str | None = None) -> dict:
    """A voice as the voices model describes it -> OpenAI's ``audio.voice`` (``id`` is the name, what
    speech's ``voice`` takes), keeping our fields (``text``, ``seconds``, a design's ``plan``)."""
    created = voice.get("created", time.time())
    out = {"id": voice["name"], "object": "audio.voice", "name": voice["name"], "type": kind,
           "created_at": int(created), **{k: v for k, v in voice.items() if k != "created"}}  # fmt: skip
    if prompt is not None:
        out["prompt"] = prompt
    return out


def add_voice_routes(
    app: FastAPI, tts: AsyncTTSClient, voice_list: VoiceList, decoding: asyncio.Semaphore, body_timeout: float
) -> None:
    """``GET /v1/audio/voices`` (OpenAI's list: ``data``; and ``voices``, as the voices model lists them),
    ``POST /v1/audio/voices`` (an upload as OpenAI's SDK sends it, ``audio_sample``, ``name`` and ``consent``
    (taken, not checked: the admin key decides), or ours, ``file``, ``name`` and ``text``; or a description
    to design a voice from: :func:`gateway.instruct.design_voice`, OpenAI's ``type=prompt`` form included) and
    ``DELETE /v1/audio/voices/{name}`` (OpenAI's ``audio.voice.deleted``)."""
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
            voices = await voice_list.get()
        except (TTSError, ConnectionError, TimeoutError) as e:
            raise from_tts_error(e) from None
        return {"object": "list", "data": [voice_object(v) for v in voices], "voices": voices}

    async def designed(voices_client: VoiceClient, fields, request: Request) -> dict:
        with request.app.state.shares.hold(host_of(request.scope)):  # the design's one Triton stream
            voice = await design_voice(tts, voices_client, fields)
        voice_list.changed()
        return voice_object(voice, "prompt", fields.get("instructions"))

    @app.post("/v1/audio/voices")
    async def add_voice(request: Request):
        key = admin_key(request)
        too_big = f"the upload is over {MAX_UPLOAD_BYTES // 2**20} MB"
        raw = await read_capped(request, MAX_UPLOAD_BYTES, too_big, body_timeout)
        voices_client = VoiceClient(triton, timeout=timeout, admin_key=key)
        if request.headers.get("content-type", "").startswith("application/json"):
            return await designed(voices_client, parse_json(raw), request)
        form = await request.form()  # parses the body read above
        if "instructions" in form:
            if "file" in form or "audio_sample" in form:
                raise APIError(400, "give either file (a recording) or instructions (to design a voice), not both",
                               "instructions")  # fmt: skip
            return await designed(voices_client, form, request)
        if form.get("type") == "prompt" or "prompt" in form:  # OpenAI's voice from a text prompt
            check_fields(form, PROMPT_FIELDS)
            fields = {k: form[k] for k in ("name", "language", "seed") if k in form}
            fields |= {"instructions": form.get("prompt"), "text": form.get("script_hint") or DESIGN_SAMPLE}
            return await designed(voices_client, fields, request)
        check_fields(form, AUDIO_FIELDS)
        if form.get("type", "audio_sample") != "audio_sample":
            raise APIError(400, f"type must be audio_sample or prompt, got {shown(form.get('type'))}", "type")
        if "file" in form and "audio_sample" in form:
            raise APIError(400, "give the recording once: audio_sample (OpenAI's name) or file", "audio_sample")
        field = "audio_sample" if "audio_sample" in form else "file"
        name, text, upload = form.get("name"), form.get("text", ""), form.get(field)
        if not isinstance(name, str) or not name:
            raise APIError(400, "name is required", "name")
        if not isinstance(text, str):
            raise APIError(400, "text (the transcript) must be a form field, not a file", "text")
        # bounded from the header before any decoding: the key is checked by the voices model, so this runs
        # for any Bearer header
        audio, sr = await uploaded_audio(upload, decoding, "the reference recording", field=field, request=request)
        return voice_object(await voice_call(voices_client.add, name, audio, sr, text))

    @app.delete("/v1/audio/voices/{name}")
    async def remove_voice(name: str, request: Request):
        voices_client = VoiceClient(triton, timeout=timeout, admin_key=admin_key(request))
        await voice_call(voices_client.remove, name, param="name")
        return {"id": name, "object": "audio.voice.deleted", "deleted": True}


def add_speech_routes(app: FastAPI, core: Core) -> None:
    """``POST /v1/audio/speech`` (a JSON body) and ``GET /v1/audio/speech`` (the same fields as a query): OpenAI's
    dialect of the whole-text core (:mod:`gateway.dialects.whole_text`), whose fields are the core's own."""

    async def speak(body: dict, request: Request):
        response, _ = await core.speak(body, request, body.get("response_format") or "mp3", body.get("sample_rate"),
                                       stream_format=body.get("stream_format") or "audio")  # fmt: skip
        return response

    @app.get("/v1/audio/speech")
    async def speech_get(request: Request):
        """The same as POST with the fields as query parameters (what an audio element can ask for)."""
        return await speak(from_query(request.query_params), request)

    @app.post("/v1/audio/speech")
    async def speech(request: Request):
        return await speak(await core.body(request), request)
