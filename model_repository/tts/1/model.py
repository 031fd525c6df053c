"""tts: the decoupled front door (docs/architecture.md, "One request, hop by hop"): the orchestrator over BLS,
AUDIO chunks streamed, exactly one final response. A text-in stream's later pieces and pace requests are
answered at once (serving.intake.text_streams, serving.flow.pacing)."""

import asyncio
import contextlib
import time

import triton_python_backend_utils as pb

from engine import frontend
from engine.orchestrator import Orchestrator
from engine.protocol import INVALID, LENGTH, SAMPLE_RATE, UNAVAILABLE, StreamFailed, Unavailable, tagged
from engine.start_window import CLIENT_PAUSES
from engine.text import TextTokenizer
from serving.config.model_options import TTSOptions
from serving.contract import TEXT_STREAMS_PER_PLACE, TTS_OUTPUTS
from serving.flow.admission import Place, TextPlace
from serving.flow.pace_board import PaceBoard
from serving.flow.pacing import DELIVERED, PACING, Pacer, PaceTable
from serving.intake.request_inputs import tts_inputs
from serving.intake.requests import ServedModels, parse_request
from serving.intake.text_streams import STREAMED, TextStreams, release_of, start_stream, take_piece
from serving.security.auth import parameter_dict
from serving.stub.bls import watch_request
from serving.stub.bls_adapters import BLSPrompts
from serving.stub.entry import Entry
from serving.stub.metric_batch import MetricBatch, TTSMetrics, release
from serving.stub.stub_threads import Responses
from serving.stub.triton_io import checkpoint_path, error_response, setup_logging, tensors
from serving.stub.vocoder_batch import BLSVocoder

log = setup_logging("tts")
FINAL = pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL
START = pb.TRITONSERVER_REQUEST_FLAG_SEQUENCE_START
# Triton hands each request to any instance: a sequence's pieces would reach others than its START's
ONE_INSTANCE = INVALID + "text-in streams need --tts-instances 1 (this server runs {n} tts instances)"


