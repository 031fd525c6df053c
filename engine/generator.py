"""Batched autoregressive generation: one :meth:`Generator.step` advances every live stream by one
patch (prefill for new streams, one backbone token for the rest, the flow head for all in one call).

Per stream the state is small (positions, the last 3 backbone states, the last 8 latents, an RNG), so
a stream's latents depend only on its own inputs and seed, never on who shares the batch.
Slot bookkeeping (which slot a request owns) is the caller's; this module only reads ``Stream.slot``.
The backbone's keys live in a :class:`~engine.kv_cache.PagedCache`: a stream reserves the pages it may
need (:meth:`Generator.reserve`, or the scheduler through the cache's ``blocks``) and gives them back
when it ends. Any cache with the same interface works (the tests' per-slot reference cache does).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from engine.block_manager import NoPagesYet
from engine.kv_cache import PagedCache
from engine.layers.attention import AttentionFallback
from engine.models.core import FireRedTTS3Core, cosine_schedule
from engine.params import GenerationParams
from engine.prompt import VoicePrompt


@dataclass
class Stream:
    """One request's generation state. Created by :meth:`Generator.new_stream`."""

    slot: int
    tokens: torch.Tensor  # (1, T) prompt token ids
    prompt: VoicePrompt
    params: GenerationParams
    rng: torch.Generator
    position: int = 0  # next backbone position (= cached tokens)
    patches: int = 0  # patches generated so far
    finished: bool = False
    next_input: torch.Tensor | None = None  # (1, 1, hidden) backbone input of the next decode
    cond: torch.Tensor | None = None  # (1, 3, hidden) last 3 backbone states, zero-padded
    history: torch.Tensor | None = None  # (1, 8, 64) last clean latents
    spk_dit: torch.Tensor | None = None  # (1, spk_in_dim)

    @property
    def prefilled(self) -> bool:
        return self.next_input is not None or self.finished

    def prefix_length(self) -> int:
        return 1 + self.tokens.shape[1] + self.prompt.num_patches


@dataclass
class StepResult:
    latents: torch.Tensor | None  # (4, 64) float32 of the new patch, None if the stream stopped
    finished: bool
    reason: str = ""  # "stop" (stop head), "length" (max_patches) when finished


