"""prompt_encoder: reference audio + transcript (or a named voice) -> voice prompt, kept in the persistent
voice store (a clip seen before is not encoded again, also after a restart; named voices are registered here,
REGISTER_NAME, and looked up by VOICE_ID). For tts_ensemble it also runs the text front end on TEXT."""

import os

import triton_python_backend_utils as pb

from engine import frontend
from engine.protocol import Unavailable
from serving import contract
from serving.config.model_options import PromptEncoderOptions
from serving.flow.admission import Admission
from serving.flow.side_channel import SideChannel
from serving.intake.requests import Voice, check_language, check_text, check_voice
from serving.security.auth import Keys, Refused
from serving.stub.metric_batch import family, release
from serving.stub.triton_io import answer_each, get, load_model, scalar, setup_logging, string, tensors
from serving.supervision.run_folder import start_heartbeat
from serving.voices.voice_store import VoiceNotFound, VoiceStore

log = setup_logging("prompt_encoder")
ENCODER_NICENESS = 10


class TritonPythonModel:
    def initialize(self, args):
        opts = PromptEncoderOptions.read(args)
        start_heartbeat(opts.run_dir, "prompt_encoder")
        # Encoding is admission work: the streams already running (generator, vocoder, tts) get the CPU
        # first. 8 running + 16 arriving on 2 cores: longest chunk gap 1.17-1.68x of nothing arriving,
        # 0.95-1.47x with this.
        os.nice(ENCODER_NICENESS)
        self.model = load_model(opts, parts=("encoder", "campp"))
        self.store = VoiceStore(opts.voice_dir or None, self.model.identity, self.model.encode_prompt,
                                opts.max_anonymous_voices, int(opts.voice_store_max_gb * 1e9))  # fmt: skip
        self.keys = Keys.from_env("prompt_encoder", opts.public_steps)
        # tts_ensemble's first step: a busy server refuses it here, before any encoding (the place itself
        # is taken by ensemble_generator, the step that generates)
        self.admission = Admission(SideChannel(opts.cancel_dir or None).dir, None, opts.capacity)
        frontend.warm_up()  # wetext's grammars, before tts_ensemble's first request
        self.encodes = family(pb, "tts_prompt_encodes_total", "reference clips encoded", "COUNTER").Metric()
        self.hits = family(pb, "tts_prompt_cache_hits_total", "voice prompts served from the store", "COUNTER").Metric()
        log.info("voice store at %s (checkpoint %s)", self.store.root, self.model.identity)

    def _prompt(self, r, trusted: bool):
        voice, register = _voice(r, trusted)
        if voice.voice_id:
            try:
                return self.store.get(voice.voice_id)
            except VoiceNotFound as e:  # an unknown VOICE_ID is the request's fault
                raise ValueError(f"VOICE_ID: {e}") from None
        if voice.ref_audio is None:
            return self.model.encode_prompt(None)
        audio, sr, text = voice.ref_audio, voice.ref_sample_rate, voice.ref_text
        if register:
            return self.store.register(register, audio, sr, text)
        return self.store.prompt_for_audio(audio, sr, text)[0]

    @staticmethod
    def _spoken(r) -> tuple[str, str]:
        """tts_ensemble's TEXT through the front end as one segment (tts sends no TEXT: ("", ""))."""
        text = string(pb, r, "TEXT", "")
        if not text:
            return "", ""
        language = check_language(string(pb, r, "LANGUAGE", ""))
        prepared = frontend.prepare(check_text(text), language, len, split_tokens=0)
        return prepared.segments[0], prepared.language

    def execute(self, requests):
        encodes, hits = self.store.encodes, self.store.hits
        out = answer_each(pb, requests, self._answer, log)
        self.encodes.increment(self.store.encodes - encodes)
        self.hits.increment(self.store.hits - hits)
        return out

    def _answer(self, r):
        trusted = self.keys.split(r.parameters())[1]
        self.keys.admit(trusted, "prompt_encoder")
        if not trusted and self.admission.full():
            raise Unavailable(self.admission.busy_message())
        spoken, language = self._spoken(r)  # first: unspeakable text fails before any encoding
        prompt = self._prompt(r, trusted)
        values = {"PROMPT_LATENTS": prompt.latents.numpy(), "SPEAKER": prompt.speaker.numpy(),
                  "PROMPT_TEXT": prompt.text, "SPOKEN_TEXT": spoken, "SPOKEN_LANGUAGE": language}  # fmt: skip
        return pb.InferenceResponse(tensors(pb, contract.PROMPT_OUTPUTS, values))

    def finalize(self):
        release(self)


def _voice(r, trusted: bool) -> tuple[Voice, str]:
    """The voice and REGISTER_NAME. With the internal key (tts or voices, which checked the voice where it
    entered: serving.intake.requests.parse_request, voices' add) as sent; key-less (tts_ensemble's first step,
    or anyone while the ensemble is served), every check."""
    audio = get(pb, r, "REF_AUDIO", required=False)
    rate = scalar(pb, r, "REF_SAMPLE_RATE", 0)
    text, voice_id = string(pb, r, "REF_TEXT", ""), string(pb, r, "VOICE_ID", "")
    register = string(pb, r, "REGISTER_NAME", "")
    if trusted:  # REF_AUDIO as it came, [1, n] or (n,)
        return Voice(None if audio is None else audio.reshape(-1), rate, text, voice_id), register
    if register:
        raise Refused("voices are registered through the voices model")
    return check_voice(audio, rate, text, voice_id), ""
