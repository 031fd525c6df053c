"""What the integration tests share besides fixtures: gauges read from a server, work in parallel, the
gateway in front of a server, the inputs of a generator request that carries no voice, a server behind
the fronts, a server stopped on a thread."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np

from serving.config.repository import ServeOptions, build
from serving.contract import LATENT_DIM
from serving.fronts.front_limits import FrontLimits, HttpFrontLimits
from serving.supervision.triton_env import Ports, TritonServer

# A generator request without a voice: silent prompt latents, a zero speaker embedding.
SILENT = {"TEXT": "Direct", "PROMPT_LATENTS": np.zeros((4, LATENT_DIM), np.float32),
          "SPEAKER": np.zeros(512, np.float32), "PROMPT_TEXT": ""}  # fmt: skip


def metrics(server) -> dict[str, float]:
    return server.metrics()


def wait_gauges_zero(server, timeout: float = 10.0) -> dict[str, float]:
    deadline = time.monotonic() + timeout
    while True:
        m = metrics(server)
        if m.get("tts_generator_active_slots") == 0 and m.get("tts_vocoder_active_streams") == 0:
            return m
        if time.monotonic() > deadline:
            stuck_stacks(server)
            return m
        time.sleep(0.05)


def stuck_stacks(server, seconds_each: float = 10.0) -> list[Path]:
    """gdb's stacks of tritonserver and each of its stubs (found by their heartbeat files), appended to
    ``<work dir>/stacks/<name>.<pid>.gdb.txt``: called when a server that should have settled has not, so
    that a rare hang under load leaves where each thread waited (a loaded ``make test`` once showed four
    tts_ensemble requests and two generator slots after an ensemble flood, with every heartbeat on time; the
    same state, reproduced with starved stubs, was the flood still generating, 264 of its 1,200 stream-steps
    made, when the test stopped waiting for it: test_open_door now waits for the flood's end). The paths
    written (none without gdb); they are printed, which a failing test's report shows."""
    from serving.supervision.run_folder import HEARTBEATS
    from serving.supervision.supervise import native_stacks

    work, proc, written = getattr(server, "work_dir", None), getattr(server, "proc", None), []
    if work is None or proc is None:  # not a TritonServer of ours: nothing to look at
        return written
    work, pids = Path(work), {"tritonserver": proc.pid}
    for beat in sorted((work / HEARTBEATS).glob("*.*")):
        model, _, pid = beat.name.rpartition(".")
        if pid.isdigit():
            pids[model] = int(pid)
    for name, pid in pids.items():
        path = work / "stacks" / f"{name}.{pid}.gdb.txt"
        try:
            if native_stacks(pid, path, timeout=seconds_each):
                written.append(path)
        except OSError as e:  # a diagnosis must not hide the failure it diagnoses
            print(f"no stacks of {name} ({pid}): {e}")
    print(f"the server did not settle; stacks: {[str(p) for p in written] or 'none (no gdb)'}")
    return written


def in_parallel(fn, n: int, timeout: float = 120.0) -> dict:
    """``fn(i)`` for i in 0..n-1, each on its own thread -> {i: result}; the first error is raised."""
    results, errors = {}, []

    def run(i):
        try:
            results[i] = fn(i)
        except Exception as e:  # noqa: BLE001 (surfaced below)
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    if errors:
        raise errors[0]
    return results


# the stops that ``serving`` left running, and what they and their checks raised: conftest's ``_stops_joined``
# waits for them at the session's end and raises the first error
STOPPING: list[threading.Thread] = []
STOP_ERRORS: list[BaseException] = []


@contextmanager
def serving(server: TritonServer, then=None) -> Iterator[TritonServer]:
    """``with server``, but its stop (SIGTERM, then Triton unloads its models: ~4 s, mostly Triton polling
    once a second) runs on a thread while the next tests go on; ``then(server)``, if given, runs on that
    thread once it has stopped (a check of its log: what it raises fails the session, at its end)."""
    server.__enter__()  # started and ready (or stopped, and raised)
    try:
        yield server
    finally:
        stop_later(server, then)


def stop_later(server: TritonServer, then=None) -> None:
    """``server.close()`` on a thread (then ``then(server)``): ``serving``'s stop, for a server started otherwise."""

    def stop():
        try:
            server.close()
            if then is not None:
                then(server)
        except BaseException as e:  # noqa: BLE001 (raised at the session's end: conftest's _stops_joined)
            STOP_ERRORS.append(e)

    thread = threading.Thread(target=stop, name=f"stop {server.work_dir}")
    thread.start()
    STOPPING.append(thread)


def stops_done() -> None:
    """Once every server ``serving`` stops on a thread has stopped (and been checked): for a test that the
    load of a stopping server could fail (a count of live streams), before it starts."""
    while STOPPING:
        STOPPING.pop().join()


def gateway_for(server):
    """The OpenAI-compatible gateway in front of ``server``, on a free loopback port -> a context of its base URL."""
    from gateway.server import in_thread

    return in_thread(f"127.0.0.1:{server.ports.grpc}")


# A legitimate stream for the fronts' tests: a few chunks, the same audio each time
LEGIT = {"text": "A legitimate stream.", "seed": 11,
         "parameters": {"max_patches": 6, "chunk_first": 2, "chunk_fixed": True}}  # fmt: skip


# The fronts' bounds in their modules (test_grpc_front, test_http_front), which share one server behind both
# (conftest's ``fronted``; test_hardening's sealed server is that one too)
# (its call-idle bound is under the server's --text-idle-seconds, which the launcher refuses: the text-in
# streams of these tests send their pieces within it)
GRPC_FRONT_LIMITS = FrontLimits(max_message_mb=2.0, max_unsent_mb=0.25, max_unsent_seconds=10.0,
                                max_calls_per_client=6, call_idle_seconds=6.0)  # fmt: skip
HTTP_FRONT_LIMITS = HttpFrontLimits(max_body_mb=2.0, header_seconds=3.0)


@contextmanager
def behind_fronts(ckpt: Path, work: Path, grpc_front: FrontLimits | None = None,
                  http_front: HttpFrontLimits | None = None, ensemble: bool = True) -> Iterator[TritonServer]:  # fmt: skip
    """A tritonserver of 2 slots and 2 waiting places behind the fronts given (serving.fronts.grpc_front,
    serving.fronts.http_front), its files in ``work``; Triton's own ports stay reachable on loopback."""
    opts = ServeOptions(checkpoint=str(ckpt), slots=2, max_queue=2, max_len=1024, cancel_dir=str(work / "cancel"),
                        voice_dir=str(work / "voices"), run_dir=str(work), ensemble=ensemble)  # fmt: skip
    server = TritonServer(build(work / "model_repository", opts), work, Ports.free(), grpc_front=grpc_front,
                          http_front=http_front)  # fmt: skip
    with serving(server):
        yield server


class GeneratorPipe:
    """A pipe to the generator over one gRPC stream (serving.stub.chunk_pipe), opened as tts opens its own
    but without a read receipt (unpaced: the deadlock receipts prevent is a BLS one), for tests that act as
    the pipeline with the internal key: every stream sent on it names the pipe, its chunks come on the
    pipe and its own request's one response to :meth:`answer`. :meth:`close` asks the generator to end the
    pipe (a cancel mark in ``cancel_dir``), as tts does, and the streams still on it are lost."""

    def __init__(self, url: str, model: str, key: str, cancel_dir: Path, timeout: float = 60.0):
        import queue
        import secrets

        import tritonclient.grpc as grpcclient

        from loadtest.attacks import inputs

        self.model, self.key, self.cancel_dir, self.inputs = model, key, Path(cancel_dir), inputs
        self.pipe_id = secrets.randbits(62) | (1 << 62)
        self.queues: dict[str, queue.Queue] = {"pipe": queue.Queue()}  # request id -> (result, error)
        self.chunks: dict[int, list] = {}  # stream id -> its chunks read on the pipe so far
        self.sent, self.closed = 0, False
        self.client = grpcclient.InferenceServerClient(url)
        self.client.start_stream(callback=self._received)
        self._send("pipe", SILENT, self.pipe_id, {"pipe": "open"}, start=True)
        result, error = self.queues["pipe"].get(timeout=timeout)  # the opening, answered at once
        assert error is None and not result.get_response().outputs, error

    def _received(self, result, error) -> None:
        if error is not None:  # a stream error names no request: every reader hears it
            for q in self.queues.values():
                q.put((None, error))
        else:
            self.queues[result.get_response().id].put((result, None))

    def _send(self, request_id: str, values: dict, sequence_id: int, parameters: dict, start: bool) -> None:
        import queue

        self.queues.setdefault(request_id, queue.Queue())
        self.client.async_stream_infer(self.model, self.inputs(self.model, values), request_id=request_id,
                                       parameters={**parameters, "internal_key": self.key}, sequence_id=sequence_id,
                                       sequence_start=start, enable_empty_final_response=True)  # fmt: skip

    def send(self, values: dict, sequence_id: int, parameters: dict, start: bool = True) -> str:
        """A stream request naming the pipe -> its request id (for :meth:`answer`)."""
        self.sent += 1
        request_id = f"s{self.sent}"
        self._send(request_id, values, sequence_id, {**parameters, "pipe": f"{self.pipe_id:x}"}, start)
        return request_id

    def answer(self, request_id: str, timeout: float = 60.0) -> str | None:
        """A stream's own request's one response: None (admitted: its chunks come on the pipe), or its
        FINISH_REASON (refused: one chunk, packed as the pipe's) or error."""
        from serving.stub.chunk_pipe import unpack

        result, error = self.queues[request_id].get(timeout=timeout)
        if error is not None:
            return str(error)
        return unpack(result.as_numpy)[0].finish_reason if result.get_response().outputs else None

    def read(self, stream_id: int, timeout: float = 60.0) -> list:
        """The stream's chunks (engine.protocol.Chunk), read on the pipe until its last one came (or
        ``timeout`` seconds passed)."""
        import queue

        from serving.stub.chunk_pipe import unpack

        deadline = time.monotonic() + timeout
        while not (chunks := self.chunks.get(stream_id)) or not chunks[-1].last:
            try:
                result, error = self.queues["pipe"].get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                break
            assert error is None, error
            for chunk in unpack(result.as_numpy) if result.get_response().outputs else ():
                self.chunks.setdefault(chunk.stream_id, []).append(chunk)
        return self.chunks.get(stream_id, [])

    def close(self) -> None:
        from serving.flow.side_channel import SideChannel

        if self.closed:
            return
        self.closed = True
        SideChannel(self.cancel_dir).mark("cancel", self.pipe_id)  # the generator ends it, its streams lost
        self.client.stop_stream(cancel_requests=True)
        self.client.close()

    def __enter__(self) -> GeneratorPipe:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