@dataclass
class Generator:
    """Runs steps for streams whose slots live in one :class:`PagedCache` (or a cache like it)."""

    core: FireRedTTS3Core
    cache: PagedCache
    _t_spans: dict = field(default_factory=dict)

    @property
    def device(self) -> torch.device:
        return self.cache.device

    @property
    def attention(self) -> str:
        """The backbone's attention path now: "sdpa" or "flashinfer"."""
        return self.cache.attention

    @property
    def attention_fallback_reason(self) -> str:
        """Why FlashInfer is not used ("" when it is, or SDPA was asked for); a metric label value."""
        return self.cache.attention_fallback_reason

    @property
    def dtype(self) -> torch.dtype:
        """The heads' and flow's dtype (the backbone may run in another: its inputs and outputs are cast)."""
        return self.core.stop_head.weight.dtype

    @property
    def backbone_dtype(self) -> torch.dtype:
        return self.core.backbone_llm.norm.weight.dtype

    def new_stream(
        self, slot: int, tokens: list[int], prompt: VoicePrompt, params: GenerationParams, reserve: bool = True
    ) -> Stream:
        """A checked stream in ``slot``; with ``reserve`` its cache pages are reserved too.

        Raises:
            ValueError: bad input, or a stream that could never fit this cache.
            NoPagesYet: (``reserve`` only) it fits, but not while the live streams hold their pages.
        """
        if prompt.num_patches < 1:
            raise ValueError("the voice prompt has no audio patches")
        if prompt.speaker.numel() != self.core.cfg.spk_in_dim:
            raise ValueError(
                f"the speaker embedding has {prompt.speaker.numel()} values; expected {self.core.cfg.spk_in_dim}"
            )
        if not (torch.isfinite(prompt.latents).all() and torch.isfinite(prompt.speaker).all()):
            raise ValueError("the voice prompt has non-finite values")
        vocab = self.core.cfg.backbone.vocab_size
        if not tokens or max(tokens) >= vocab or min(tokens) < 0:
            raise ValueError(f"token ids must be non-empty and in 0..{vocab - 1}")
        rng = torch.Generator(device="cpu").manual_seed(params.seed & 0xFFFF_FFFF_FFFF_FFFF)
        t = torch.tensor([tokens], dtype=torch.long).to(self.device, non_blocking=True)
        s = Stream(slot=slot, tokens=t, prompt=prompt, params=params, rng=rng)
        need = s.prefix_length() + params.max_patches
        if need > self.cache.max_len:
            raise ValueError(
                f"prompt of {s.prefix_length()} positions plus up to {params.max_patches} patches needs {need} "
                f"cache positions; this server has {self.cache.max_len} (shorten the text or reference audio)"
            )
        self.cache.check_fits(need)
        if reserve and not self.reserve(s):
            raise NoPagesYet(f"the KV cache has no room for {need} more positions until a stream ends")
        return s

    def reserve(self, s: Stream) -> bool:
        """Reserve the cache pages ``s`` may ever need; False when they are not free now."""
        return self.cache.reserve(s.slot, s.prefix_length() + s.params.max_patches)

    def release(self, s: Stream) -> None:
        """Give back ``s``'s pages (finished, cancelled or failed). Its slot may then take a new stream."""
        self.cache.release(s.slot)

    def _backbone(self, x: torch.Tensor, slots: list[int], starts: list[int]) -> torch.Tensor:
        """The backbone over ``x`` (B, T, hidden), row b being slot ``slots[b]`` from ``starts[b]``."""
        x = x.to(self.backbone_dtype)
        view = self.cache.batch(slots, starts, x.shape[1])
        try:
            h = self.core.backbone_llm(x, positions=view.positions, cache=view, mask=view.mask())
        except AttentionFallback as e:  # FlashInfer could not run: the same forward on SDPA
            self.cache.fall_back(e.reason, e.error)
            view = self.cache.batch(slots, starts, x.shape[1])
            h = self.core.backbone_llm(x, positions=view.positions, cache=view, mask=view.mask())
        return h.to(self.dtype)

    def _t_span(self, steps: int) -> torch.Tensor:
        if steps not in self._t_spans:
            self._t_spans[steps] = cosine_schedule(steps, self.device)
        return self._t_spans[steps]

    @torch.inference_mode()
    def step(self, streams: list[Stream]) -> list[StepResult]:
        """Advance each stream by one patch. Streams must be live and own distinct slots."""
        if len({s.slot for s in streams}) != len(streams):
            raise ValueError("two streams share a slot")
        hidden: dict[int, torch.Tensor] = {}  # index -> (1, hidden) newest backbone state
        new = [i for i, s in enumerate(streams) if not s.prefilled]
        old = [i for i, s in enumerate(streams) if s.prefilled]
        for i in new:
            hidden[i] = self._prefill(streams[i])
        if old:
            x = torch.cat([streams[i].next_input for i in old], dim=0)
            h = self._backbone(x, [streams[i].slot for i in old], [streams[i].position for i in old])
            for j, i in enumerate(old):
                streams[i].position += 1
                hidden[i] = h[j : j + 1, -1]
                streams[i].cond = torch.cat([streams[i].cond[:, 1:], h[j : j + 1]], dim=1)

        results: list[StepResult | None] = [None] * len(streams)
        last = torch.cat([hidden[i] for i in range(len(streams))], dim=0)
        p_stop = self.core.stop_probability(last).tolist()
        going = []
        for i, s in enumerate(streams):
            if p_stop[i] >= s.params.stop_threshold and s.patches >= s.params.min_patches:
                s.finished = True
                results[i] = StepResult(None, True, "stop")
            else:
                going.append(i)
        # one flow call per distinct step count (normally one)
        for steps in sorted({streams[i].params.steps for i in going}):
            group = [i for i in going if streams[i].params.steps == steps]
            lat = self._flow(group, streams, steps)
            emb = self.core.patch_encoder(lat.reshape(1, -1, lat.shape[-1])).reshape(len(group), 1, -1)
            for j, i in enumerate(group):
                s = streams[i]
                s.history = torch.cat([s.history[:, lat.shape[1] :], lat[j : j + 1]], dim=1)
                s.next_input = emb[j : j + 1]
                s.patches += 1
                done = s.patches >= s.params.max_patches
                s.finished = done
                results[i] = StepResult(lat[j].float(), done, "length" if done else "")
        return results

    def _prefill(self, s: Stream) -> torch.Tensor:
        core = self.core
        dt = self.dtype
        spk = s.prompt.speaker.to(self.device, dt, non_blocking=True)[None]
        lat = s.prompt.latents.to(self.device, dt, non_blocking=True)[None]
        x = core.prefix_embeddings(spk, s.tokens, lat)
        h = self._backbone(x, [s.slot], [0])
        s.position = x.shape[1]
        pad = h.new_zeros(1, core.cfg.num_history_patches, h.shape[-1])
        s.cond = torch.cat([pad, h[:, -s.prompt.num_patches :]], dim=1)[:, -(core.cfg.num_history_patches + 1) :]
        hist = torch.cat([lat.new_zeros(1, core.history_latents, lat.shape[-1]), lat], dim=1)
        s.history = hist[:, -core.history_latents :]
        s.spk_dit = core.spk_proj_dit(spk)
        return h[:, -1]

    def _flow(self, group: list[int], streams: list[Stream], steps: int) -> torch.Tensor:
        core = self.core
        ps, dim = core.cfg.patch_size, core.cfg.redae_dim
        noise = torch.cat([torch.randn(1, ps, dim, generator=streams[i].rng) for i in group])
        return core.flow(
            history=torch.cat([streams[i].history for i in group]),
            cond=core.dit_head(torch.cat([streams[i].cond for i in group])),
            spk_dit=torch.cat([streams[i].spk_dit for i in group]),
            noise=noise.to(self.device, non_blocking=True),
            t_span=self._t_span(steps),
            cfg_weight=torch.tensor([streams[i].params.cfg for i in group]).to(self.device, non_blocking=True),
        )
