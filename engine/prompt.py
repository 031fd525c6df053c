"""Voice prompts: what a reference clip becomes before generation (latents, speaker embedding, text)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.config import PATCH_SIZE


@dataclass(frozen=True)
class VoicePrompt:
    """An encoded reference voice.

    Attributes:
        latents: (4P, 64) float32 RedAE latents of the left-padded reference audio (P patches).
        speaker: (spk_in_dim,) float32 CAM++ embedding of the same padded audio.
        text: transcript of the reference audio ("" for the silent prompt).
    """

    latents: torch.Tensor
    speaker: torch.Tensor
    text: str

    def __post_init__(self) -> None:
        if self.latents.ndim != 2 or self.speaker.ndim != 1:
            raise ValueError(
                f"bad prompt shapes: latents {tuple(self.latents.shape)}, speaker {tuple(self.speaker.shape)}"
            )
        if self.latents.shape[0] % PATCH_SIZE:
            raise ValueError(f"prompt latents ({self.latents.shape[0]}) are not whole patches of {PATCH_SIZE}")

    @property
    def num_patches(self) -> int:
        return self.latents.shape[0] // PATCH_SIZE
