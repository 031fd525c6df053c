"""The loaded model and the request-level pieces around the generator: prompt encoding, tokens,
decoder streams. Shared by the offline path (:mod:`engine.synthesize`) and the Triton models."""

from __future__ import annotations

import copy
import logging
from pathlib import Path

import numpy as np
import torch

from engine.audio import check_reference, left_pad_to_multiple
from engine.chatml import acoustic_edit_chatml, clone_chatml, design_chatml, semantic_edit_chatml
from engine.checkpoint import PARTS, Models, load_models, precision_policy
from engine.config import PATCH_SAMPLES, PATCH_SIZE, SAMPLES_PER_LATENT
from engine.generator import Generator, InstructInput
from engine.instruct import DEFAULTS, EDITS, Task, check_edit_patches
from engine.kv_cache import PAGE_SIZE, PagedCache, capacity_line, pages_for_memory
from engine.layers.attention import select_attention
from engine.models.campp import speaker_embedding
from engine.models.redae import DecoderStream
from engine.params import MAX_PATCHES
from engine.prompt import VoicePrompt
from engine.protocol import SAMPLE_RATE
from engine.resample import resample

log = logging.getLogger(__name__)
SILENT_PROMPT_SAMPLES = PATCH_SAMPLES  # the prompt used without reference audio: one patch of silence


class FireRedTTS3:
    """A checkpoint loaded on one device, with the operations a request needs.

    ``dtypes``: the dtype of each network (:func:`engine.checkpoint.precision_policy`); ``dtype`` is the
    backbone's.
    """

    def __init__(self, models: Models, device: torch.device, dtype: torch.dtype, dtypes: dict | None = None):
        self.models = models
        self.device = device
        self.dtype = dtype
        self.dtypes = dtypes or precision_policy(device, dtype)
        self._silent: VoicePrompt | None = None

    @classmethod
    def from_checkpoint(
        cls, path: str | Path, device: str = "cpu", dtype: torch.dtype | dict | None = None,
        parts: tuple[str, ...] = PARTS, models: tuple[str, ...] | None = None,
    ) -> FireRedTTS3:  # fmt: skip
        """Load ``path`` on ``device``; ``dtype`` None = per-network dtypes (bfloat16 backbone and RedAE
        encoder on CUDA, float32 elsewhere), a dtype = every network in it, a dict = some networks
        overridden (see :func:`engine.checkpoint.precision_policy`). ``models``: the cores to load
        ("base", "instruct"; None: what the folder holds)."""
        models = load_models(path, device, dtype, parts, models)
        policy = precision_policy(device, dtype)
        return cls(models, torch.device(device), policy["backbone"], policy)

    @property
    def core(self):
        """The Base core (None when it is not loaded)."""
        return self.models.core

    @property
    def cores(self) -> dict:
        return self.models.cores

    @property
    def identity(self) -> str:
        return self.models.identity

    @torch.inference_mode()
    def encode_prompt(self, audio: np.ndarray | None, sample_rate: int = SAMPLE_RATE, text: str = "") -> VoicePrompt:
        """Reference clip -> :class:`VoicePrompt`. ``audio`` None gives the silent prompt (text ignored).

        Args:
            audio: (N,) float samples in [-1, 1] at ``sample_rate``.
        """
        if audio is None:
            if self._silent is None:
                self._silent = self._encode(np.zeros(SILENT_PROMPT_SAMPLES, np.float32), "")
            return self._silent
        audio = resample(check_reference(audio, sample_rate), sample_rate, SAMPLE_RATE)
        return self._encode(left_pad_to_multiple(audio, PATCH_SAMPLES), text)

    def _encode(self, padded: np.ndarray, text: str) -> VoicePrompt:
        latents = self._latents(padded)
        if self.models.campp is None:  # an Instruct-only checkpoint: prompts for Instruct cloning only
            return VoicePrompt(latents=latents, speaker=torch.zeros(0), text=text)
        spk = speaker_embedding(self.models.campp, padded)[0].float().cpu()
        return VoicePrompt(latents=latents, speaker=spk, text=text)

    def _latents(self, padded: np.ndarray) -> torch.Tensor:
        x = torch.from_numpy(padded).to(self.device, self.dtypes["encoder"])[None]
        return self.models.redae.encoder(x)[0].float().cpu()

    @torch.inference_mode()
    def encode_latents(
        self, audio: np.ndarray, sample_rate: int = SAMPLE_RATE, name: str = "recording"
    ) -> torch.Tensor:
        """A clip -> (4N, 64) float32 RedAE latents of it left-padded to whole patches (Instruct's
        recording to edit and cloning prompt; no speaker embedding)."""
        audio = resample(check_reference(audio, sample_rate, name), sample_rate, SAMPLE_RATE)
        return self._latents(left_pad_to_multiple(audio, PATCH_SAMPLES))

    def instruct_input(
        self, task: Task | str, instruction: str = "", text: str = "", latents: torch.Tensor | None = None,
        prompt_text: str = "",
    ) -> InstructInput:  # fmt: skip
        """The generator's input for one Instruct task (checked strings are the caller's business).

        Args:
            task: a :class:`~engine.instruct.Task` or its name.
            instruction: the voice description (design, clone's optional one is unused by the model) or
                the edit instruction.
            text: what to say (design, clone).
            latents: (4N, 64) RedAE latents (:meth:`encode_latents`): the cloning prompt (clone) or the
                recording to edit (edits).
            prompt_text: the cloning prompt's transcript.
        """
        task = Task.parse(task) if isinstance(task, str) else task
        if task is not Task.DESIGN and latents is None:
            raise ValueError(f"the {task.value} task needs audio latents")
        patches = 0 if latents is None else latents.shape[0] // PATCH_SIZE
        if task in EDITS:
            check_edit_patches(patches)
        if task is Task.DESIGN:
            chatml, fill = design_chatml(instruction, text), {}
        elif task is Task.CLONE:
            chatml, fill = clone_chatml(patches, prompt_text, text), {"latents_out": latents}
        elif task is Task.SEMANTIC_EDIT:
            chatml, fill = semantic_edit_chatml(instruction, patches), {"latents_in": latents}
        else:
            chatml, fill = acoustic_edit_chatml(instruction, patches), {"latents_in": latents}
        tokens = self.models.tokenizer.encode(chatml)
        return InstructInput(tokens, sampling=DEFAULTS[task].sampling, **fill)

    def tokens(self, text: str, language: str, prompt: VoicePrompt) -> list[int]:
        return self.models.tokenizer.encode_prompt(text, language=language, prompt_text=prompt.text)

    def generator(
        self, slots: int, max_len: int, kv_pages: int | None = None, kv_memory_gb: float | None = None,
        page_size: int = PAGE_SIZE, attention: str = "auto", batch_invariant: bool = False,
    ) -> Generator:  # fmt: skip
        """A batched generator whose backbone keys live in a paged cache.

        Args:
            slots: streams at once; max_len: backbone positions of the longest stream.
            kv_pages / kv_memory_gb: the page pool (at most one); default ``slots`` x ``max_len`` positions,
                the memory a per-slot cache of these sizes took.
            attention: ``auto`` (FlashInfer when usable), ``sdpa`` or ``flashinfer``; see
                :func:`engine.layers.attention.select_attention`.
            batch_invariant: a stream's bits the same alone or beside others (:mod:`engine.invariant`).
        """
        core = next(iter(self.cores.values()))  # Base and Instruct share the cache (Generator checks the shapes)
        bb = core.cfg.backbone
        if kv_pages is not None and kv_memory_gb is not None:
            raise ValueError("give kv_pages or kv_memory_gb, not both")
        dtype = core.backbone.norm.weight.dtype  # the cache keeps keys in the backbone's dtype
        if kv_memory_gb is not None:
            kv_pages = pages_for_memory(bb, kv_memory_gb, dtype, page_size)
        choice = select_attention(attention, self.device, dtype, bb.head_dim)
        cache = PagedCache(bb, slots, max_len, self.device, dtype, kv_pages, page_size, choice)
        log.info(capacity_line(bb, dtype, cache.num_pages, slots, MAX_PATCHES.default, page_size))
        return Generator(self.models.core, cache, self.models.instruct, batch_invariant)

    @torch.inference_mode()
    def decoder_stream(self, prompt_latents: torch.Tensor) -> PrimedDecoder:
        """A decoder for one stream, primed with (4P, 64) prompt latents."""
        return PrimedDecoder(self.models.redae.decoder.stream(1), prompt_latents, self.device, self.dtypes["decoder"])


