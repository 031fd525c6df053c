"""ensemble_generator: tts_ensemble's generation step (docs/architecture.md, "Other entry points"). One
generator stream per request, admitted as tts's are, its sealed chunks sent on as its own responses; one
final response, a normal one even on failure, its FINISH_REASON the tagged reason (docs/triton.md#T12)."""

import asyncio
import contextlib

import triton_python_backend_utils as pb

from engine.orchestrator import Segment
from engine.protocol import Chunk, StreamFailed, Unavailable, end_chunk, failure_reason, tagged
from serving import contract
from serving.config.model_options import EnsembleGeneratorOptions
from serving.flow.admission import Place
from serving.intake.requests import check_language, check_text
from serving.security.auth import parameter_dict
from serving.stub.bls import watch_request
from serving.stub.entry import Entry
from serving.stub.metric_batch import family, release
from serving.stub.stub_threads import Responses
from serving.stub.triton_io import (
    SPOKEN_TEXT_CHARS,
    chunk_tensors,
    get,
    latent_rows,
    scalar,
    setup_logging,
    string,
)

log = setup_logging("ensemble_generator")
FINAL = pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL
# An ensemble has no sequence to continue: its generator stream gets an id of ours, so a client's
# sequence id (older clients sent one; over HTTP it comes as one of Triton's own parameters) is ignored.
TRITON_SEQUENCE_PARAMETERS = ("sequence_id", "sequence_start", "sequence_end")


class TritonPythonModel:
    def initialize(self, args):
        self.entry = Entry(pb, "ensemble_generator", EnsembleGeneratorOptions.read(args))
        outcomes = family(pb, "tts_ensemble_requests_total", "tts_ensemble streams by outcome", "COUNTER")
        self.outcome = {k: outcomes.Metric(labels={"outcome": k}) for k in ("ok", "error", "cancelled", "busy")}
        self.in_flight = family(pb, "tts_ensemble_requests_in_flight", "tts_ensemble streams generating or waiting",
                                "GAUGE").Metric()  # fmt: skip

    async def execute(self, requests):
        await self.entry.threads.serve(requests, self._serve)  # on the stub's threads (serving.stub.stub_threads)

    async def _serve(self, request):
        sender = request.get_response_sender()
        # its place, one gate with tts's (serving.flow.admission), in the gauge (increment(), not set(): T19)
        place = Place(self.entry.admission, lambda held, _: self.in_flight.increment(held))
        refusal = self.entry.channel.refusal()  # the launcher restarts or stops the server
        if refusal or not place.take():
            if not refusal:
                self.outcome["busy"].increment(1)
            last = end_chunk(0, tagged(Unavailable(refusal or self.entry.admission.busy_message())))
            return sender.send(pb.InferenceResponse(chunk_tensors(pb, last)), flags=FINAL)
        try:
            last = await self._watch(request, Responses(sender, self.entry.threads.sends))
        finally:
            place.give()
        outcome = "cancelled" if last is None or last.finish_reason == "cancelled" else "error" if last.failed else "ok"
        self.outcome[outcome].increment(1)

    async def _watch(self, request, responses: Responses) -> Chunk | None:
        """Run the stream, watching for a cancelled caller or a failed server; send its final response
        (after the last is_cancelled(): docs/triton.md#T3)."""
        stream_id = self.entry.keys.new_stream_id()
        # a direct caller that leaves is seen here; an ensemble's client never is (the vocoder sees it)
        task, broken = await watch_request(request, self._relay(request, responses, stream_id), self.entry.channel)
        try:
            if broken:  # the server is about to be replaced
                with contextlib.suppress(BaseException):
                    await task
                raise StreamFailed(tagged(Unavailable(broken)))
            last = task.result()
        except asyncio.CancelledError:
            await responses.final(flags=FINAL)
            return None
        except Exception as e:
            if not isinstance(e, ValueError | StreamFailed | TimeoutError):
                log.exception("ensemble stream failed")
            last = end_chunk(stream_id, e.reason if isinstance(e, StreamFailed) else failure_reason(e))
        await responses.final(pb.InferenceResponse(chunk_tensors(pb, last)), FINAL)
        return last

    async def _relay(self, request, responses: Responses, stream_id: int) -> Chunk:
        """Send the generator's chunks on as they come, all but the last, which is returned."""
        segment = read_segment(request, stream_id)
        async with contextlib.aclosing(self.entry.generator.stream(segment)) as chunks:
            async for chunk in chunks:
                if chunk.last:
                    return chunk
                await responses.send(pb.InferenceResponse(chunk_tensors(pb, chunk)))
        raise StreamFailed("error: the generator stream ended without a last chunk")

    def finalize(self):
        self.entry.finalize()
        release(self)


def read_segment(request, stream_id: int) -> Segment:
    """The request as one generator stream; ValueError naming the input, each size bounded by the
    contract before anything is copied (this model takes requests from anyone)."""
    latents = latent_rows(get(pb, request, "PROMPT_LATENTS"), "PROMPT_LATENTS", contract.MAX_PROMPT_LATENTS)
    speaker = get(pb, request, "SPEAKER")
    if speaker.size != contract.SPEAKER_DIM:
        raise ValueError(f"SPEAKER has {speaker.size} values; expected {contract.SPEAKER_DIM}")
    text = check_text(string(pb, request, "TEXT"), limit=SPOKEN_TEXT_CHARS)
    language = check_language(string(pb, request, "LANGUAGE", "")) or ""
    prompt_text = check_text(string(pb, request, "PROMPT_TEXT", ""), "PROMPT_TEXT", required=False)
    prompt = {"PROMPT_LATENTS": latents, "SPEAKER": speaker.reshape(-1), "PROMPT_TEXT": prompt_text}
    given = {k: v for k, v in parameter_dict(request.parameters()).items() if k not in TRITON_SEQUENCE_PARAMETERS}
    params, schedule = contract.decode_settings(scalar(pb, request, "SEED", None), given, contract.ENSEMBLE_PARAMETERS)
    return Segment(stream_id, text, language, prompt, params, schedule)
