"""The attacks on the voice-agent surfaces (text-in gRPC streams to ``tts``, the gateway's Cartesia socket),
each at the smallest size that showed its effect before it was fixed, and each bounded in time. They
return what the server answered, as a line; :mod:`loadtest.attacks` replays them with the others
(``--only socket_not_reading,...``) and ``loadtest/soak.sh --attacks`` beside real load.

Before the fix (a server with 8 slots): one socket whose client never read took tritonserver from 247 to
804 MB; 64 such sockets locked every new agent out; 112 open gRPC calls that held nothing locked out every
new call; 40 text streams that sent a space every 15 s held every admission place; pieces sent on another
client's sequence id were spoken in its stream; control tokens split by zero-width spaces reached the
tokenizer; a lone surrogate in a transcript was dropped without a word.
"""

from __future__ import annotations

import json
import queue
import secrets
import socket
import time

import tritonclient.grpc as grpcclient

from client.request import grpc_inputs, is_final
from engine.protocol import KINDS
from serving.contract import text_of

SHORT = {"max_patches": 4, "chunk_first": 1, "chunk_next": 2}  # what the legitimate checks ask for
# where the legitimate checks connect from, when the attacks come through a relay from another address
# (loadtest.attacks --source): {"url": Triton's gRPC, "gateway": the gateway's base URL}
LEGIT: dict[str, str] = {}
ZERO_WIDTH = "\u200b"


class TextStream:
    """A text-in stream to ``tts`` on a gRPC connection of its own: START now, then pieces and END."""

    def __init__(self, url: str, sequence_id: int | None = None, parameters: dict | None = None, text: str = ""):
        self.sequence_id = sequence_id or (secrets.randbits(62) | 1)
        self.responses: queue.Queue = queue.Queue()
        self.client = grpcclient.InferenceServerClient(url)
        self.client.start_stream(callback=lambda result, error: self.responses.put((result, error)))
        self.request(text, start=True, parameters=parameters)

    def request(self, text: str, flush: bool = False, start: bool = False, end: bool = False,
                parameters: dict | None = None) -> None:  # fmt: skip
        values = {"TEXT": text, **({"FLUSH": True} if flush else {})}
        self.client.async_stream_infer("tts", grpc_inputs(values), sequence_id=self.sequence_id,
                                       sequence_start=start, sequence_end=end, parameters=parameters or {},
                                       enable_empty_final_response=True)  # fmt: skip

    def outcome(self, timeout: float = 60.0) -> str:
        """Read until the stream's audio request ends -> "N samples, <finish reason>" or its error."""
        samples, deadline = 0, time.monotonic() + timeout
        while (left := deadline - time.monotonic()) > 0:
            try:
                result, error = self.responses.get(timeout=left)
            except queue.Empty:
                break
            if error is not None:
                return f"error: {str(error)[:120]}"
            audio = result.as_numpy("AUDIO")
            samples += 0 if audio is None else audio.size
            finish = result.as_numpy("FINISH_REASON")
            reason = None if finish is None or not finish.size else text_of(finish)
            if reason is not None and reason.startswith(KINDS):
                return f"error: {reason[:120]}"
            if reason and is_final(result):
                return f"{samples} samples, {reason}"
        return f"no end in {timeout:g} s ({samples} samples)"

    def close(self) -> None:
        self.client.stop_stream(cancel_requests=True)
        self.client.close()


def whole_text(url: str, text: str = "A legitimate request.", timeout: float = 60.0) -> str:
    """One whole-text request -> "audio (N samples)" or its error."""
    from client import TTSClient

    try:
        audio = TTSClient(LEGIT.get("url", url), timeout=timeout).synthesize(text, seed=7, parameters=SHORT)
        return f"audio ({audio.size} samples)"
    except Exception as e:  # noqa: BLE001 (the answer is the finding)
        return f"{type(e).__name__}: {str(e)[:100]}"


