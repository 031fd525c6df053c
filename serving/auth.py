"""Who may ask the models what: the per-run internal key, the admin key, and unforgeable stream ids.

The launcher puts two values in tritonserver's environment, which its stubs inherit and no Triton API
shows: a random internal key, which ``tts`` and ``voices`` attach to every BLS request as the request
parameter ``internal_key``, and the SHA-256 of the admin key, which adding or removing a voice needs.

The internal models (``prompt_encoder``, ``generator``, ``vocoder``) serve requests that carry the
internal key. ``tts_ensemble`` cannot add one (an ensemble forwards what its client sent), so while the
ensemble is served (``public`` below) they also take key-less requests for exactly what the ensemble
does, and nothing that touches another client's state is reachable that way:

- stream ids are minted with a MAC under the internal key (31 random bits + 32 bits of HMAC); the
  vocoder refuses a chunk whose id it cannot verify, so a caller can only address a stream the
  generator issued to it; the ids are random, never sequential, and no error message carries one;
- the generator issues a fresh id for every key-less stream rather than using the correlation id,
  which a client (or Triton) chooses;
- registering a voice needs the internal key (``voices`` checks the admin key first).

Without the environment (models loaded by a tritonserver that ``serving.serve`` did not start) there
is no key: every caller is trusted and the models log that once.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import os
import secrets

INTERNAL_KEY_ENV = "TTS_INTERNAL_KEY"
ADMIN_DIGEST_ENV = "TTS_ADMIN_KEY_SHA256"
INTERNAL_PARAMETER = "internal_key"
ADMIN_PARAMETER = "admin_key"
_NONCE_BITS = 31


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
    """A request from outside our pipeline to something only the pipeline may ask for."""


class Keys:
    def __init__(self, internal: str = "", admin_digest: str = "", public: bool = False):
        self.internal = internal.encode()
        self.admin_digest = admin_digest
        self.public = public  # key-less requests allowed: the ensemble is served

    @classmethod
    def from_env(cls, params: dict[str, str] | None = None, model: str = "") -> Keys:
        keys = cls(os.environ.get(INTERNAL_KEY_ENV, ""), os.environ.get(ADMIN_DIGEST_ENV, ""),
                   (params or {}).get("public_steps", "1") == "1")  # fmt: skip
        if not keys.internal:
            logging.getLogger(model or "auth").warning(
                "%s is not set: this model trusts every caller (start the server with serving.serve)",
                INTERNAL_KEY_ENV,
            )
        return keys

    # ---- the internal key ----
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

    # ---- the admin key ----
    @staticmethod
    def digest(admin_key: str) -> str:
        return hashlib.sha256(admin_key.encode()).hexdigest()

    def is_admin(self, raw: str | dict | None) -> bool:
        if not self.admin_digest:
            return True  # no admin key configured (see the module docstring)
        given = self.split(raw)[0].get(ADMIN_PARAMETER)
        if not isinstance(given, str):
            return False
        return hmac.compare_digest(self.digest(given), self.admin_digest)

    # ---- stream ids ----
    def _mac(self, nonce: int) -> int:
        return int.from_bytes(hmac.digest(self.internal, nonce.to_bytes(4, "big"), "sha256")[:4], "big")

    def new_stream_id(self) -> int:
        """A random 63-bit id that :meth:`valid_stream_id` accepts; never 0."""
        nonce = secrets.randbits(_NONCE_BITS) | 1
        return (nonce << 32) | self._mac(nonce) if self.internal else (nonce << 32) | secrets.randbits(32)

    def valid_stream_id(self, stream_id: int) -> bool:
        nonce, mac = stream_id >> 32, stream_id & 0xFFFFFFFF
        if not 0 < nonce < (1 << _NONCE_BITS):
            return False
        return not self.internal or hmac.compare_digest(mac.to_bytes(4, "big"), self._mac(nonce).to_bytes(4, "big"))
