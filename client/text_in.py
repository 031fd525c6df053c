"""Text in, audio out: one utterance whose text is sent piece by piece as it is written (an LLM's tokens),
over a gRPC stream to ``tts`` as a Triton sequence (a random sequence id, START on the first request, END
on the last, one request per piece). The server speaks each segment as soon as its text is complete
(a sentence end, a flush) while later text still comes; the audio arrives on the same stream.

    ts = await client.open_text(voice_id="alice", seed=7)
    await ts.send("Hello there. ")
    await ts.send("How are", flush=False)
    await ts.send(" you?", flush=True)
    await ts.end()
    async for item in ts:        # Chunk ..., Flushed(1), Chunk ...
        ...

:meth:`AsyncTextStream.cancel` (barge-in) stops the server's generation and frees its slot at once.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Self

from client.pace import PACE, REQUEST_ID, Pace, is_pace_error, next_response, pace_request
from client.request import Chunk, chunk_of, is_final, piece_request, raise_if_failed, sequence_id


@dataclass(frozen=True)
class Flushed:
    """All audio of the text up to the ``n``-th ``send(..., flush=True)`` has been yielded (n = 1, 2, ...),
    but its last 50 ms, which the server cross-fades into the next segment (they come with it, or at the end)."""

    n: int


class AsyncTextStream:
    """One text-in stream (:meth:`client.AsyncTTSClient.open_text` opens it). ``send`` and ``end`` may be
    called from one task while another iterates; iterating yields :class:`client.Chunk` and :class:`Flushed`
    and ends once all audio is out after :meth:`end`; errors are the client's (:mod:`client.tts_client`)."""

    def __init__(self, client, fields: dict, parameters: dict, on_plan=None, pace: Pace | bool | None = None):
        """``pace`` (client.pace): True paces the server by this iteration, a Pace by what its owner counts."""
        self.client, self.model = client, client.model
        self.sequence = sequence_id()
        self.on_plan = on_plan
        self.flushes = 0
        self.ended = self.done = False
        self.requests: asyncio.Queue = asyncio.Queue()  # stream_infer's dicts; None: no more
        self.own = pace is True
        self.pace = Pace() if self.own else pace or None
        self.taken = 0  # (own pace) samples of the chunk returned last: taken when the next item is asked for
        if self.pace is not None:  # its reports go on the stream (outside the sequence) until the stream is over
            parameters = {**parameters, PACE: self.pace.token}
            self.pace.attach(lambda s: self.requests.put_nowait(pace_request(self.model, self.pace.token, s)))
        self.requests.put_nowait(piece_request(self.model, self.sequence, "", False, start=True, fields=fields,
                                               parameters=parameters))  # fmt: skip
        self.channel = client._channel()
        self.t0 = time.perf_counter()
        self.responses = self.channel.stream_infer(self._requests(), stream_timeout=client.stream_timeout)

    async def _requests(self):
        while (request := await self.requests.get()) is not None:
            yield request

    async def send(self, text: str, flush: bool = False) -> None:
        """One piece of the text (may be ""); ``flush``: speak what was sent so far now, as its own segment
        (a :class:`Flushed` follows its audio)."""
        if self.ended or self.done:
            raise ValueError("the text stream has ended")
        if not isinstance(text, str):
            raise TypeError(f"text must be a str, got {type(text).__name__}")
        self.requests.put_nowait(piece_request(self.model, self.sequence, text, flush))
        self.flushes += bool(flush)

    async def end(self) -> None:
        """No more text: the rest is spoken, then the iteration ends."""
        if self.ended or self.done:
            return
        self.ended = True
        self.requests.put_nowait(piece_request(self.model, self.sequence, "", False, end=True))
        if self.pace is None:  # (paced: once the audio is over, the reports stop and it half-closes)
            self.requests.put_nowait(None)  # the request side half-closes; the server ends after the audio

    async def cancel(self) -> None:
        """Barge-in: the server stops generating (within a step) and frees the stream's slot; the
        iteration ends."""
        if not self.done:
            self.done = True
            self.responses.cancel()
        self.requests.put_nowait(None)

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.cancel()

    def __aiter__(self):
        return self

    async def __anext__(self) -> Chunk | Flushed:
        import grpc

        if self.taken:
            self.pace.took(self.taken)
            self.taken = 0
        while not self.done:
            try:  # before end() the server's idle bound, not this client's timeout, limits the wait
                timeout = self.client.timeout if self.ended else None
                result, error = await next_response(self.responses, self.pace, self.own, timeout)
            except TimeoutError:
                await self.cancel()
                raise TimeoutError(f"no response from the server for {self.client.timeout:g} s") from None
            except StopAsyncIteration:
                break
            except (grpc.RpcError, asyncio.CancelledError) as e:
                if self.done:  # cancelled by us
                    break
                await self.cancel()
                if isinstance(e, asyncio.CancelledError):
                    raise
                raise self.client._failed(self.channel, e) from None
            if error is not None:
                if self.pace is not None and is_pace_error(error):  # a report's answer, not the stream's
                    continue
                await self.cancel()
                raise self.client._failed(self.channel, error)
            if self.pace is not None and result.get_response().id == REQUEST_ID:
                continue
            if is_final(result):  # the stream is over (all its audio, or its failure)
                self.done = True
                self.requests.put_nowait(None)
            raise_if_failed(result.as_numpy("FINISH_REASON"))
            flushed = result.as_numpy("FLUSHED")
            if flushed is not None and flushed.size:
                return Flushed(int(flushed.reshape(-1)[0]))
            chunk = chunk_of(result, self.on_plan, self.t0)
            if chunk is not None:
                if self.own:
                    self.taken = chunk.audio.size
                return chunk
        self.done = True
        raise StopAsyncIteration
