"""tts: the decoupled front door. Parses a request, runs the orchestrator (engine.orchestrator) over BLS
calls to prompt_encoder, generator and vocoder (serving.stub.bls), and streams AUDIO chunks to the client;
every request ends with exactly one final response. A request with a sequence id is a piece of a text-in stream
(serving.intake.text_streams): START opens it and carries its audio, later pieces are answered at once."""

import asyncio
import contextlib
import time

import triton_python_backend_utils as pb

from engine import frontend
from engine.lifetime import LINGERING
from engine.orchestrator import Orchestrator
from engine.protocol import INVALID, LENGTH, SAMPLE_RATE, UNAVAILABLE, StreamFailed, Unavailable, tagged
from engine.text import TextTokenizer
from serving.config.model_options import TTSOptions
from serving.contract import TEXT_STREAMS_PER_PLACE, TTS_OUTPUTS
from serving.flow.generator_slots import GeneratorSlots
from serving.flow.places import Place, TextPlace
from serving.flow.receipts import Receipts
from serving.flow.side_channel import SideChannel
from serving.intake.request_inputs import tts_inputs
from serving.intake.requests import parse_request
from serving.intake.served import ServedModels
from serving.intake.text_streams import STREAMED, TextStreams, release_of, start_stream, take_piece
from serving.security.auth import Keys
from serving.stub.bls import BLS, PolledFlags, watch_request
from serving.stub.bls_adapters import BLSGenerator, BLSPrompts
from serving.stub.metric_batch import MetricBatch
from serving.stub.stub_threads import WARM_EXTRA_THREADS, Responses, StubThreads
from serving.stub.triton_io import checkpoint_path, error_response, setup_logging, tensors
from serving.stub.vocoder_batch import BLSVocoder
from serving.supervision.run_folder import RunFlags, start_heartbeat

log = setup_logging("tts")
FINAL = pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL
START = pb.TRITONSERVER_REQUEST_FLAG_SEQUENCE_START


def refuse(sender, message: str) -> None:
    """End a request as ``unavailable``: the server cannot take it now (busy, restarting, shutting down)."""
    sender.send(error_response(pb, Unavailable(message)), flags=FINAL)


