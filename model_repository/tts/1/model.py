"""tts: the decoupled front door. Orchestrates prompt_encoder -> generator -> vocoder with async BLS
and streams AUDIO chunks to the client; every request ends with exactly one final response."""

import asyncio
import concurrent.futures
import contextlib
import itertools
import secrets
import time

import numpy as np
import triton_python_backend_utils as pb

from engine.cancel import CancelBoard
from engine.frontdoor import build_request
from engine.segments import Joiner, segment_schedule, split_text
from engine.text import TextTokenizer
from engine.triton_model import (
    bytes_tensor,
    checkpoint_path,
    generator_inputs,
    get,
    model_parameters,
    scalar,
    setup_logging,
    string,
)

log = setup_logging("tts")
FINAL = pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL
SR = 24000


class Cancelled(Exception):
    pass


class GeneratorFailed(Exception):
    def __init__(self, message: str, invalid: bool):
        super().__init__(message)
        self.invalid = invalid


class TritonPythonModel:
    def initialize(self, args):
        params = model_parameters(args)
        self.tokenizer = TextTokenizer.from_dir(f"{checkpoint_path(params)}/text_tokenizer")
        self.timeout = float(params.get("bls_timeout_seconds", 120))
        self.cancels = CancelBoard(params.get("cancel_dir") or None)
        self.ids = itertools.count(secrets.randbits(40) << 20)  # correlation ids unique per server
        # iterating a decoupled BLS stream blocks, so it happens on threads, one per live stream
        self.pool = concurrent.futures.ThreadPoolExecutor(max_workers=512, thread_name_prefix="tts-bls")
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
        t0 = time.perf_counter()
        sender = request.get_response_sender()
        try:
            req = build_request(
                string(pb, request, "TEXT", ""), string(pb, request, "LANGUAGE", ""),
                get(pb, request, "REF_AUDIO", required=False), scalar(pb, request, "REF_SAMPLE_RATE", 0),
                string(pb, request, "REF_TEXT", ""), string(pb, request, "VOICE_ID", ""),
                scalar(pb, request, "SEED", 1234), request.parameters(),
            )  # fmt: skip
            samples = await self._stream(request, sender, req, t0)
            self.outcome["ok"].increment(1)
            self.audio_seconds.increment(samples / SR)
        except Cancelled:
            self.outcome["cancelled"].increment(1)
            sender.send(flags=FINAL)
        except Exception as e:
            self.outcome["error"].increment(1)
            invalid = isinstance(e, ValueError) or getattr(e, "invalid", False)
            if not invalid:
                log.exception("request failed")
            code = pb.TritonError.INVALID_ARG if invalid else pb.TritonError.INTERNAL
            sender.send(pb.InferenceResponse(error=pb.TritonError(str(e), code)), flags=FINAL)

    async def _call(self, model, inputs, outputs, **kw):
        r = pb.InferenceRequest(model_name=model, inputs=inputs, requested_output_names=outputs,
                                timeout=int(self.timeout * 1e6), **kw)  # fmt: skip
        resp = await r.async_exec()
        if resp.has_error():
            msg = resp.error().message()
            raise (ValueError if resp.error().code() == pb.TritonError.INVALID_ARG else RuntimeError)(msg)
        return {n: pb.get_output_tensor_by_name(resp, n).as_numpy() for n in outputs}

    async def _stream(self, request, sender, req, t0) -> int:
        """Prompt once, then each text segment through generator and vocoder, cross-faded; returns samples."""
        inputs = [bytes_tensor(pb, "REF_TEXT", req.ref_text), bytes_tensor(pb, "VOICE_ID", req.voice_id)]
        if req.ref_audio is not None:
            inputs += [
                pb.Tensor("REF_AUDIO", req.ref_audio[None]),
                pb.Tensor("REF_SAMPLE_RATE", np.array([[req.ref_sample_rate]], np.int32)),
            ]
        prompt = await self._call("prompt_encoder", inputs, ["PROMPT_LATENTS", "SPEAKER", "PROMPT_TEXT"])
        prompt_text = prompt["PROMPT_TEXT"].reshape(-1)[0].decode("utf-8")
        segments = split_text(req.text, lambda t: len(self.tokenizer.encode(t)), req.split_tokens)
        joiner, total, reasons, first, tail = Joiner(), 0, [], True, np.zeros(0, np.float32)
        for i, segment in enumerate(segments):
            more = i < len(segments) - 1
            tokens = np.array(self.tokenizer.encode_prompt(segment, req.language, prompt_text), np.int64)
            joiner.start_segment()
            chunks = self._segment(request, req, prompt, tokens, segment_schedule(i, req.schedule))
            async with contextlib.aclosing(chunks):  # an error here still ends the segment's streams
                async for audio, reason in chunks:
                    if reason is not None:
                        reasons.append(reason)
                    out = joiner.push(audio, more)
                    if more or reason is None:  # the last segment's tail goes out with the final response
                        if out.size:
                            sender.send(pb.InferenceResponse([pb.Tensor("AUDIO", out)]))
                            total += out.size
                            if first:
                                self.first_chunk.observe(time.perf_counter() - t0)
                                first = False
                    else:
                        tail = out
        tail = np.concatenate([tail, joiner.finish()])
        reason = "length" if "length" in reasons else "stop"
        if reason == "length":
            log.warning("a segment reached max_patches (%d); its text may be cut", req.params.max_patches)
        final = [pb.Tensor("AUDIO", tail), bytes_tensor(pb, "FINISH_REASON", reason, batch=False)]
        sender.send(pb.InferenceResponse(final), flags=FINAL)
        return total + tail.size

    async def _segment(self, request, req, prompt, tokens, schedule):
        """Yield (audio, None) per vocoder chunk of one segment, then (tail audio, finish reason)."""
        latents, p = prompt["PROMPT_LATENTS"], req.params  # (1, L, 64)
        gen_inputs = generator_inputs(pb, tokens, latents, prompt["SPEAKER"], p, schedule)
        cid = next(self.ids)
        gen = pb.InferenceRequest(model_name="generator", inputs=gen_inputs, requested_output_names=["LATENTS", "FINISH_REASON"],
                                  correlation_id=cid, flags=pb.TRITONSERVER_REQUEST_FLAG_SEQUENCE_START)  # fmt: skip
        stream = await gen.async_exec(decoupled=True)
        watcher = asyncio.ensure_future(self._watch(request, cid))
        loop = asyncio.get_running_loop()
        vflags, reason, voc_started = pb.TRITONSERVER_REQUEST_FLAG_SEQUENCE_START, "stop", False
        try:
            while True:
                resp = await asyncio.wait_for(loop.run_in_executor(self.pool, next, stream, None), self.timeout)
                if request.is_cancelled():
                    raise Cancelled()
                if resp is None:
                    break
                if resp.has_error():
                    e = resp.error().message()
                    raise GeneratorFailed(f"generator: {e}", resp.error().code() == pb.TritonError.INVALID_ARG)
                fr = pb.get_output_tensor_by_name(resp, "FINISH_REASON")
                if fr is not None:
                    reason = fr.as_numpy().reshape(-1)[0].decode("utf-8")
                    if reason == "cancelled":
                        raise Cancelled()
                t = pb.get_output_tensor_by_name(resp, "LATENTS")
                if t is None:
                    continue
                vin = [pb.Tensor("LATENTS", t.as_numpy())]
                if not voc_started:
                    vin.append(pb.Tensor("PROMPT_LATENTS", latents))
                audio = (await self._call("vocoder", vin, ["AUDIO"], correlation_id=cid, flags=vflags))["AUDIO"]
                voc_started, vflags = True, 0
                yield audio.reshape(-1), None
            if not voc_started:
                raise RuntimeError("generator produced no audio")
            tail = (await self._end_vocoder(cid))["AUDIO"]
        except BaseException as e:
            ended = isinstance(e, GeneratorFailed) or reason == "cancelled"  # the generator stream is over
            if not ended and not (watcher.done() and not watcher.cancelled()):
                self.cancels.mark(cid)  # the generator ends the stream at its next step
            if voc_started:  # free the vocoder state now rather than at its idle timeout
                try:
                    await self._end_vocoder(cid)
                except Exception:
                    log.warning("could not end vocoder stream %s", cid)
            raise
        finally:
            watcher.cancel()
        yield tail.reshape(-1), reason

    async def _end_vocoder(self, cid):
        empty = pb.Tensor("LATENTS", np.zeros((1, 0, 64), np.float32))
        return await self._call(
            "vocoder", [empty], ["AUDIO"], correlation_id=cid, flags=pb.TRITONSERVER_REQUEST_FLAG_SEQUENCE_END
        )

    async def _watch(self, request, cid):
        """Poll for client cancellation while the stream runs, so the slot frees within one step."""
        while True:
            await asyncio.sleep(0.05)
            if request.is_cancelled():
                self.cancels.mark(cid)
                return

    def finalize(self):
        self.pool.shutdown(wait=False, cancel_futures=True)
