"""Batched autoregressive generation: one :meth:`Generator.step` advances every live stream by one
backbone position (prefill for new streams, one token for the rest) and then, per (core, phase) group in
one batched call, either picks a text token (Instruct's text phase) or makes one patch (the flow head).

A stream's state (:mod:`engine.generator_state`) is small, so its output depends only on its own inputs
and seed, never on who shares the batch. Slots are the caller's; this module only reads ``Stream.slot``.
The backbone's keys live in a :class:`~engine.kv_cache.PagedCache`. A stream's pages are reserved, taken
step by step and given back by the caller's :class:`~engine.scheduler.Scheduler` (the one owner of the
pages), never here: :meth:`Generator.step` is handed the plan's new pages. Any cache with the same
interface works (the tests' per-slot reference cache, which needs no pages, does).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from engine.chatml import AUDIO_SOS_ID, LATENT_IN_ID, LATENT_OUT_ID, MAX_TEXT_TOKENS, TEXT_EOT_ID
from engine.config import REDAE_SCALE
from engine.generator_state import InstructInput, Phase, StepResult, Stream, TextStep, check_prompt, new_rng
from engine.invariant import batch_invariant, install
from engine.kv_cache import PagedCache
from engine.layers.attention import AttentionFallback
from engine.models.core import FireRedTTS3Core, cosine_schedule
from engine.params import GenerationParams
from engine.prompt import VoicePrompt
from engine.text_sampling import choose, host_ids, text_generator


@dataclass
class Generator:
    """Runs steps for streams whose slots live in one :class:`PagedCache` (or a cache like it).

    ``core`` is Base, ``instruct`` Instruct (either may be None); both backbones have one shape, so
    their streams share the cache's pages.
    """

    core: FireRedTTS3Core | None
    cache: PagedCache
    instruct: FireRedTTS3Core | None = None
    batch_invariant: bool = False  # a stream's bits the same alone or beside others (engine/invariant.py)
    _t_spans: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.core is None and self.instruct is None:
            raise ValueError("a generator needs a core")
        if self.core is not None and self.instruct is not None and self.core.cfg.backbone != self.instruct.cfg.backbone:
            raise ValueError("the Base and Instruct backbones differ in shape: they cannot share one KV cache")
        if self.batch_invariant:
            for core in self.cores.values():
                install(core)
            if self.cache.attention == "flashinfer":  # its kernels split a row's keys by the batch's work
                self.cache.fall_back("batch_invariant")

    @property
    def cores(self) -> dict[str, FireRedTTS3Core]:
        return {k: v for k, v in (("base", self.core), ("instruct", self.instruct)) if v is not None}

    @property
    def _any(self) -> FireRedTTS3Core:
        return self.core if self.core is not None else self.instruct

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
        return self._any.stop_head.weight.dtype

    @property
    def backbone_dtype(self) -> torch.dtype:
        return self._any.backbone.norm.weight.dtype

    def _core(self, model: str) -> FireRedTTS3Core:
        core = self.cores.get(model)
        if core is None:
            raise ValueError(f"the {model} model is not loaded on this server")
        return core

    def new_stream(self, slot: int, tokens: list[int], prompt: VoicePrompt, params: GenerationParams) -> Stream:
        """A checked Base stream in ``slot`` (its cache pages are the caller's to reserve).

        Raises:
            ValueError: bad input, the Base model not loaded, or a stream longer than the cache's rows.
        """
        check_prompt(prompt, self._core("base").cfg.spk_in_dim)
        s = Stream(slot=slot, tokens=self._tokens(tokens), prompt=prompt, params=params, rng=new_rng(params))
        return self._checked(s)

    def new_instruct_stream(self, slot: int, given: InstructInput, params: GenerationParams) -> Stream:
        """A checked Instruct stream in ``slot`` (in its text phase when ``given.sampling`` is set).

        Raises:
            ValueError: as :meth:`new_stream`.
        """
        self._core("instruct")
        tokens = self._tokens(given.tokens)
        given.check()
        rng, text = new_rng(params), given.sampling is not None  # text: a text phase, drawn on the device
        s = Stream(slot, tokens, None, params, rng, text_generator(self.device, rng) if text else None, "instruct",
                   Phase.TEXT if text else Phase.AUDIO, given)  # fmt: skip
        return self._checked(s)

    def _tokens(self, tokens: list[int]) -> torch.Tensor:
        vocab = self._any.cfg.backbone.vocab_size
        if not tokens or max(tokens) >= vocab or min(tokens) < 0:
            raise ValueError(f"token ids must be non-empty and in 0..{vocab - 1}")
        return torch.tensor([tokens], dtype=torch.long).to(self.device, non_blocking=True)

    def _checked(self, s: Stream) -> Stream:
        need = s.positions_needed()
        if need > self.cache.max_len:
            raise ValueError(
                f"prompt of {s.prefix_length()} positions plus up to {s.params.max_patches} patches needs {need} "
                f"cache positions; this server has {self.cache.max_len} (shorten the text or reference audio)"
            )
        return s

    def _backbone(self, core: FireRedTTS3Core, x: torch.Tensor, slots: list[int], starts: list[int]) -> torch.Tensor:
        """``core``'s backbone over ``x`` (B, T, hidden), row b being slot ``slots[b]`` from ``starts[b]``."""
        x = x.to(self.backbone_dtype)
        # batch-invariant: each decode row over its own keys (a prefill, T > 1, always runs alone)
        rows = {"rowwise": True} if self.batch_invariant and x.shape[1] == 1 else {}
        view = self.cache.batch(slots, starts, x.shape[1], **rows)
        try:
            h = core.backbone(x, positions=view.positions, cache=view, mask=view.mask())
        except AttentionFallback as e:  # FlashInfer could not run: the same forward on SDPA
            self.cache.fall_back(e.reason, e.error)
            view = self.cache.batch(slots, starts, x.shape[1], **rows)
            h = core.backbone(x, positions=view.positions, cache=view, mask=view.mask())
        return h.to(self.dtype)

    def _t_span(self, steps: int) -> torch.Tensor:
        if steps not in self._t_spans:
            self._t_spans[steps] = cosine_schedule(steps, self.device)
        return self._t_spans[steps]

    @torch.inference_mode()
    def step(self, streams: list[Stream], pages: dict[int, list[tuple[int, int]]] | None = None) -> list[StepResult]:
        """Advance each stream by one backbone position: a patch (audio phase) or a text token (text
        phase). Streams must be live and own distinct slots; ``pages`` are the step plan's new KV-cache
        pages (:attr:`engine.scheduler.StepPlan.pages`), written into the page table first."""
        with batch_invariant(self.batch_invariant):
            return self._step(streams, pages)

    def _step(self, streams: list[Stream], pages: dict | None) -> list[StepResult]:
        if len({s.slot for s in streams}) != len(streams):
            raise ValueError("two streams share a slot")
        if pages:
            self.cache.assign(pages)
        hidden: dict[int, torch.Tensor] = {}  # index -> (1, hidden) newest backbone state
        old = [i for i, s in enumerate(streams) if s.prefilled]
        with batch_invariant(False):  # a prefill always runs alone: the plain products are its same bits
            for i, s in enumerate(streams):
                if not s.prefilled:
                    hidden[i] = self._prefill(s) if s.instruct is None else self._prefill_instruct(s)
        for model, core in self.cores.items():  # one backbone call per core
            rows = [i for i in old if streams[i].model == model]
            if not rows:
                continue
            x = torch.cat([streams[i].next_input for i in rows], dim=0)
            h = self._backbone(core, x, [streams[i].slot for i in rows], [streams[i].position for i in rows])
            for j, i in enumerate(rows):
                s = streams[i]
                s.position += 1
                hidden[i] = h[j : j + 1, -1]
                if s.phase is Phase.AUDIO:
                    s.cond = torch.cat([s.cond[:, 1:], h[j : j + 1]], dim=1)
        results: list[StepResult | None] = [None] * len(streams)
        audio = [i for i, s in enumerate(streams) if s.phase is Phase.AUDIO]
        self._text(streams, [i for i, s in enumerate(streams) if s.phase is Phase.TEXT], hidden, results)
        for model, core in self.cores.items():
            rows = [i for i in audio if streams[i].model == model]
            if rows:
                self._audio(core, streams, rows, hidden, results)
        return results

    def _text(self, streams: list[Stream], rows: list[int], hidden: dict, results: list) -> None:
        """The text phase's rows: pick a token (one LM head and one sampling call for all, on the device),
        or feed the plan's last token and then <|sosp|> as the reference does after its text loop."""
        if not rows:
            return
        core = self.instruct
        picking = [i for i in rows if streams[i].text_step is TextStep.PICK]
        if picking:
            logits, pickers = core.text_logits(torch.cat([hidden[i] for i in picking])), [streams[i] for i in picking]
            ids = choose(logits, [s.text_ids for s in pickers], [s.instruct.sampling for s in pickers],
                         [s.text_rng for s in pickers])  # fmt: skip
            picked = host_ids(ids)  # the text rows' one read: their ids (refused before they are embedded)
            embedded = self._embed(core, ids)
            for j, (i, token) in enumerate(zip(picking, picked, strict=True)):
                s = streams[i]
                s.next_input = embedded[j : j + 1]
                if token != TEXT_EOT_ID:
                    s.text_ids.append(token)
                done = token == TEXT_EOT_ID or len(s.text_ids) >= MAX_TEXT_TOKENS
                s.text_step = TextStep.FEED_LAST if done else TextStep.PICK
                results[i] = StepResult(None, False, text_ids=list(s.text_ids) if done else None)
        for i in rows:
            s = streams[i]
            if results[i] is not None:
                continue
            if s.text_step is TextStep.FEED_LAST:  # fed the plan's last token: next <|sosp|>
                s.next_input, s.text_step = self._embed(core, torch.tensor([AUDIO_SOS_ID])), TextStep.FEED_SOS
            else:  # fed <|sosp|>; the reference's audio loop then feeds <|sosp|> AGAIN as its first input
                # (its input variable still holds it), so the audio phase starts from the same input
                s.phase = Phase.AUDIO
                s.cond = hidden[i].new_zeros(1, core.cfg.num_history_patches + 1, hidden[i].shape[-1])
            results[i] = StepResult(None, False)

    def _embed(self, core: FireRedTTS3Core, ids: torch.Tensor) -> torch.Tensor:
        """(n,) token ids, on the device or the host (copied without a sync) -> (n, 1, hidden) backbone inputs."""
        return core.backbone.embed_tokens(ids.to(self.device, non_blocking=True)[:, None]).to(self.dtype)

    def _audio(self, core: FireRedTTS3Core, streams: list[Stream], rows: list[int], hidden: dict, results: list):
        """The audio phase's rows of one core: the stop test, then one patch each (one flow call per step
        count, normally one)."""
        p_stop = core.stop_probability(torch.cat([hidden[i] for i in rows])).tolist()
        going = []
        for i, p in zip(rows, p_stop, strict=True):
            s = streams[i]
            if p >= s.params.stop_threshold and s.patches >= s.params.min_patches:
                s.finished = True
                results[i] = StepResult(None, True, "stop")
            else:
                going.append(i)
        scale = REDAE_SCALE if core.cfg.instruct else 1.0
        for steps in sorted({streams[i].params.steps for i in going}):
            group = [i for i in going if streams[i].params.steps == steps]
            lat = self._flow(core, group, streams, steps)
            emb = core.patch_encoder(lat.reshape(1, -1, lat.shape[-1])).reshape(len(group), 1, -1)
            for j, i in enumerate(group):
                s = streams[i]
                s.history = torch.cat([s.history[:, lat.shape[1] :], lat[j : j + 1]], dim=1)
                s.next_input = emb[j : j + 1]
                s.patches += 1
                done = s.patches >= s.params.max_patches
                s.finished = done
                out = lat[j].float() if scale == 1.0 else lat[j].float() / scale  # the reference decodes gen / 0.4
                results[i] = StepResult(out, done, "length" if done else "")

    def _prefill(self, s: Stream) -> torch.Tensor:
        core = self.core
        dt = self.dtype
        spk = s.prompt.speaker.to(self.device, dt, non_blocking=True)[None]
        lat = s.prompt.latents.to(self.device, dt, non_blocking=True)[None]
        x = core.prefix_embeddings(spk, s.tokens, lat)
        h = self._backbone(core, x, [s.slot], [0])
        s.position = x.shape[1]
        pad = h.new_zeros(1, core.cfg.num_history_patches, h.shape[-1])
        s.cond = torch.cat([pad, h[:, -s.prompt.num_patches :]], dim=1)[:, -(core.cfg.num_history_patches + 1) :]
        hist = torch.cat([lat.new_zeros(1, core.history_latents, lat.shape[-1]), lat], dim=1)
        s.history = hist[:, -core.history_latents :]
        s.spk_dit = core.speaker_dit(spk)
        return h[:, -1]

    def _prefill_instruct(self, s: Stream) -> torch.Tensor:
        """The ChatML prefix with its placeholders filled by PatchEncoder outputs of the latents x 0.4."""
        core, dt, given = self.instruct, self.dtype, s.instruct
        scaled, fills = {}, []
        for token_id, latents in ((LATENT_IN_ID, given.latents_in), (LATENT_OUT_ID, given.latents_out)):
            if latents is not None:
                latents = latents.to(self.device, torch.float32, non_blocking=True)
                scaled[token_id] = (latents * REDAE_SCALE).to(dt)[None]
                fills.append(([j for j, t in enumerate(given.tokens) if t == token_id], scaled[token_id]))
        x = core.chatml_embeddings(s.tokens, fills, dt)
        h = self._backbone(core, x, [s.slot], [0])
        s.position = x.shape[1]
        out = scaled.get(LATENT_OUT_ID, h.new_zeros(1, 0, core.cfg.redae_dim))
        hist = torch.cat([out.new_zeros(1, core.history_latents, out.shape[-1]), out], dim=1)
        s.history = hist[:, -core.history_latents :]
        s.spk_dit = core.speaker_dit(None)
        if s.phase is Phase.AUDIO:  # cloning: the prompt's last P states; acoustic edit: the last one
            pad = h.new_zeros(1, core.cfg.num_history_patches, h.shape[-1])
            last = h[:, -max(given.prompt_patches, 1) :]
            s.cond = torch.cat([pad, last], dim=1)[:, -(core.cfg.num_history_patches + 1) :]
        return h[:, -1]

    def _flow(self, core: FireRedTTS3Core, group: list[int], streams: list[Stream], steps: int) -> torch.Tensor:
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
