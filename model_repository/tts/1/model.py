"""tts: the decoupled front door. Parses a request, runs the orchestrator (engine.orchestrator) over BLS
calls to prompt_encoder, generator and vocoder (serving.bls), and streams AUDIO chunks to the client;
every request ends with exactly one final response."""

import asyncio
import concurrent.futures
import contextlib
import time

import triton_python_backend_utils as pb

from engine.orchestrator import LENGTH, Orchestrator, StreamFailed
from engine.text import TextTokenizer
from serving.bls import BLS, BLSGenerator, BLSPrompts, BLSVocoder
from serving.cancel import CancelBoard
from serving.contract import SAMPLE_RATE, TTS_OUTPUTS
from serving.requests import build_request
from serving.triton_io import checkpoint_path, get, model_parameters, scalar, setup_logging, string, tensors

log = setup_logging("tts")
FINAL = pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL
CANCEL_POLL_SECONDS = 0.05  # how often a running request checks whether its client went away


class TritonPythonModel:
    def initialize(self, args):
        params = model_parameters(args)
        tokenizer = TextTokenizer.from_dir(f"{checkpoint_path(params)}/text_tokenizer")
        # iterating a decoupled BLS stream blocks, so it happens on threads, one per live stream
        self.pool = concurrent.futures.ThreadPoolExecutor(max_workers=512, thread_name_prefix="tts-bls")
        bls = BLS(pb, float(params.get("bls_timeout_seconds", 120)), self.pool)
        cancels = CancelBoard(params.get("cancel_dir") or None)
        self.orchestrator = Orchestrator(BLSPrompts(bls), BLSGenerator(bls, cancels), BLSVocoder(bls),
                                         lambda text: len(tokenizer.encode(text)))  # fmt: skip
        self.requests = pb.MetricFamily("tts_requests_total", "tts requests by outcome", pb.MetricFamily.COUNTER)
        self.outcome = {k: self.requests.Metric(labels={"outcome": k}) for k in ("ok", "error", "cancelled")}
        self.audio_family = pb.MetricFamily("tts_audio_seconds_total", "audio streamed", pb.MetricFamily.COUNTER)
        self.audio_seconds = self.audio_family.Metric()
        self.first_family = pb.MetricFamily(
            "tts_first_chunk_seconds", "request arrival to first audio chunk sent", pb.MetricFamily.HISTOGRAM
        )
        self.first_chunk = self.first_family.Metric(
            buckets=[0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 10.0]
        )

    async def execute(self, requests):
        await asyncio.gather(*(self._serve(r) for r in requests))
        return None

    async def _serve(self, request):
        sender = request.get_response_sender()
        task = asyncio.ensure_future(self._stream(request, sender))
        # A cancelled client cancels the task and the orchestrator cleans up. The final response is sent
        # here, after the task: asking is_cancelled() once it has gone out crashes tritonserver 2.51.
        while not task.done():
            await asyncio.wait({task}, timeout=CANCEL_POLL_SECONDS)
            if not task.done() and request.is_cancelled():
                task.cancel()  # again each poll: Python 3.11's wait_for can swallow one cancellation
        try:
            final, samples = task.result()
        except asyncio.CancelledError:
            self.outcome["cancelled"].increment(1)
            sender.send(flags=FINAL)
        except Exception as e:
            self.outcome["error"].increment(1)
            invalid = isinstance(e, ValueError) or getattr(e, "invalid", False)
            if not invalid:
                log.error("request failed: %s", e, exc_info=not isinstance(e, StreamFailed | TimeoutError))
            code = pb.TritonError.INVALID_ARG if invalid else pb.TritonError.INTERNAL
            sender.send(pb.InferenceResponse(error=pb.TritonError(str(e), code)), flags=FINAL)
        else:
            values = {"AUDIO": final.audio, "FINISH_REASON": final.finish_reason}
            sender.send(pb.InferenceResponse(tensors(pb, TTS_OUTPUTS, values, batch=False)), flags=FINAL)
            self.outcome["ok"].increment(1)
            self.audio_seconds.increment(samples / SAMPLE_RATE)

    async def _stream(self, request, sender):
        """Run one request, sending all but the final piece; returns that piece and the samples in all."""
        t0 = time.perf_counter()
        utterance, voice = build_request(
            string(pb, request, "TEXT", ""), string(pb, request, "LANGUAGE", ""),
            get(pb, request, "REF_AUDIO", required=False), scalar(pb, request, "REF_SAMPLE_RATE", 0),
            string(pb, request, "REF_TEXT", ""), string(pb, request, "VOICE_ID", ""),
            scalar(pb, request, "SEED", None), request.parameters(),
        )  # fmt: skip
        sent = 0
        async with contextlib.aclosing(self.orchestrator.run(utterance, voice)) as pieces:
            async for piece in pieces:
                if sent == 0 and piece.audio.size:
                    self.first_chunk.observe(time.perf_counter() - t0)
                sent += piece.audio.size
                if piece.final:
                    if piece.finish_reason == LENGTH:
                        log.warning("a segment reached max_patches (%d); its text may be cut",
                                    utterance.params.max_patches)  # fmt: skip
                    return piece, sent
                sender.send(pb.InferenceResponse(tensors(pb, TTS_OUTPUTS, {"AUDIO": piece.audio}, batch=False)))
        raise RuntimeError("the orchestrator ended without a final piece")

    def finalize(self):
        self.pool.shutdown(wait=False, cancel_futures=True)