class TritonPythonModel:
    def initialize(self, args):
        opts = TTSOptions.read(args)
        start_heartbeat(opts.run_dir, "tts")
        self.flags = RunFlags(opts.run_dir)  # set by the launcher: a backend failed, or draining
        self.polled = PolledFlags(self.flags)  # what running requests poll: one read for all of them
        tokenizer = TextTokenizer.from_dir(f"{checkpoint_path(opts.checkpoint)}/text_tokenizer")
        self.served = ServedModels.of(checkpoint_path(opts.checkpoint), opts.models)
        frontend.warm_up()
        keys = Keys.from_env("tts")
        self.threads = StubThreads("tts")
        self.threads.warm(opts.slots + WARM_EXTRA_THREADS)  # a stream's own generator request holds one
        bls = BLS(pb, opts.bls_timeout_seconds, keys.parameters(), self.flags)
        channel = SideChannel(opts.cancel_dir or None)
        slots = GeneratorSlots(channel.dir, "tts", opts.slots)  # streams wait here, not in Triton
        receipts = Receipts(channel.dir, "tts")  # its pipes' (docs/triton.md#T23)
        generator = BLSGenerator(bls, channel, keys.generator_model, slots, receipts, keys.new_stream_id)
        self.generator = generator
        vocoder = BLSVocoder(bls, opts.vocoder_batch)  # chunks due together: one request
        self.orchestrator = Orchestrator(BLSPrompts(bls), generator, vocoder, lambda text: len(tokenizer.encode(text)),
                                         keys.new_stream_id, starting=opts.starting)  # fmt: skip
        # Admission: ``slots`` streams generate, ``max_queue`` more wait; beyond that a request is refused
        # at once ("unavailable: server busy"), here and at tts_ensemble alike (one gate: serving.flow.side_channel).
        self.admission = channel.gate("tts", opts.capacity)
        self.text_streams = TextStreams(opts.text_idle_seconds, opts.text_max_seconds,
                                        TEXT_STREAMS_PER_PLACE * opts.capacity, lambda: TextPlace(self._place()))  # fmt: skip
        self.in_flight, self.waiting, self.metrics = 0, 0, MetricBatch(threaded=True)  # once per turn, off the loop
        self.requests = pb.MetricFamily("tts_requests_total", "tts requests by outcome", pb.MetricFamily.COUNTER)
        self.outcome = {k: self.requests.Metric(labels={"outcome": k}) for k in ("ok", "error", "cancelled", "busy")}
        self.gauges = [
            pb.MetricFamily("tts_requests_in_flight", "tts requests holding an admission place", pb.MetricFamily.GAUGE),
            pb.MetricFamily("tts_requests_waiting", "tts requests with no audio sent yet", pb.MetricFamily.GAUGE),
            pb.MetricFamily("tts_text_streams_open", "text-in streams open", pb.MetricFamily.GAUGE),
        ]
        self.in_flight_gauge, self.waiting_gauge, self.open_gauge = (g.Metric() for g in self.gauges)
        self.audio_family = pb.MetricFamily("tts_audio_seconds_total", "audio streamed", pb.MetricFamily.COUNTER)
        self.audio_seconds = self.audio_family.Metric()
        self.first_family = pb.MetricFamily(
            "tts_first_chunk_seconds", "request arrival to first audio chunk sent", pb.MetricFamily.HISTOGRAM
        )
        self.first_chunk = self.first_family.Metric(
            buckets=[0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 10.0]
        )

    async def execute(self, requests):
        await self.threads.serve(requests, self._serve)

    async def _serve(self, request):
        # Nothing awaits before a piece is handed over: a sequence's requests are taken in their tasks' order.
        key = request.correlation_id()
        if key and not request.flags() & START:  # a text-in stream's later piece: answered at once
            error = take_piece(pb, self.text_streams, request, key)
            request.get_response_sender().send(error and error_response(pb, error), flags=FINAL)
            return
        sender = request.get_response_sender()
        refusal = self.flags.refusal()  # the launcher restarts or stops the server
        if refusal:
            refuse(sender, refusal)
            return
        stream, place = None, self._place()  # serving.flow.places: a text-in stream's is taken by its text
        if key:  # a text-in stream: its first piece
            stream, error = start_stream(pb, self.text_streams, request, key)
            if error:
                self.metrics.increment(self.outcome["busy" if error.startswith(UNAVAILABLE) else "error"], 1)
                sender.send(error_response(pb, error), flags=FINAL)
                return
            place = stream.place.place
            self.metrics.set(self.open_gauge, len(self.text_streams.open))
        elif not place.take():
            self.metrics.increment(self.outcome["busy"], 1)
            refuse(sender, self.admission.busy_message())
            return
        try:
            lingering: set = set()
            LINGERING.set(lingering)  # this task's context, and so the stream task's: see engine.lifetime
            await self._serve_admitted(request, Responses(sender, self.threads.sends), lingering, stream, place)
        finally:
            if stream is not None:
                self.text_streams.close(stream)  # gives its place back
                self.metrics.set(self.open_gauge, len(self.text_streams.open))
            place.give()

    def _place(self) -> Place:  # a request's admission place, counted in the gauges
        return Place(self.admission, self._count)

    def _count(self, in_flight: int, waiting: int) -> None:
        self.in_flight += in_flight
        self.waiting += waiting
        self.metrics.set(self.in_flight_gauge, self.in_flight)
        self.metrics.set(self.waiting_gauge, self.waiting)

    async def _serve_admitted(self, request, responses: Responses, lingering: set, stream, place: Place):
        task = asyncio.ensure_future(self._stream(request, responses, stream, place))
        # the orchestrator cleans up a cancelled one
        broken = await watch_request(task, request, self.polled, lingering)
        if broken:  # the server is about to be replaced
            self.metrics.increment(self.outcome["error"], 1)
            return await responses.final(error_response(pb, Unavailable(broken)), FINAL)
        try:
            final, samples = task.result()
        except asyncio.CancelledError:
            self.metrics.increment(self.outcome["cancelled"], 1)
            await responses.final(flags=FINAL)
        except Exception as e:
            self.metrics.increment(self.outcome["error"], 1)
            message = e.reason if isinstance(e, StreamFailed) else tagged(e)
            if not message.startswith(INVALID) and not isinstance(e, ValueError):  # (a stream failed busy)
                log.error("request failed: %s", message,
                          exc_info=not isinstance(e, StreamFailed | TimeoutError | Unavailable))  # fmt: skip
            await responses.final(error_response(pb, message), FINAL)
        else:
            values = {"AUDIO": final.audio, "FINISH_REASON": final.finish_reason}
            await responses.final(pb.InferenceResponse(tensors(pb, TTS_OUTPUTS, values, batch=False)), FINAL)
            self.metrics.increment(self.outcome["ok"], 1)
            self.metrics.increment(self.audio_seconds, samples / SAMPLE_RATE)

    async def _stream(self, request, responses: Responses, stream, place: Place):
        """Run one request (``stream``: its text-in stream, or None; ``place``: its admission place), sending
        all but the final piece; returns that piece and the samples in all."""
        t0, waiting = time.perf_counter(), True
        inputs = tts_inputs(pb, request, None if stream is None else STREAMED)
        release = None if stream is None else release_of(pb, request)
        speech = parse_request(inputs, self.served)  # checked once: what follows trusts it
        utterance = speech.utterance
        sent = 0
        run = (self.orchestrator.run(utterance, speech.voice) if stream is None
               else self.orchestrator.run_text(utterance, speech.voice, stream.read(), release,
                                               stream.place.idle))  # fmt: skip
        async with contextlib.aclosing(run) as pieces:
            async for piece in pieces:
                # Instruct's plan (maybe "") before any audio, a text-in stream's flush mark: own responses
                mark = {"FLUSHED": piece.flushed} if piece.flushed else {"PLAN_TEXT": piece.text}
                if piece.flushed or piece.text is not None:
                    await responses.send(pb.InferenceResponse(tensors(pb, TTS_OUTPUTS, mark, batch=False)))
                    continue
                if piece.audio.size:
                    place.audio()  # (a text stream's place waits anew each time its text takes it)
                    if waiting:
                        self.metrics.observe(self.first_chunk, time.perf_counter() - t0)
                        waiting = False
                sent += piece.audio.size
                if piece.final:
                    if piece.finish_reason == LENGTH:
                        log.warning("a segment reached max_patches (%d); its text may be cut",
                                    utterance.params.max_patches)  # fmt: skip
                    return piece, sent
                chunk = tensors(pb, TTS_OUTPUTS, {"AUDIO": piece.audio}, batch=False)
                await responses.send(pb.InferenceResponse(chunk))  # on a thread: the loop serves others meanwhile
        raise RuntimeError("the orchestrator ended without a final piece")

    def finalize(self):
        self.generator.close()
        self.threads.shutdown()
