"""The LLM-DiT cores of FireRedTTS3: Qwen3 backbone, PatchEncoder, DiT flow head, stop head, and for Base
the speaker projections. Parameter names match ``fireredtts3_base/model.safetensors`` and
``fireredtts3_instruct/model.safetensors`` (whose backbone is a ``Qwen3ForCausalLM``: ``backbone_llm.model.*``,
its LM head tied to the token embedding; it has no speaker parts and its DiT sees no speaker channels).

The autoregressive loop itself lives in :mod:`engine.generator`; this module holds the networks and
the batched pieces one step needs.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from engine.config import CoreConfig
from engine.layers.qwen3 import Qwen3Stack
from engine.models.dit import DiT
from engine.models.patch_encoder import PatchEncoder


def cosine_schedule(steps: int, device=None) -> torch.Tensor:
    """(steps + 1,) times ``t = 1 - cos(pi/2 * s)`` for s evenly spaced in [0, 1]."""
    s = torch.linspace(0, 1, steps + 1, device=device)
    return 1 - torch.cos(s * 0.5 * math.pi)


class CausalBackbone(nn.Module):
    """Instruct's ``backbone_llm``: Hugging Face's ``Qwen3ForCausalLM`` names (``model.*``); the LM head
    is the token embedding (tied), so it has no tensor of its own."""

    def __init__(self, cfg):
        super().__init__()
        self.model = Qwen3Stack(cfg, with_embeddings=True)


class FireRedTTS3Core(nn.Module):
    """Base (``cfg.instruct`` False) or Instruct core; :attr:`backbone` is the Qwen3 stack of either."""

    def __init__(self, cfg: CoreConfig):
        super().__init__()
        self.cfg = cfg
        h = cfg.backbone.hidden_size
        if cfg.instruct:
            self.backbone_llm = CausalBackbone(cfg.backbone)
        else:
            self.backbone_llm = Qwen3Stack(cfg.backbone, with_embeddings=True)
            self.spk_proj_llm = nn.Linear(cfg.spk_in_dim, h)
            self.spk_proj_dit = nn.Linear(cfg.spk_in_dim, cfg.spk_in_dim)
        self.patch_encoder = PatchEncoder(
            cfg.redae_dim, h, cfg.patch_size, cfg.patch_encoder_hidden_size, cfg.patch_encoder_depth,
            cfg.patch_encoder_num_heads, cfg.patch_encoder_mlp_ratio,
        )  # fmt: skip
        self.dit_head = nn.Linear(h, cfg.dit_hidden_size)
        self.dit = DiT(
            cfg.redae_dim + cfg.dit_hidden_size + cfg.speaker_dim, cfg.redae_dim, cfg.dit_hidden_size,
            cfg.dit_depth, cfg.dit_num_heads, cfg.dit_mlp_ratio,
        )  # fmt: skip
        self.stop_head = nn.Linear(h, 1)

    @property
    def backbone(self) -> Qwen3Stack:
        return self.backbone_llm.model if self.cfg.instruct else self.backbone_llm

    @property
    def history_latents(self) -> int:
        return self.cfg.num_history_patches * self.cfg.patch_size

    def speaker_dit(self, spk: torch.Tensor | None, batch: int = 1) -> torch.Tensor:
        """(B, spk_in_dim) speaker embedding -> the DiT's speaker condition; Instruct: (batch, 0)."""
        if self.cfg.instruct:
            return self.stop_head.weight.new_zeros(batch, 0)
        return self.spk_proj_dit(spk)

    def text_logits(self, h: torch.Tensor) -> torch.Tensor:
        """(B, hidden) last backbone states -> (B, vocab) float32 scores of the tied LM head (Instruct)."""
        weight = self.backbone.embed_tokens.weight
        return F.linear(h.to(weight.dtype), weight).float()

    def chatml_embeddings(
        self, tokens: torch.Tensor, fills: list[tuple[list[int], torch.Tensor]], dtype: torch.dtype
    ) -> torch.Tensor:
        """Backbone input of an Instruct stream: the token embeddings of its ChatML ids, the placeholders
        at each fill's positions replaced in order by the PatchEncoder's outputs of its latents (the
        reference's ``masked_scatter``; positions come from the host, so no device read is needed).

        Args:
            tokens: (1, T) int64; fills: (placeholder positions, (1, 4P, 64) scaled latents) pairs.
        Returns:
            (1, T, hidden) in ``dtype``.
        Raises:
            ValueError: a fill's position count differs from its latents' patch count.
        """
        x = self.backbone.embed_tokens(tokens).to(dtype)
        for positions, latents in fills:
            patches = latents.shape[1] // self.cfg.patch_size
            if len(positions) != patches:
                raise ValueError(f"the ChatML ids hold {len(positions)} placeholders for {patches} patches")
            if patches:
                where = torch.tensor(positions, dtype=torch.long).to(x.device, non_blocking=True)
                x[0, where] = self.patch_encoder(latents)[0].to(dtype)
        return x

    def prefix_embeddings(self, spk: torch.Tensor, tokens: torch.Tensor, prompt_latents: torch.Tensor):
        """Backbone input of a new stream: [speaker, text tokens, one embedding per prompt patch].

        Args:
            spk: (1, spk_in_dim); tokens: (1, T) int64; prompt_latents: (1, 4P, 64).
        Returns:
            (1, 1 + T + P, hidden).
        """
        first = self.spk_proj_llm(spk)[:, None]  # the backbone may run in another dtype than the heads
        parts = [first, self.backbone.embed_tokens(tokens).to(first.dtype), self.patch_encoder(prompt_latents)]
        return torch.cat(parts, dim=1)

    def stop_probability(self, h: torch.Tensor) -> torch.Tensor:
        """(B, hidden) last backbone states -> (B,) float32 stop probabilities."""
        return torch.sigmoid(self.stop_head(h).squeeze(-1).float())

    def flow(
        self,
        history: torch.Tensor,
        cond: torch.Tensor,
        spk_dit: torch.Tensor,
        noise: torch.Tensor,
        t_span: torch.Tensor,
        cfg_weight: torch.Tensor,
    ) -> torch.Tensor:
        """Euler-integrate one patch for B streams with classifier-free guidance (2B DiT rows per step).

        Args:
            history: (B, 8, 64) clean latents before the patch.
            cond: (B, 3, dit_hidden) ``dit_head`` of the last 3 backbone states (zeros before the start).
            spk_dit: (B, speaker_dim) :meth:`speaker_dit` of the speaker embedding ((B, 0) for Instruct).
            noise: (B, 4, 64) starting noise.
            t_span: (steps + 1,) schedule from :func:`cosine_schedule`.
            cfg_weight: (B,) guidance w; v = (1 + w) v_cond - w v_uncond (the unconditional row zeroes
                both conditions and keeps the history).
        Returns:
            (B, 4, 64) latents of the patch.
        """
        b, p = noise.shape[0], self.cfg.patch_size
        xt = torch.cat([history, noise.to(history.dtype)], dim=1)
        n = xt.shape[1]
        c = torch.cat([cond.repeat_interleave(p, dim=1), spk_dit[:, None].expand(b, n, -1)], dim=-1)
        c = torch.cat([c, torch.zeros_like(c)], dim=0)
        w = cfg_weight.to(xt.dtype).view(b, 1, 1)
        for i in range(len(t_span) - 1):
            t = t_span[i]
            dt = t_span[i + 1] - t
            x_in = torch.cat([xt.repeat(2, 1, 1), c], dim=-1)
            v = self.dit(x_in, t.expand(2 * b).to(xt.dtype))
            v_c, v_u = v.chunk(2, dim=0)
            v = (1.0 + w) * v_c - w * v_u
            xt[:, -p:] = xt[:, -p:] + dt * v[:, -p:]
        return xt[:, -p:]
