"""An independent whole-utterance reference, the way the FireRedTTS3 reference synthesizes offline:
generate every patch with the bare :class:`~engine.generator.Generator` (no services, no chunking, no
orchestrator), then decode ``[prompt latents + generated latents]`` in one non-streaming forward of the
RedAE decoder and cut the prompt's samples. Streamed and offline audio are both checked against it."""

from __future__ import annotations

import numpy as np
import torch

from engine.config import SAMPLES_PER_LATENT
from engine.params import GenerationParams
from tests.generation import Planned


def reference_latents(
    model, text: str, params: GenerationParams, prompt=None, language: str = "English", invariant: bool = False
):
    """(4N, 64) latents of one segment, generated patch by patch in a batch of one. ``invariant``: in the
    batch-invariant arithmetic (engine/invariant.py) a served generator uses on a CPU, to compare its bits."""
    prompt = prompt or model.encode_prompt(None)
    tokens = model.tokens(text, language, prompt)
    gen = model.generator(1, 1 + len(tokens) + prompt.num_patches + params.max_patches, batch_invariant=invariant)
    stream = gen.new_stream(0, tokens, prompt, params)
    planned = Planned(gen)
    planned.admit(stream)  # the default pool holds a whole row
    out = []
    while not stream.finished:
        r = planned.step([stream])[0]
        if r.latents is not None:
            out.append(r.latents)
    return torch.cat(out)


@torch.inference_mode()
def reference_audio(model, text: str, params: GenerationParams, prompt=None, language: str = "English") -> np.ndarray:
    """(n,) float32 audio of one segment: whole-utterance decode, prompt samples cut."""
    prompt = prompt or model.encode_prompt(None)
    latents = reference_latents(model, text, params, prompt, language)
    whole = torch.cat([prompt.latents, latents])[None].to(model.device, model.dtype)
    audio = model.models.redae.decoder(whole)[0].float().cpu().numpy()
    return audio[prompt.latents.shape[0] * SAMPLES_PER_LATENT :]


def snr_db(ref: np.ndarray, got: np.ndarray) -> float:
    err = np.sum((ref.astype(np.float64) - got) ** 2)
    return float("inf") if err == 0 else 10 * np.log10(np.sum(ref.astype(np.float64) ** 2) / err)


def spoken(model, text: str, language: str | None = None) -> str:
    """The one segment the front end makes of a short ``text`` (cleaned, normalized)."""
    from engine.frontend import prepare

    (segment,) = prepare(text, language, lambda t: len(model.models.tokenizer.encode(t))).segments
    return segment


def reference_long(
    model, text: str, params: GenerationParams, split_tokens: int, prompt=None, language: str | None = None
) -> np.ndarray:
    """A long text: the front end's segments (:func:`engine.frontend.prepare`), each one's
    :func:`reference_audio`, joined by a 50 ms linear cross-fade."""
    from engine.frontend import prepare

    def count(t: str) -> int:
        return len(model.models.tokenizer.encode(t))

    prepared = prepare(text, language, count, split_tokens, max_patches=params.max_patches)
    segments, language = prepared.segments, prepared.language
    out = reference_audio(model, segments[0], params, prompt, language)
    ramp = np.arange(1200, dtype=np.float64) / 1199
    for segment in segments[1:]:
        nxt = reference_audio(model, segment, params, prompt, language)
        mixed = out[-1200:] * (1 - ramp) + nxt[:1200] * ramp
        out = np.concatenate([out[:-1200], mixed.astype(np.float32), nxt[1200:]])
    return out