def whitespace_streams(url: str, streams: int = 40, seconds: float = 20.0, every: float = 5.0) -> str:
    """``streams`` text-in streams that send one space every ``every`` seconds for ``seconds``, and a
    whole-text request meanwhile -> what that request was answered (and how many streams were refused)."""
    held, refused = [], 0
    try:
        for _ in range(streams):
            held.append(TextStream(url, parameters=SHORT))
        answer, end = "", time.monotonic() + seconds
        while time.monotonic() < end:
            for s in list(held):
                try:
                    s.request(" ")
                except Exception:  # noqa: BLE001 (its call was refused or ended: one stream fewer)
                    held.remove(s)
                    s.close()
                    refused += 1
            if not answer:
                answer = whole_text(url)
            time.sleep(every)
        return (f"{streams} whitespace streams ({refused} refused or ended) for {seconds:g} s; a whole-text "
                f"request meanwhile: {answer}")  # fmt: skip
    finally:
        for s in held:
            s.close()


def idle_calls(url: str, calls: int = 120, seconds: float = 20.0) -> str:
    """``calls`` gRPC stream calls, each with one refused piece (no START), kept open ``seconds``; then a
    whole-text request -> what it was answered. 120: past the gRPC front's default call bound of a server
    with 8 slots and 32 waiting (2 x 40 + 32)."""
    held = []
    try:
        for _ in range(calls):
            client = grpcclient.InferenceServerClient(url)
            client.start_stream(callback=lambda result, error: None)
            client.async_stream_infer("tts", grpc_inputs({"TEXT": "x"}), sequence_id=secrets.randbits(62) | 1)
            held.append(client)
        time.sleep(seconds)
        return f"{calls} idle calls for {seconds:g} s; then a whole-text request: {whole_text(url)}"
    finally:
        for client in held:
            client.stop_stream(cancel_requests=True)
            client.close()


def foreign_pieces(url: str) -> str:
    """A victim's text-in stream, and pieces with END sent on its sequence id from another connection ->
    what the attacker's pieces and the victim's stream were answered."""
    victim = TextStream(url, parameters={**SHORT, "max_patches": 6})
    attacker = grpcclient.InferenceServerClient(url)
    answers: queue.Queue = queue.Queue()
    attacker.start_stream(callback=lambda result, error: answers.put(error))
    try:
        attacker.async_stream_infer("tts", grpc_inputs({"TEXT": "Injected words.", "FLUSH": True}),
                                    sequence_id=victim.sequence_id, enable_empty_final_response=True)  # fmt: skip
        attacker.async_stream_infer("tts", grpc_inputs({"TEXT": ""}), sequence_id=victim.sequence_id,
                                    sequence_end=True, enable_empty_final_response=True)  # fmt: skip
        refused = sum(answers.get(timeout=30) is not None for _ in range(2))
        victim.request("The victim's own words.", flush=True)
        victim.request("", end=True)
        return f"attacker's 2 requests: {refused} refused; victim: {victim.outcome()}"
    except queue.Empty:
        return "the attacker's requests got no answer in 30 s"
    finally:
        attacker.stop_stream(cancel_requests=True)
        attacker.close()
        victim.close()


def split_control_tokens(url: str, gap: int = 40) -> str:
    """``<|eot|>`` sent as pieces with ``gap`` zero-width spaces between ``<``, ``|eot|`` and ``>`` (no piece
    holds a marker, and the gaps are longer than what a piece used to be checked with), normalization off
    -> the answer."""
    stream = TextStream(url, parameters={**SHORT, "normalize": False})
    try:
        for piece in ("Hello <", ZERO_WIDTH * gap, "|eot|", ZERO_WIDTH * gap, "> there.", ""):
            stream.request(piece, flush=not piece)
        stream.request("", end=True)
        return f"split <|eot|>: {stream.outcome()}"
    finally:
        stream.close()


# ---- the gateway's Cartesia socket ----
def _socket(gateway: str, receive_buffer: int = 0):
    import websocket  # websocket-client

    sock = None
    if receive_buffer:
        sock = socket.create_connection(_host_port(gateway))
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, receive_buffer)
    url = gateway.replace("http", "ws", 1) + "/tts/websocket?cartesia_version=2025-04-16"
    return websocket.create_connection(url, timeout=30, socket=sock)


def _host_port(gateway: str) -> tuple[str, int]:
    from urllib.parse import urlsplit

    address = urlsplit(gateway)
    return address.hostname, address.port


def _context(context_id: str, text: str, more: bool = True, max_patches: int = 400) -> str:
    return json.dumps({"context_id": context_id, "transcript": text, "continue": more, "max_buffer_delay_ms": 0,
                       "voice": {"mode": "id", "id": "default"}, "language": "en", "seed": 7,
                       "output_format": {"container": "raw", "encoding": "pcm_f32le", "sample_rate": 48000},
                       "parameters": {"max_patches": max_patches}})  # fmt: skip


