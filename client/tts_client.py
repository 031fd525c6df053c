"""Stream speech from the ``tts`` model over gRPC (bidirectional stream) or HTTP (``generate_stream``).

Each yielded :class:`Chunk` holds mono 24 kHz float32 samples and its arrival time; FireRedTTS3-Instruct's
plan text (voice design, semantic edits) goes to an ``on_plan`` callback before the first chunk. Closing the
iterator early cancels the request on the server. Every wait has a timeout: ``timeout`` bounds the wait
for each response (and the HTTP connect), ``stream_timeout`` the whole stream.

Errors: :class:`TTSError` (the server refused or failed the request, with its message), by the kind the
server tagged it with: :class:`InvalidRequest` (bad input; do not retry), :class:`ServerBusy` (alias
``ServerUnavailable``: busy, restarting or shutting down; retry shortly), :class:`Forbidden`,
:class:`NotFound`, or a plain :class:`TTSError` (the server failed); ``e.kind`` is the tag.
``ConnectionError`` (no server there), ``TimeoutError`` (a timeout above expired).
"""

from __future__ import annotations

import http.client
import json
import queue
import time
from collections.abc import Iterable, Iterator
from typing import Unpack
from urllib.parse import urlsplit

import numpy as np

from client.request import (
    Chunk,
    Forbidden,
    InvalidRequest,
    NotFound,
    RequestSettings,
    ServerBusy,
    ServerUnavailable,
    TTSError,
    TTSRequest,
    chunk_of,
    edit_task,
    grpc_error,
    grpc_inputs,
    http_body,
    http_error_text,
    is_final,
    piece_request,
    plan_text,
    raise_if_failed,
    sequence_id,
    server_error,
)

__all__ = [
    "Chunk", "Forbidden", "InvalidRequest", "NotFound", "ServerBusy", "ServerUnavailable", "TTSClient",
    "TTSError",
]  # fmt: skip


def _host_port(url: str, default_port: int) -> tuple[str, int]:
    u = urlsplit(url if "://" in url else f"//{url}")
    return u.hostname or "127.0.0.1", u.port or default_port


