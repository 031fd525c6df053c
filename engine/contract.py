"""Tensors crossing Triton: names, dtypes and shapes, written once.

``config.pbtxt`` files are rendered from these specs (:mod:`engine.repository`), the models read and
write through them, and the README's tables list them. Shapes exclude the batch dimension of models
with ``max_batch_size > 0``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Spec:
    name: str
    dtype: str  # Triton config type, e.g. "TYPE_FP32"
    dims: tuple[int, ...]
    optional: bool = False
    doc: str = ""

    def pbtxt(self, ragged: bool = False) -> str:
        parts = [f'name: "{self.name}"', f"data_type: {self.dtype}", f"dims: [ {', '.join(map(str, self.dims))} ]"]
        if self.optional:
            parts.append("optional: true")
        if ragged:
            parts.append("allow_ragged_batch: true")
        return "{ " + "  ".join(parts) + " }"


LATENT_DIM = 64

# ---- tts: the public front door (decoupled, max_batch_size 0) ----
TTS_INPUTS = (
    Spec("TEXT", "TYPE_STRING", (1,), doc="text to speak (UTF-8)"),
    Spec("LANGUAGE", "TYPE_STRING", (1,), True, "language name, default English (see engine.text.LANGUAGES)"),
    Spec("REF_AUDIO", "TYPE_FP32", (-1,), True, "reference voice, mono float samples in [-1, 1]"),
    Spec("REF_SAMPLE_RATE", "TYPE_INT32", (1,), True, "sample rate of REF_AUDIO in Hz (required with it)"),
    Spec("REF_TEXT", "TYPE_STRING", (1,), True, "transcript of REF_AUDIO"),
    Spec("VOICE_ID", "TYPE_STRING", (1,), True, "a registered voice (instead of REF_AUDIO)"),
    Spec("SEED", "TYPE_INT64", (1,), True, "sampling seed, default 1234"),
)
TTS_OUTPUTS = (
    Spec("AUDIO", "TYPE_FP32", (-1,), doc="mono 24 kHz float samples, one chunk per response"),
    Spec("FINISH_REASON", "TYPE_STRING", (1,), doc='final response only: "stop" (stop head) or "length" (max_patches)'),
)
# request parameters of tts (Triton request parameters; HTTP: the "parameters" object)
TTS_PARAMETERS = {
    "steps": (int, 10, "Euler steps of the flow head (1..100)"),
    "cfg": (float, 2.0, "classifier-free guidance weight (0..20)"),
    "chunk_first": (int, 3, "patches (160 ms each) in the first audio chunk"),
    "chunk_next": (int, 12, "patches in every later chunk"),
    "max_patches": (int, 400, "length limit per text segment, in patches (400 = 64 s)"),
    "split_tokens": (int, 80, "texts longer than this many tokens are split at sentences (0: never)"),
}

# ---- prompt_encoder (dynamic batching) ----
PROMPT_INPUTS = (
    Spec("REF_AUDIO", "TYPE_FP32", (-1,), True),
    Spec("REF_SAMPLE_RATE", "TYPE_INT32", (1,), True),
    Spec("REF_TEXT", "TYPE_STRING", (1,), True),
    Spec("VOICE_ID", "TYPE_STRING", (1,), True),
    Spec("REGISTER_NAME", "TYPE_STRING", (1,), True, "with REF_AUDIO: store the prompt as this named voice"),
)
PROMPT_OUTPUTS = (
    Spec("PROMPT_LATENTS", "TYPE_FP32", (-1, LATENT_DIM), doc="RedAE latents of the padded reference (4 per patch)"),
    Spec("SPEAKER", "TYPE_FP32", (-1,), doc="CAM++ speaker embedding"),
    Spec("PROMPT_TEXT", "TYPE_STRING", (1,), doc="transcript that goes before the text"),
)

# ---- generator (decoupled, iterative sequence batcher; one request = one stream) ----
GENERATOR_INPUTS = (
    Spec("TOKENS", "TYPE_INT64", (-1,)),
    Spec("PROMPT_LATENTS", "TYPE_FP32", (-1, LATENT_DIM)),
    Spec("SPEAKER", "TYPE_FP32", (-1,)),
    Spec("SEED", "TYPE_INT64", (1,)),
    Spec("STEPS", "TYPE_INT32", (1,)),
    Spec("CFG", "TYPE_FP32", (1,)),
    Spec("MAX_PATCHES", "TYPE_INT32", (1,)),
    Spec("CHUNK_FIRST", "TYPE_INT32", (1,)),
    Spec("CHUNK_NEXT", "TYPE_INT32", (1,)),
)
GENERATOR_OUTPUTS = (
    Spec("LATENTS", "TYPE_FP32", (-1, LATENT_DIM), doc="a chunk of generated latents"),
    Spec("FINISH_REASON", "TYPE_STRING", (1,), doc="final response only: stop | length"),
)

# ---- vocoder (sequence batcher, state per stream) ----
VOCODER_INPUTS = (
    Spec("LATENTS", "TYPE_FP32", (-1, LATENT_DIM), doc="generated latents of this chunk (may be empty with END)"),
    Spec("PROMPT_LATENTS", "TYPE_FP32", (-1, LATENT_DIM), True, "with START: primes the decoder"),
)
VOCODER_OUTPUTS = (Spec("AUDIO", "TYPE_FP32", (-1,)),)
VOCODER_CONTROLS = ("START", "END", "READY")  # INT32 [1]; plus CORRID (UINT64)


# ---- voices (named voice management; max_batch_size 0) ----
VOICES_INPUTS = (
    Spec("ACTION", "TYPE_STRING", (1,), doc="add | list | remove"),
    Spec("NAME", "TYPE_STRING", (1,), True, "voice name, [A-Za-z0-9_-]{1,64}"),
    Spec("REF_AUDIO", "TYPE_FP32", (-1,), True, "with add: the reference clip"),
    Spec("REF_SAMPLE_RATE", "TYPE_INT32", (1,), True),
    Spec("REF_TEXT", "TYPE_STRING", (1,), True),
)
VOICES_OUTPUTS = (Spec("RESULT", "TYPE_STRING", (1,), doc="JSON: the voice (add, remove) or the list of voices"),)


def text_of(arr) -> str:
    """First element of a BYTES tensor as str."""
    v = np.asarray(arr).reshape(-1)[0]
    return v.decode("utf-8") if isinstance(v, bytes) else str(v)