def _still_open(ws, seconds: float = 5.0) -> str:
    """Whether the server still holds the socket: drain what it sent for ``seconds`` -> a word."""
    ws.settimeout(seconds)
    try:
        while ws.recv():
            pass
    except Exception as e:  # noqa: BLE001 (a timeout: still open; anything else: closed or reset)
        return "still open" if "timed out" in str(e) else f"closed by the server ({type(e).__name__})"
    return "closed by the server"


def _keep_sending(sockets: list, contexts: int, seconds: float) -> tuple[int, float | None]:
    """A sentence to each of ``contexts`` contexts of every socket every 0.2 s, for ``seconds``, reading
    nothing -> (sockets the server cut, seconds until the first cut or None)."""
    t0, alive, first = time.monotonic(), list(sockets), None
    while alive and time.monotonic() - t0 < seconds:
        for ws in list(alive):
            try:
                for i in range(contexts):
                    ws.send(_context(f"c{i}", "Nobody reads this sentence. "))
            except Exception:  # noqa: BLE001 (the server cut it: the finding)
                alive.remove(ws)
                first = first or time.monotonic() - t0
        time.sleep(0.2)
    return len(sockets) - len(alive), first


def socket_not_reading(gateway: str | None, contexts: int = 8, seconds: float = 40.0) -> str:
    """One socket, ``contexts`` contexts fed a sentence each every 0.2 s for ``seconds``, nothing read."""
    if not gateway:
        return "skipped: no --gateway"
    ws = _socket(gateway, receive_buffer=4096)
    try:
        cut, first = _keep_sending([ws], contexts, seconds)
        state = f"cut by the server after {first:.0f} s" if cut else _still_open(ws)
        return f"1 socket, {contexts} unread contexts fed for up to {seconds:g} s: {state}"
    finally:
        ws.close(timeout=1)


def sockets_not_reading(gateway: str | None, sockets: int = 64, seconds: float = 40.0) -> str:
    """``sockets`` sockets (the gateway's default bound), one context each fed a sentence every 0.2 s, none
    read; then a new socket from the legitimate address -> how many were taken, cut, and what it got."""
    if not gateway:
        return "skipped: no --gateway"
    held, refused = [], 0
    try:
        for _ in range(sockets):
            try:
                held.append(_socket(gateway, receive_buffer=4096))
            except Exception:  # noqa: BLE001 (refused: the share or the bound)
                refused += 1
        cut, _ = _keep_sending(held, 1, seconds)
        return (f"{sockets} unread sockets ({refused} refused at the handshake, {cut} of {len(held)} refused or "
                f"cut within {seconds:g} s); then a new socket: {legitimate_context(gateway)}")  # fmt: skip
    finally:
        for ws in held:
            ws.close(timeout=1)


def legitimate_context(gateway: str) -> str:
    """One short context on a new socket -> "N bytes" or its error."""
    try:
        ws = _socket(LEGIT.get("gateway", gateway))
    except Exception as e:  # noqa: BLE001 (the answer is the finding)
        return f"refused ({type(e).__name__}: {str(e)[:80]})"
    try:
        ws.send(_context("ok", "A legitimate sentence.", more=False, max_patches=4))
        n = 0
        while True:
            reply = json.loads(ws.recv())
            if reply.get("type") == "error":
                return f"error: {reply.get('error', '')[:100]}"
            n += len(reply.get("data") or "") * 3 // 4
            if reply.get("type") == "done":
                return f"{n} bytes"
    except Exception as e:  # noqa: BLE001
        return f"{type(e).__name__}: {str(e)[:80]}"
    finally:
        ws.close(timeout=1)


def surrogate_transcript(gateway: str | None) -> str:
    """A context whose only transcript holds a lone surrogate -> the replies' types and any error."""
    if not gateway:
        return "skipped: no --gateway"
    ws = _socket(gateway)
    try:
        ws.send(_context("u", "Hello \ud800 there.", more=False, max_patches=4))
        types, error = [], ""
        while not types or types[-1] != "done":
            reply = json.loads(ws.recv())
            types.append(reply.get("type"))
            error = error or reply.get("error", "")
        return f"replies {types}; error: {error[:100] or 'none'}"
    finally:
        ws.close(timeout=1)