class TTSClient:
    """A client for one server; each :meth:`stream` opens its own connection, so streams may run in
    parallel threads on one client.

    Args:
        url: ``HOST:PORT`` (``http://`` is accepted and ignored); the port defaults to 8001 (gRPC) / 8000 (HTTP).
        protocol: ``grpc`` or ``http``.
        timeout: seconds to wait for each response (and to connect).
        model: the Triton model name.
        stream_timeout: seconds for the whole stream; default ``10 * timeout``.
    """

    def __init__(
        self, url: str, protocol: str = "grpc", timeout: float = 60.0, model: str = "tts",
        stream_timeout: float | None = None,
    ):  # fmt: skip
        if protocol not in ("grpc", "http"):
            raise ValueError(f"protocol must be grpc or http, got {protocol!r}")
        if timeout <= 0:
            raise ValueError(f"timeout must be > 0 seconds, got {timeout}")
        self.protocol, self.timeout, self.model = protocol, timeout, model
        self.stream_timeout = stream_timeout or 10 * timeout
        self.host, self.port = _host_port(url, 8001 if protocol == "grpc" else 8000)

    def stream(self, text: str | None, **settings: Unpack[RequestSettings]) -> Iterator[Chunk]:
        """Chunks as the server sends them. ``settings``: :class:`client.request.RequestSettings` (the voice,
        seed, request ``parameters``, ``speed``, Instruct's ``instruction`` and ``task``, ``on_plan``).

        ``instruction`` with no voice designs one (FireRedTTS3-Instruct); ``task`` is the contract's TASK
        (``clone`` for Instruct cloning; :meth:`edit` for the edits). ``on_plan`` is called with the
        plan text (a designed voice's attributes, a semantic edit's new transcript) when it arrives,
        before the first chunk."""
        request = TTSRequest.of(text, settings)
        if self.protocol == "grpc":
            return self._grpc(request.fields, request.parameters, request.on_plan)
        return self._http(request.fields, request.parameters, request.on_plan)

    def edit(
        self, recording: np.ndarray, sample_rate: int, instruction: str, kind: str = "semantic",
        **kw: Unpack[RequestSettings],
    ) -> Iterator[Chunk]:  # fmt: skip
        """Stream ``recording`` ((n,) float in [-1, 1], at most 30 s) edited as ``instruction`` says:
        ``kind`` ``semantic`` changes its words ("Replace 'cats' with 'dogs'."; ``on_plan`` gets the new
        transcript), ``acoustic`` its speed, pitch or volume (the model's templates). ``kw``: as :meth:`stream`."""
        return self.stream(None, ref_audio=recording, ref_sample_rate=sample_rate, instruction=instruction,
                           task=edit_task(kind), **kw)  # fmt: skip

    def synthesize(self, text: str | None, **kw: Unpack[RequestSettings]) -> np.ndarray:
        """The whole utterance as one array, shape (n,) float32 at 24 kHz."""
        chunks = [c.audio for c in self.stream(text, **kw)]
        return np.concatenate(chunks) if chunks else np.zeros(0, np.float32)

    def stream_text(self, pieces: Iterable[str], flush: bool = False, release: str | None = None,
                    **settings: Unpack[RequestSettings]) -> Iterator[Chunk]:  # fmt: skip
        """The audio of a text sent as ``pieces`` (read as they come, on a thread of their own: an LLM's
        tokens, stdin's lines), as a text-in stream (gRPC only; see :mod:`client.text_in`). ``flush``: flush
        after every piece; ``release``: ``sentence`` (the server's default) or ``flush``; ``settings``: as
        :meth:`stream`'s. Leaving early cancels the stream on the server."""
        if self.protocol != "grpc":
            raise ValueError("text-in streams need gRPC (HTTP generate_stream carries no sequence id)")
        request = TTSRequest.of(None, settings)
        fields = request.fields if release is None else {**request.fields, "RELEASE": release}
        return self._text_stream(pieces, flush, fields, request.parameters, request.on_plan, piece_request,
                                 sequence_id())  # fmt: skip

    def _text_stream(self, pieces, flush, fields, parameters, on_plan, piece_request, sequence) -> Iterator[Chunk]:
        import threading

        import tritonclient.grpc as grpcclient

        client = grpcclient.InferenceServerClient(f"{self.host}:{self.port}")
        q: queue.Queue = queue.Queue()
        client.start_stream(callback=lambda result, error: q.put((result, error)), stream_timeout=self.stream_timeout)
        stop, failure = threading.Event(), []

        def send(text: str, flush_now: bool = False, **flags) -> None:
            request = piece_request(self.model, sequence, text, flush_now, tc=grpcclient, **flags)
            client.async_stream_infer(request["model_name"], request["inputs"], sequence_id=sequence,
                                      sequence_start=request["sequence_start"],
                                      sequence_end=request["sequence_end"],
                                      parameters=request.get("parameters"))  # fmt: skip

        def feed() -> None:
            try:
                for piece in pieces:
                    if stop.is_set():
                        return
                    send(piece, flush)
                send("", end=True)
            except Exception as e:  # noqa: BLE001 (raised by the reader below, which stops the stream)
                failure.append(e)
                q.put((None, None))

        t0 = time.perf_counter()
        done = False
        try:
            send("", start=True, fields=fields, parameters=parameters)
            threading.Thread(target=feed, daemon=True, name="tts-text-in").start()
            while not done:
                result, error = q.get()  # the server's idle bound ends a stream whose text stops coming
                if failure:
                    raise failure[0]
                if error is not None:  # the stream is cancelled below (the server may have ended it already)
                    raise grpc_error(error)
                done = is_final(result)
                chunk = chunk_of(result, on_plan, t0)
                if chunk is not None:
                    yield chunk
        finally:
            stop.set()
            client.stop_stream(cancel_requests=not done)
            client.close()

    def _grpc(self, fields: dict, parameters: dict, on_plan) -> Iterator[Chunk]:
        import tritonclient.grpc as grpcclient
        from tritonclient.utils import InferenceServerException

        inputs = grpc_inputs(fields, model=self.model)
        client = grpcclient.InferenceServerClient(f"{self.host}:{self.port}")
        q: queue.Queue = queue.Queue()
        client.start_stream(callback=lambda result, error: q.put((result, error)), stream_timeout=self.stream_timeout)
        t0 = time.perf_counter()
        done = False
        try:
            try:
                client.async_stream_infer(self.model, inputs, parameters=parameters, enable_empty_final_response=True)
            except InferenceServerException:
                # the stream broke before the request went out; its callback has the cause (e.g. UNAVAILABLE)
                pass
            while not done:
                try:
                    result, error = q.get(timeout=self.timeout)
                except queue.Empty:
                    raise TimeoutError(f"no response from the server for {self.timeout:g} s") from None
                if error is not None:
                    done = True
                    raise grpc_error(error)
                done = is_final(result)
                chunk = chunk_of(result, on_plan, t0)
                if chunk is not None:
                    yield chunk
        finally:
            client.stop_stream(cancel_requests=not done)
            client.close()

    def _http(self, fields: dict, parameters: dict, on_plan) -> Iterator[Chunk]:
        conn = http.client.HTTPConnection(self.host, self.port, timeout=self.timeout)
        t0 = time.perf_counter()
        try:
            body = http_body(fields, parameters)
            conn.request("POST", f"/v2/models/{self.model}/generate_stream", body,
                         {"Content-Type": "application/json"})  # fmt: skip
            resp = conn.getresponse()
            if resp.status != 200:  # Triton's generate answers every model error with 400: the tag says whose
                raise server_error(http_error_text(resp.read()))
            for line in resp:
                if time.perf_counter() - t0 > self.stream_timeout:
                    raise TimeoutError(f"stream still running after {self.stream_timeout:g} s")
                if not line.startswith(b"data:"):
                    continue
                event = json.loads(line[5:])
                if "error" in event:
                    raise server_error(event["error"])
                raise_if_failed(event.get("FINISH_REASON"))
                if on_plan is not None and (plan := plan_text(event.get("PLAN_TEXT"))) is not None:
                    on_plan(plan)
                audio = np.asarray(event.get("AUDIO", []), np.float32).reshape(-1)
                if audio.size:
                    yield Chunk(audio, time.perf_counter() - t0)
        except TimeoutError:
            raise
        except OSError as e:  # refused, reset, or the socket timeout (socket.timeout is TimeoutError)
            raise ConnectionError(f"HTTP {self.host}:{self.port}: {e}") from e
        finally:
            conn.close()