class PrimedDecoder:
    """One stream's RedAE decoder, primed with the prompt latents so that its audio equals offline
    decoding of [prompt + generated] with the prompt's samples cut."""

    def __init__(self, stream: DecoderStream, prompt_latents: torch.Tensor, device, dtype):
        self.stream, self.device, self.dtype = stream, device, dtype
        self.to_skip = prompt_latents.shape[0] * SAMPLES_PER_LATENT
        if prompt_latents.shape[0]:  # Instruct's design and edits prime with nothing
            self._emit(stream.decode(prompt_latents.to(device, dtype, non_blocking=True)[None]))

    def clone(self) -> PrimedDecoder:
        """A copy to start another stream from the same primed prompt without decoding it again."""
        new = copy.copy(self)
        new.stream = self.stream.clone()
        return new

    def _emit(self, samples: torch.Tensor) -> np.ndarray:
        x = samples[0]
        if self.to_skip:
            cut = min(self.to_skip, x.shape[0])
            x, self.to_skip = x[cut:], self.to_skip - cut
        return x.float().cpu().numpy()

    def decode(self, latents: torch.Tensor) -> np.ndarray:
        """(L, 64) generated latents -> (n,) float32 samples finished so far."""
        return self._emit(self.stream.decode(latents.to(self.device, self.dtype, non_blocking=True)[None]))

    def finish(self) -> np.ndarray:
        return self._emit(self.stream.finish())
