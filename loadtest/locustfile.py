"""Locust load test of the ``tts`` model: streaming over gRPC and over HTTP ``generate_stream``.

Every stream fires request events, so locust's table (and ``--csv``/``--json``) shows their percentiles:
``first_chunk`` (time to the first audio chunk) and ``stream`` (the whole utterance; its size is the
audio in bytes of float32). A failed stream is one failure on ``stream``, with the server's message.

A complete stream also fires ``worst_gap``: the longest a listener would wait for audio, in ms as its
"response time", playing the stream from its first chunk on with that chunk as the only buffer
(``bench.load.worst_gap``; 0 for a stream that never stalls). A stream that stalls at least once (an
underrun: a chunk came after the audio before it had run out) fires ``underrun`` too, with the same
gap. So ``underrun``'s request count over ``stream``'s is the share of streams a listener would hear
stall, and ``worst_gap``'s percentiles say by how much; neither is a failure. A stream with a gap of more
than 100 ms fires ``continuity_break`` as well (vLLM-Omni's measure): 1 - its count over ``stream``'s is
the continuity OK rate.

Closed loop (``GrpcStreamUser``, ``HttpStreamUser``): each user streams one utterance after another, so
``-u`` is the concurrency and a slow server simply gets fewer requests.

Open loop (``GrpcOpenLoopUser``, ``HttpOpenLoopUser``, with ``TTS_RATE``): requests arrive on a Poisson
schedule at ``TTS_RATE`` requests/s in all, whether or not earlier streams have finished. Locust's own
pacing cannot do that: ``constant_throughput``/``constant_pacing`` delay a user's next task until its last
one ends, so a stream longer than the interval holds back the next arrival (completions gate arrivals:
a closed loop again), and a ``LoadTestShape`` sets user counts, not arrival times. So each open-loop user
is an arrival generator: its ``wait_time`` draws exponential gaps of mean ``users / TTS_RATE`` s, and
its task only starts a stream in a greenlet of its own and returns. N independent Poisson processes at
``TTS_RATE / N`` add up to one at ``TTS_RATE``, and -u only spreads the dispatching (``-u 1`` is fine).
At stop, the streams in flight get ``TTS_DRAIN_TIMEOUT`` s to finish; the rest end at their next chunk
as a failure (``TimeoutError``). A ``--stop-timeout`` shorter than that cuts the drain short, and the
streams then in flight report nothing. Without ``TTS_TEXTS`` they speak the benchmark's mixed set
(``bench.openloop.MIXED_TEXTS``: English and Chinese, short replies and multi-sentence paragraphs).

User classes (pick one or both on the command line):
    GrpcStreamUser  --host HOST:PORT          (Triton gRPC, default port 8001)
    HttpStreamUser  --host http://HOST:PORT   (Triton HTTP, default port 8000)
``--host`` applies to every class; to run both at once leave it out and set TTS_GRPC_HOST and
TTS_HTTP_HOST instead.

    locust -f loadtest/locustfile.py --headless -u 8 -r 8 -t 60s --host 127.0.0.1:8001 GrpcStreamUser
    TTS_RATE=2 locust -f loadtest/locustfile.py --headless -u 2 -r 2 -t 60s --host 127.0.0.1:8001 GrpcOpenLoopUser

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
    TTS_RATE          open-loop users: arrivals per second, all of this process's open-loop users together
    TTS_ARRIVAL_SEED  open-loop users: seed of the arrival times and text draws (default: unseeded)
    TTS_DRAIN_TIMEOUT open-loop users: seconds the streams in flight get to finish at stop (default 60)
"""

# grpc must be told about gevent before any channel exists, or its threads block locust's event loop
# (locust has already monkey-patched the standard library by the time it imports this file).
from grpc.experimental import gevent as grpc_gevent

grpc_gevent.init_gevent()

import itertools  # noqa: E402
import os  # noqa: E402
import random  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from dataclasses import dataclass  # noqa: E402
from pathlib import Path  # noqa: E402

import gevent.event  # noqa: E402
import gevent.pool  # noqa: E402
from locust import User, constant, task  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository: bench/ is not installed
from bench.load import worst_gap  # noqa: E402
from bench.openloop import CLOCK_SLACK_S, CONTINUITY_GAP_S, MIXED_TEXTS  # noqa: E402
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
    rate: float | None = None  # open loop: arrivals per second over all open-loop users
    open_loop_texts: tuple[str, ...] = MIXED_TEXTS  # what open-loop arrivals speak (TTS_TEXTS when given)
    arrival_seed: int | None = None  # open loop: seed of arrival times and text draws (None: unseeded)
    drain_timeout: float = 60.0  # open loop: seconds the streams in flight get to finish at stop

    @classmethod
    def from_env(cls, env=os.environ) -> "LoadConfig":
        texts = env.get("TTS_TEXTS", "")
        if texts and Path(texts).is_file():
            lines = Path(texts).read_text(encoding="utf-8").splitlines()
        else:
            lines = texts.split("|")
        given = tuple(t.strip() for t in lines if t.strip())
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
        rate = float(env["TTS_RATE"]) if env.get("TTS_RATE") else None
        if rate is not None and rate <= 0:
            raise ValueError(f"TTS_RATE must be > 0 requests/s, got {rate}")
        arrival_seed = int(env["TTS_ARRIVAL_SEED"]) if env.get("TTS_ARRIVAL_SEED") else None
        return cls(given or DEFAULT_TEXTS, request, seed, float(env.get("TTS_TIMEOUT", "60")),
                   float(env.get("TTS_WAIT", "0")), rate, given or MIXED_TEXTS, arrival_seed,
                   float(env.get("TTS_DRAIN_TIMEOUT", "60")))  # fmt: skip


