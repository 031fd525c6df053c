"""What one generator stream carries from step to step, and what a step gives back: plain dataclasses
over tensors, read by :class:`engine.generator.Generator` (which makes and steps them) and
:class:`engine.streams.GeneratorService` (which keeps them per stream id).

A stream's :class:`Phase` lives here, on the stream, and nowhere else: the generator changes it when an
Instruct plan ends, and everyone else reads it from the stream.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch

from engine.chatml import LATENT_IN_ID, LATENT_OUT_ID, MAX_TEXT_TOKENS
from engine.config import PATCH_SIZE
from engine.params import GenerationParams
from engine.prompt import VoicePrompt
from engine.text_sampling import TextSampling


class Phase(enum.Enum):
    """What a stream's next step makes."""

    AUDIO = "audio"  # speech patches (Base; Instruct after its text)
    TEXT = "text"  # text tokens before the speech (Instruct's voice design and semantic edit)


class TextStep(enum.Enum):
    """Where a stream in its text phase is: the reference picks tokens until <|eot|> (or the cap), then
    feeds the last one and <|sosp|> before its audio loop."""

    PICK = "pick"  # picking the plan's tokens
    FEED_LAST = "feed last"  # feeding the plan's last token (<|eot|>, or the cap's last)
    FEED_SOS = "feed sos"  # feeding <|sosp|>: the audio phase comes next


@dataclass(frozen=True)
class InstructInput:
    """What an Instruct stream starts from (:meth:`engine.fireredtts3.FireRedTTS3.instruct_input` builds it).

    Latents are RedAE's, unscaled: the generator scales them by ``REDAE_SCALE`` as the model expects.
    """

    tokens: list[int]  # the task's ChatML ids, placeholders included
    latents_in: torch.Tensor | None = None  # (4N, 64) the recording to edit; one LATENT_IN_ID per patch
    latents_out: torch.Tensor | None = None  # (4P, 64) the cloning prompt; one LATENT_OUT_ID per patch
    sampling: TextSampling | None = None  # the text phase's token choice; None: no text phase

    @property
    def prompt_patches(self) -> int:
        return 0 if self.latents_out is None else self.latents_out.shape[0] // PATCH_SIZE

    def check(self) -> None:
        """ValueError unless each latents tensor is finite (4N, 64) with one placeholder id per patch."""
        for token_id, latents in ((LATENT_IN_ID, self.latents_in), (LATENT_OUT_ID, self.latents_out)):
            patches = 0 if latents is None else latents.shape[0] // PATCH_SIZE
            if latents is not None and (latents.ndim != 2 or latents.shape[0] % PATCH_SIZE or latents.shape[1] != 64):
                raise ValueError(f"latents must be (4N, 64), got {tuple(latents.shape)}")
            if latents is not None and not torch.isfinite(latents).all():
                raise ValueError("the latents have non-finite values")
            if self.tokens.count(token_id) != patches:
                raise ValueError(
                    f"the ChatML ids hold {self.tokens.count(token_id)} placeholders for {patches} patches"
                )


def check_prompt(prompt: VoicePrompt, speaker_dim: int) -> None:
    """ValueError unless a Base voice prompt has audio patches, a ``speaker_dim`` embedding and finite values."""
    if prompt.num_patches < 1:
        raise ValueError("the voice prompt has no audio patches")
    if prompt.speaker.numel() != speaker_dim:
        raise ValueError(f"the speaker embedding has {prompt.speaker.numel()} values; expected {speaker_dim}")
    if not (torch.isfinite(prompt.latents).all() and torch.isfinite(prompt.speaker).all()):
        raise ValueError("the voice prompt has non-finite values")


@dataclass
class Stream:
    """One request's generation state. Created by :meth:`Generator.new_stream` (Base) or
    :meth:`Generator.new_instruct_stream` (Instruct)."""

    slot: int
    tokens: torch.Tensor  # (1, T) prompt token ids (Instruct: the ChatML ids)
    prompt: VoicePrompt | None  # Base's voice prompt; None for Instruct
    params: GenerationParams
    rng: torch.Generator  # CPU: the flow's noise (on a CPU model the text draws too: the reference's one RNG)
    text_rng: torch.Generator | None = None  # the text phase's draws, on the device (text_generator)
    model: str = "base"  # which core: "base" or "instruct"
    phase: Phase = Phase.AUDIO
    instruct: InstructInput | None = None
    position: int = 0  # next backbone position (= cached tokens)
    patches: int = 0  # patches generated so far
    finished: bool = False
    next_input: torch.Tensor | None = None  # (1, 1, hidden) backbone input of the next decode
    cond: torch.Tensor | None = None  # (1, 3, hidden) last 3 backbone states, zero-padded
    history: torch.Tensor | None = None  # (1, 8, 64) last clean latents (Instruct: scaled)
    spk_dit: torch.Tensor | None = None  # (1, speaker_dim)
    text_ids: list[int] = field(default_factory=list)  # the text phase's tokens so far (not <|eot|>)
    text_step: TextStep = TextStep.PICK  # where its text phase is (Phase.TEXT only)

    @property
    def prefilled(self) -> bool:
        return self.next_input is not None or self.finished

    def prefix_length(self) -> int:
        if self.instruct is not None:
            return self.tokens.shape[1]
        return base_prefix(self.tokens.shape[1], self.prompt.num_patches)

    def positions_needed(self) -> int:
        writes_text = self.instruct is not None and self.instruct.sampling is not None
        return positions_needed(self.prefix_length(), writes_text, self.params.max_patches)


def base_prefix(tokens: int, prompt_patches: int) -> int:
    """A Base stream's prefill length in positions: the speaker, ``tokens`` text tokens, the prompt's patches."""
    return 1 + tokens + prompt_patches


def positions_needed(prefix: int, writes_text: bool, max_patches: int) -> int:
    """Cache positions a stream may ever use: its ``prefix``, the text phase's tokens and <|sosp|> (at most
    MAX_TEXT_TOKENS + 1, for an Instruct task that ``writes_text``), one per patch."""
    return prefix + (MAX_TEXT_TOKENS + 1 if writes_text else 0) + max_patches


@dataclass
class StepResult:
    latents: torch.Tensor | None  # (4, 64) float32 of the new patch (RedAE's scale), None if none this step
    finished: bool
    reason: str = ""  # "stop" (stop head), "length" (max_patches) when finished
    text_ids: list[int] | None = None  # the whole text plan, in the step that picked its last token


def new_rng(params: GenerationParams) -> torch.Generator:
    """The stream's CPU generator of the flow's noise, seeded from the request (one per stream)."""
    return torch.Generator(device="cpu").manual_seed(params.seed & 0xFFFF_FFFF_FFFF_FFFF)
