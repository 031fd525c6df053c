"""Who may ask the models what: the run's internal key, the admin key's SHA-256, random stream ids, chunk seals
and the generator's secret name. Without the keys in the environment (a tritonserver that ``serving.serve``
did not start) every caller is trusted, and each model logs that once. docs/architecture.md ("Auth",
"Sealing"), docs/security.md ("Internal models")."""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import os
import struct
from dataclasses import replace
from typing import TYPE_CHECKING

import numpy as np

from engine.protocol import FORBIDDEN, new_stream_id

if TYPE_CHECKING:  # the stubs import this module: keep it light
    from engine.protocol import Chunk

GENERATOR = "generator"  # the generator model's name in the repository and to operators (metrics, logs)
INTERNAL_KEY_ENV = "TTS_INTERNAL_KEY"
ADMIN_DIGEST_ENV = "TTS_ADMIN_KEY_SHA256"
INTERNAL_PARAMETER = "internal_key"
ADMIN_PARAMETER = "admin_key"


def parameter_dict(raw: str | dict | None) -> dict:
    """Triton's request parameters (JSON text in the Python backend) -> a new dict; ValueError if malformed."""
    try:
        given = json.loads(raw) if isinstance(raw, str) and raw else raw or {}
    except (ValueError, RecursionError):
        raise ValueError("request parameters are not valid JSON") from None
    if not isinstance(given, dict):
        raise ValueError(f"request parameters must be a JSON object, got {type(given).__name__}")
    return dict(given)


class Refused(ValueError):
    """A request from outside our pipeline to something only the pipeline may ask for (``forbidden: ``)."""

    def __init__(self, message: str):
        super().__init__(FORBIDDEN + message)


class Keys:
    def __init__(self, internal: str = "", admin_digest: str = "", public: bool = False):
        self.internal, self.admin_digest = internal.encode(), admin_digest
        self.public = public  # key-less requests allowed (:meth:`admit`): the ensemble is served

    @classmethod
    def from_env(cls, model: str, public: bool = False) -> Keys:
        """The run's keys from the environment (``model`` names the log that says there are none)."""
        keys = cls(os.environ.get(INTERNAL_KEY_ENV, ""), os.environ.get(ADMIN_DIGEST_ENV, ""), public)
        if not keys.internal:
            logging.getLogger(model).warning("%s is not set: this model trusts every caller (start the server "
                                             "with serving.serve)", INTERNAL_KEY_ENV)  # fmt: skip
        return keys

    def parameters(self) -> dict[str, str]:
        """Request parameters that mark a BLS request as ours."""
        return {INTERNAL_PARAMETER: self.internal.decode()} if self.internal else {}

    def split(self, raw: str | dict | None) -> tuple[dict, bool]:
        """Triton request parameters -> (the client's parameters without our keys, whether it is ours)."""
        given = parameter_dict(raw)
        key = given.pop(INTERNAL_PARAMETER, None)
        trusted = not self.internal or (isinstance(key, str) and hmac.compare_digest(key.encode(), self.internal))
        return given, trusted

    def admit(self, trusted: bool, model: str) -> None:
        """Refuse a key-less request unless the ensemble makes key-less requests legitimate."""
        if not trusted and not self.public:
            raise Refused(f"{model} is internal: send requests to the tts model")

    @staticmethod
    def digest(admin_key: str) -> str:
        return hashlib.sha256(admin_key.encode()).hexdigest()

    def admin_refusal(self, raw: str | dict | None, action: str) -> str | None:
        """None when the request carries the admin key (or none is configured); else what to tell its
        sender, which says whether the key was missing or wrong and how each client sends it."""
        if not self.admin_digest:
            return None  # no admin key configured
        given = self.split(raw)[0].get(ADMIN_PARAMETER)
        if isinstance(given, str) and hmac.compare_digest(self.digest(given), self.admin_digest):
            return None
        how = ("the key itself, not its file: `python -m client.voices --admin-key KEY` or $TTS_ADMIN_KEY, "
               f"VoiceClient(admin_key=...), the request parameter {ADMIN_PARAMETER!r} over gRPC or HTTP, or "
               "'Authorization: Bearer KEY' at the OpenAI gateway")  # fmt: skip
        if not given:
            return f"{action} needs the admin key ({how})"
        return (f"{action}: the admin key is wrong (a key the launcher generated is kept in its state directory's "
                f"admin_key file: python -m serving.security.admin_key path; a rotated key counts after a restart). "
                f"Send {how}")  # fmt: skip

    @property
    def generator_model(self) -> str:
        """The generator's name in Triton: a secret of the run, derived from the internal key, so that no client
        can address it (docs/triton.md#T9, #T10); plain ``generator`` without a key."""
        if not self.internal:
            return GENERATOR
        return f"{GENERATOR}-{hashlib.sha256(b'generator model name:' + self.internal).hexdigest()[:32]}"

    new_stream_id = staticmethod(new_stream_id)  # engine.protocol's, the one minter

    def seal(self, chunk: Chunk) -> Chunk:
        """``chunk`` with its MAC (64 bits of keyed BLAKE2b over everything the vocoder acts on)."""
        return replace(chunk, seal=self._chunk_mac(chunk)) if self.internal else chunk

    def sealed(self, chunk: Chunk) -> bool:
        """Whether ``chunk`` is exactly as the generator sealed it (always, without a key)."""
        if not self.internal:
            return True
        return hmac.compare_digest(chunk.seal.to_bytes(8, "big"), self._chunk_mac(chunk).to_bytes(8, "big"))

    def _chunk_mac(self, chunk: Chunk) -> int:
        h = hashlib.blake2b(key=self.internal[:64], digest_size=8, person=b"tts-chunk")
        reason = chunk.finish_reason.encode("utf-8", "surrogatepass")
        latents, prompt = (np.ascontiguousarray(a, np.float32) for a in (chunk.latents, chunk.prompt_latents))
        h.update(struct.pack(">QQ?QQQ", chunk.stream_id, chunk.seq, chunk.last, len(reason), latents.nbytes,
                             prompt.nbytes))  # fmt: skip
        for part in (reason, latents, prompt):
            h.update(part)
        return int.from_bytes(h.digest(), "big")
