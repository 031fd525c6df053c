"""Locust load test of the ``tts`` model: streaming over gRPC and over HTTP ``generate_stream``.

Every stream fires request events, so locust's table (and ``--csv``/``--json``) shows their percentiles:
``first_chunk`` (time to the first audio chunk) and ``stream`` (the whole utterance; its size is the
audio in bytes of float32). A failed stream is one failure on ``stream``, with the server's message.

A complete stream also fires ``worst_gap``: the longest a listener would wait for audio, in ms as its
"response time", playing the stream from its first chunk on with that chunk as the only buffer
(``bench.load.worst_gap``; 0 for a stream that never stalls). A stream that stalls at least once (an
underrun: a chunk came after the audio before it had run out) fires ``underrun`` too, with the same
gap. So ``underrun``'s request count over ``stream``'s is the share of streams a listener would hear
stall, and ``worst_gap``'s percentiles say by how much; neither is a failure.

User classes (pick one or both on the command line):
    GrpcStreamUser  --host HOST:PORT          (Triton gRPC, default port 8001)
    HttpStreamUser  --host http://HOST:PORT   (Triton HTTP, default port 8000)
``--host`` applies to every class; to run both at once leave it out and set TTS_GRPC_HOST and
TTS_HTTP_HOST instead.

    locust -f loadtest/locustfile.py --headless -u 8 -r 8 -t 60s --host 127.0.0.1:8001 GrpcStreamUser

Environment (all optional):
    TTS_TEXTS         a file with one text per line, or an inline list separated by '|'
    TTS_LANGUAGE      language name (server default: English)
    TTS_MAX_PATCHES   length limit per utterance in 160 ms patches (default 24)
    TTS_CHUNK_FIRST, TTS_CHUNK_NEXT, TTS_CHUNK_FIXED (true|false), TTS_STEPS, TTS_CFG   other request parameters
    TTS_VOICE_ID      a registered voice, or
    TTS_REF_AUDIO, TTS_REF_TEXT   a reference recording and its transcript
    TTS_SEED          fixed sampling seed (default: a random one per request)
    TTS_TIMEOUT       seconds to wait for each response (default 60)
    TTS_WAIT          seconds each user pauses between streams (default 0: closed loop)
"""

# grpc must be told about gevent before any channel exists, or its threads block locust's event loop
# (locust has already monkey-patched the standard library by the time it imports this file).
from grpc.experimental import gevent as grpc_gevent

grpc_gevent.init_gevent()

import os  # noqa: E402
import random  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from dataclasses import dataclass  # noqa: E402
from pathlib import Path  # noqa: E402

from locust import User, constant, task  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository: bench/ is not installed
from bench.load import worst_gap  # noqa: E402
from client import SAMPLE_RATE, TTSClient, read_audio  # noqa: E402

DEFAULT_TEXTS = (
    "The quick brown fox jumps over the lazy dog.",
    "Streaming speech synthesis sends audio while the sentence is still being generated.",
    "Please hold the line, your call is important to us.",
    "It was a bright cold day in April, and the clocks were striking thirteen.",
)


@dataclass(frozen=True)
class LoadConfig:
    texts: tuple[str, ...]  # picked at random per stream
    request: dict  # keyword arguments of TTSClient.stream besides text and seed (voice, parameters)
    seed: int | None  # None: a random seed per stream
    timeout: float  # seconds per response
    wait: float  # seconds between a user's streams

    @classmethod
    def from_env(cls, env=os.environ) -> "LoadConfig":
        texts = env.get("TTS_TEXTS", "")
        if texts and Path(texts).is_file():
            lines = Path(texts).read_text(encoding="utf-8").splitlines()
        else:
            lines = texts.split("|")
        texts = tuple(t.strip() for t in lines if t.strip()) or DEFAULT_TEXTS
        params = {"max_patches": int(env.get("TTS_MAX_PATCHES", "24"))}
        for key, typ in (("chunk_first", int), ("chunk_next", int), ("steps", int), ("cfg", float)):
            if env.get(f"TTS_{key.upper()}"):
                params[key] = typ(env[f"TTS_{key.upper()}"])
        if env.get("TTS_CHUNK_FIXED"):  # "true" or "false": the fixed chunk schedule, or the deadline rule
            params["chunk_fixed"] = env["TTS_CHUNK_FIXED"].strip().lower() == "true"
        request = {"language": env.get("TTS_LANGUAGE") or None, "parameters": params}
        if env.get("TTS_VOICE_ID"):
            request["voice_id"] = env["TTS_VOICE_ID"]
        if env.get("TTS_REF_AUDIO"):
            request["ref_audio"], request["ref_sample_rate"] = read_audio(env["TTS_REF_AUDIO"])
            request["ref_text"] = env.get("TTS_REF_TEXT") or None
        seed = int(env["TTS_SEED"]) if env.get("TTS_SEED") else None
        return cls(texts, request, seed, float(env.get("TTS_TIMEOUT", "60")), float(env.get("TTS_WAIT", "0")))


CONFIG = LoadConfig.from_env()


class _StreamUser(User):
    abstract = True
    protocol = "grpc"
    wait_time = constant(CONFIG.wait)

    def on_start(self) -> None:
        if not self.host:
            raise ValueError(f"{type(self).__name__} needs --host, or TTS_GRPC_HOST / TTS_HTTP_HOST")
        self.tts = TTSClient(self.host, self.protocol, timeout=CONFIG.timeout)

    @task
    def speak(self) -> None:
        seed = CONFIG.seed if CONFIG.seed is not None else random.randrange(2**31)
        text = random.choice(CONFIG.texts)
        fire = self.environment.events.request.fire
        t0 = time.perf_counter()
        first, size, arrivals, seconds = None, 0, [], []
        try:
            # the client closes (and, if unfinished, cancels) its stream in a `finally`; on_stop has
            # nothing to close, so stopping a user never blocks on a stream
            for chunk in self.tts.stream(text, seed=seed, **CONFIG.request):
                if first is None:
                    first = chunk.arrival
                    fire(request_type=self.protocol, name="first_chunk", response_time=first * 1000,
                         response_length=chunk.audio.nbytes, exception=None, context={})  # fmt: skip
                size += chunk.audio.nbytes
                if chunk.audio.size:
                    arrivals.append(chunk.arrival)
                    seconds.append(chunk.audio.size / SAMPLE_RATE)
            if first is None:
                raise RuntimeError("the stream ended without audio")
        except Exception as e:  # every failure is a locust failure (GreenletExit is not an Exception)
            fire(request_type=self.protocol, name="stream", response_time=(time.perf_counter() - t0) * 1000,
                 response_length=size, exception=e, context={})  # fmt: skip
            return
        fire(request_type=self.protocol, name="stream", response_time=(time.perf_counter() - t0) * 1000,
             response_length=size, exception=None, context={})  # fmt: skip
        gap = 1000 * worst_gap(arrivals, seconds)
        for name in ("worst_gap", "underrun") if gap > 0 else ("worst_gap",):
            fire(request_type=self.protocol, name=name, response_time=gap, response_length=0, exception=None,
                 context={})  # fmt: skip


class GrpcStreamUser(_StreamUser):
    protocol = "grpc"
    host = os.environ.get("TTS_GRPC_HOST")


class HttpStreamUser(_StreamUser):
    protocol = "http"
    host = os.environ.get("TTS_HTTP_HOST")