CONFIG = LoadConfig.from_env()


class _TTSUser(User):
    """A user with a client of ``protocol`` and the stream that fires the module's events; no task."""

    abstract = True
    protocol = "grpc"

    def on_start(self) -> None:
        if not self.host:
            raise ValueError(f"{type(self).__name__} needs --host, or TTS_GRPC_HOST / TTS_HTTP_HOST")
        self.tts = TTSClient(self.host, self.protocol, timeout=CONFIG.timeout)

    def stream_once(self, text: str, seed: int, cancel: gevent.event.Event | None = None) -> None:
        """One stream and its events; ``cancel``, once set, ends it at its next chunk as a failure."""
        fire = self.environment.events.request.fire
        t0 = time.perf_counter()
        first, size, arrivals, seconds = None, 0, [], []
        try:
            # the client closes (and, if unfinished, cancels) its stream in a `finally`; on_stop has
            # nothing to close, so stopping a user never blocks on a stream
            for chunk in self.tts.stream(text, seed=seed, **CONFIG.request):
                if cancel is not None and cancel.is_set():
                    raise TimeoutError(f"still streaming {CONFIG.drain_timeout:g} s after the load test stopped")
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
        gap = worst_gap(arrivals, seconds)
        broken = gap > CONTINUITY_GAP_S + CLOCK_SLACK_S  # as bench.openloop.continuous judges it
        for name in ["worst_gap"] + ["underrun"] * (gap > 0) + ["continuity_break"] * broken:
            fire(request_type=self.protocol, name=name, response_time=1000 * gap, response_length=0, exception=None,
                 context={})  # fmt: skip


class _StreamUser(_TTSUser):
    """Closed loop: each user streams one utterance after another."""

    abstract = True
    wait_time = constant(CONFIG.wait)

    @task
    def speak(self) -> None:
        seed = CONFIG.seed if CONFIG.seed is not None else random.randrange(2**31)
        self.stream_once(random.choice(CONFIG.texts), seed)


class _OpenLoopUser(_TTSUser):
    """An arrival generator (see the module's docstring): exponential waits, each arrival's stream in a
    greenlet of its own."""

    abstract = True
    users = 0  # open-loop users running now, in this process: each generates TTS_RATE / users arrivals/s
    numbers = itertools.count()  # gives each user its own arrival seed

    def wait_time(self) -> float:
        return self.arrival_rng.expovariate(CONFIG.rate / max(1, _OpenLoopUser.users))

    def on_start(self) -> None:
        if CONFIG.rate is None:
            raise ValueError(f"{type(self).__name__} needs TTS_RATE (requests/s)")
        super().on_start()
        seed = None if CONFIG.arrival_seed is None else CONFIG.arrival_seed * 10_000 + next(_OpenLoopUser.numbers)
        self.arrival_rng = random.Random(seed)
        self.streams, self.cancel = gevent.pool.Group(), gevent.event.Event()
        _OpenLoopUser.users += 1
        gevent.sleep(self.wait_time())  # the first arrival is a gap away too, or -u users would all start at once

    @task
    def arrive(self) -> None:
        seed = CONFIG.seed if CONFIG.seed is not None else self.arrival_rng.randrange(2**31)
        self.streams.spawn(self.stream_once, self.arrival_rng.choice(CONFIG.open_loop_texts), seed, self.cancel)

    def on_stop(self) -> None:
        _OpenLoopUser.users -= 1
        if not self.streams.join(timeout=CONFIG.drain_timeout):
            self.cancel.set()  # each ends at its next chunk, or at the client's timeout
            self.streams.join(timeout=CONFIG.timeout + 1)


class GrpcStreamUser(_StreamUser):
    protocol = "grpc"
    host = os.environ.get("TTS_GRPC_HOST")


class HttpStreamUser(_StreamUser):
    protocol = "http"
    host = os.environ.get("TTS_HTTP_HOST")


class GrpcOpenLoopUser(_OpenLoopUser):
    protocol = "grpc"
    host = os.environ.get("TTS_GRPC_HOST")


class HttpOpenLoopUser(_OpenLoopUser):
    protocol = "http"
    host = os.environ.get("TTS_HTTP_HOST")