class TritonPythonModel:
    def initialize(self, args):
        opts = TTSOptions.read(args)
        self.instances = n = opts.tts_instances  # (each a process: what they share is per run)
        self.entry = e = Entry(pb, "tts", opts, opts.start_rate, n)  # admission, BLS, pipe, threads, flags
        tokenizer = TextTokenizer.from_dir(f"{checkpoint_path(opts.checkpoint)}/text_tokenizer")
        self.served = ServedModels.of(checkpoint_path(opts.checkpoint), opts.models)
        frontend.warm_up()
        board = PaceBoard(e.channel.dir) if n > 1 else None  # a pace request reaches any instance
        self.paces = PaceTable(opts.pace_hold_seconds, e.receipts.hold, e.receipts.release, board)  # by token
        vocoder = BLSVocoder(e.bls, opts.vocoder_batch)  # chunks due together: one request
        self.orchestrator = Orchestrator(BLSPrompts(e.bls), e.generator, vocoder,
                                         lambda text: len(tokenizer.encode(text)), e.keys.new_stream_id,
                                         starts=e.admission.starts, slots=e.admission, **opts.read_ahead())  # fmt: skip
        self.text_streams = TextStreams(opts.text_idle_seconds, opts.text_max_seconds,
                                        TEXT_STREAMS_PER_PLACE * opts.capacity, lambda: TextPlace(self._place()))  # fmt: skip
        self.metrics = MetricBatch(threaded=True)  # once per turn, off the loop
        self.families = m = TTSMetrics(pb, self.metrics, e.admission.starts)
        self.outcome, self.audio_seconds, self.first_chunk = m.outcome, m.audio_seconds, m.first_chunk

    async def execute(self, requests):
        await self.entry.threads.serve(requests, self._serve)  # on the stub's threads (serving.stub.stub_threads)

    async def _serve(self, request):
        # Nothing awaits before a piece is handed over: a sequence's requests are taken in their tasks' order.
        raw, key, sender = request.parameters(), request.correlation_id(), request.get_response_sender()
        parameters = {}  # parsed once; {} when malformed (parse_request names the fault)
        with contextlib.suppress(ValueError):
            parameters = parameter_dict(raw)
        if key and self.instances > 1:  # a text-in stream: Triton hands its pieces to any instance
            return sender.send(error_response(pb, ONE_INSTANCE.format(n=self.instances)), flags=FINAL)
        if DELIVERED in parameters or key and not request.flags() & START:  # answered at once, before any admission
            error = (self.paces.answer(parameters, time.monotonic()) if DELIVERED in parameters  # a pace request
                     else take_piece(pb, self.text_streams, request, key))  # a text-in stream's later piece  # fmt: skip
            return sender.send(error and error_response(pb, error), flags=FINAL)
        if refusal := self.entry.channel.refusal():  # the launcher restarts or stops the server
            return sender.send(error_response(pb, Unavailable(refusal)), flags=FINAL)
        try:  # its pacer (a token names a paced request: one running request's at a time)
            pacer = self.paces.start(parameters, time.monotonic())
        except ValueError as e:
            self.metrics.increment(self.outcome["error"], 1)
            return sender.send(error_response(pb, str(e)), flags=FINAL)
        try:
            await self._admit(request, sender, key, pacer, parameters or raw)
        finally:
            self.paces.end(pacer)

    async def _admit(self, request, sender, key: int, pacer: Pacer, parameters):
        stream, place = None, self._place()  # serving.flow.admission: a text-in stream's is taken by its text
        if key:  # a text-in stream: its first piece
            stream, error = start_stream(pb, self.text_streams, request, key)
            if error:
                self.metrics.increment(self.outcome["busy" if error.startswith(UNAVAILABLE) else "error"], 1)
                return sender.send(error_response(pb, error), flags=FINAL)
            place = stream.place.place
            self.families.streams_open(len(self.text_streams.open))
        elif not place.take():
            self.metrics.increment(self.outcome["busy"], 1)
            return sender.send(error_response(pb, Unavailable(self.entry.admission.busy_message())), flags=FINAL)
        try:
            PACING.set(pacer)  # this task's context, and so its generator streams': serving.stub.bls_adapters
            CLIENT_PAUSES.set(lambda: pacer.pauses)  # and its start window's (engine.start_window)
            responses = Responses(sender, self.entry.threads.sends)  # sent on a thread: the loop serves others
            run = self._stream(request, parameters, responses, stream, place, pacer)
            await self._serve_admitted(request, run, responses, pacer)
        finally:
            if stream is not None:
                self.text_streams.close(stream)  # gives its place back
                self.families.streams_open(len(self.text_streams.open))
            place.give()

    def _place(self) -> Place:  # a request's admission place, counted in the gauges
        return Place(self.entry.admission, self.families.count)

    async def _serve_admitted(self, request, run, responses: Responses, pacer: Pacer):
        # the orchestrator cleans up a cancelled one (its client left, or took no audio for the hold bound)
        task, broken = await watch_request(request, run, self.entry.channel, pacer.held)
        if broken:  # the server is about to be replaced
            self.metrics.increment(self.outcome["error"], 1)
            return await responses.final(error_response(pb, Unavailable(broken)), FINAL)
        try:
            final, samples = task.result()
        except asyncio.CancelledError:
            self.metrics.increment(self.outcome["error" if pacer.held_out else "cancelled"], 1)
            await responses.final(error_response(pb, pacer.failure) if pacer.held_out else None, FINAL)
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

    async def _stream(self, request, parameters, responses: Responses, stream, place: Place, pacer: Pacer):
        """Run one request (``parameters``: its own, parsed or as sent; ``stream``: its text-in stream, or None;
        ``place``: its admission place; ``pacer``: a paced request's), sending all but the final piece; returns
        that piece and the samples in all."""
        t0, waiting, sent = time.perf_counter(), True, 0
        inputs = tts_inputs(pb, request, parameters, None if stream is None else STREAMED)
        text_release = None if stream is None else release_of(pb, request)
        speech = parse_request(inputs, self.served)  # checked once: what follows trusts it
        utterance = speech.utterance
        pacer.paced_by(utterance.schedule, utterance.speed)
        run = (self.orchestrator.run(utterance, speech.voice) if stream is None
               else self.orchestrator.run_text(utterance, speech.voice, stream.read(), text_release,
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
                pacer.on_sent(sent / SAMPLE_RATE, time.monotonic())
        raise RuntimeError("the orchestrator ended without a final piece")

    def finalize(self):
        self.entry.finalize()
        self.metrics.sender.shutdown()  # its updates sent: nothing moves the metrics now
        release(self)
