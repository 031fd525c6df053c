"""voices: register, list and remove named voices. Registration encodes through prompt_encoder (BLS),
which owns the store; listing and removal read the store directly."""

import json

import triton_python_backend_utils as pb

from engine.protocol import NOT_FOUND
from serving import contract
from serving.config.model_options import VoicesOptions
from serving.intake.requests import check_name, check_ref_audio, check_text
from serving.security.auth import Keys, Refused
from serving.stub.triton_io import answer_each, bls_error, get, scalar, setup_logging, string, tensors
from serving.supervision.run_folder import start_heartbeat
from serving.voices.voice_store import VoiceStore

log = setup_logging("voices")


class TritonPythonModel:
    def initialize(self, args):
        opts = VoicesOptions.read(args)
        start_heartbeat(opts.run_dir, "voices")
        self.store = VoiceStore(opts.voice_dir or None, identity="", encode=None)
        self.timeout_us = opts.bls_timeout_seconds * 1_000_000
        self.keys = Keys.from_env("voices")

    def _add(self, r, name):
        audio = get(pb, r, "REF_AUDIO", required=False)
        if audio is None:
            raise ValueError("add needs REF_AUDIO and REF_SAMPLE_RATE")
        audio, sr = check_ref_audio(audio, scalar(pb, r, "REF_SAMPLE_RATE", 0))
        text = check_text(string(pb, r, "REF_TEXT", ""), "REF_TEXT", required=False)
        values = {"REF_AUDIO": audio, "REF_SAMPLE_RATE": sr, "REF_TEXT": text, "REGISTER_NAME": name}
        req = pb.InferenceRequest(
            model_name="prompt_encoder", requested_output_names=["PROMPT_TEXT"], timeout=self.timeout_us,
            parameters=self.keys.parameters(), inputs=tensors(pb, contract.PROMPT_INPUTS, values),
        )  # fmt: skip
        if (error := bls_error(pb, "prompt_encoder", req.exec())) is not None:
            raise error
        return {"name": name, "text": text, "seconds": round(audio.size / sr, 3)}

    def execute(self, requests):
        return answer_each(pb, requests, self._answer, log)

    def _answer(self, r):
        action = string(pb, r, "ACTION", "")
        if action == "list":
            result = [v.__dict__ for v in self.store.list()]
        elif action in ("add", "remove", "check"):
            if refusal := self.keys.admin_refusal(r.parameters(), "add" if action == "check" else action):
                raise Refused(refusal)
            if action == "check":  # the admin key, before a caller does costly work (a voice design)
                result = {"admin": True}
            elif action == "add":
                result = self._add(r, check_name(string(pb, r, "NAME", "")))
            elif self.store.remove(name := check_name(string(pb, r, "NAME", ""))):
                result = {"name": name, "removed": True}
            else:
                raise ValueError(f"{NOT_FOUND}voice {name!r} is not registered")
        else:
            raise ValueError(f"ACTION must be add, list, remove or check, got {action!r}")
        return pb.InferenceResponse(tensors(pb, contract.VOICES_OUTPUTS, {"RESULT": json.dumps(result)}, batch=False))
