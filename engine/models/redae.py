"""RedAE: the audio autoencoder. Encoder: 24 kHz audio -> 64-d latents at 25 Hz. Decoder: latents ->
50 Hz frames -> log-magnitude/phase spectra -> iSTFT. Both transformers are causal with a 64-token
sliding window, so the decoder streams with a bounded cache (:class:`DecoderStream`)."""

from __future__ import annotations

import copy

import torch
from torch import nn

from engine.config import RedAEConfig
from engine.kv_cache import WindowCache
from engine.layers.qwen3 import Qwen3Stack
from engine.spectral import StreamingISTFT, hann_window, spectrum_to_frames


class ClsDownsample(nn.Module):
    """Pairs of 50 Hz frames -> one 25 Hz vector: a CLS token goes last, a short causal stack reads it."""

    def __init__(self, cfg: RedAEConfig):
        super().__init__()
        self.rate = cfg.enc_extra_downsample_rate
        self.cls_tok = nn.Parameter(torch.ones(1, 1, cfg.enc_hidden_size))
        self.qwen3 = Qwen3Stack(cfg.downsample)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x (B, T, C) at 50 Hz -> (B, T / 2, C)."""
        b, t, c = x.shape
        x = x.reshape(-1, self.rate, c)
        x = torch.cat([x, self.cls_tok.expand(x.shape[0], -1, -1)], dim=1)
        return self.qwen3(x)[:, -1].reshape(b, t // self.rate, c)


class RedAEEncoder(nn.Module):
    def __init__(self, cfg: RedAEConfig):
        super().__init__()
        self.frame = cfg.audio_patch_size
        h = cfg.enc_hidden_size
        self.in_proj = nn.Sequential(nn.Linear(self.frame, h), nn.Linear(h, h))
        self.qwen3 = Qwen3Stack(cfg.encoder)
        self.downsample = ClsDownsample(cfg)
        self.out_proj = nn.Linear(h, cfg.bottleneck_dim)

    def forward(self, audio: torch.Tensor) -> torch.Tensor:
        """audio (B, N) at 24 kHz, N a multiple of 960 -> latents (B, N / 960, 64)."""
        if audio.shape[1] % (2 * self.frame):
            raise ValueError(f"audio length {audio.shape[1]} is not a multiple of {2 * self.frame} samples")
        x = audio.unfold(1, self.frame, self.frame)
        x = self.qwen3(self.in_proj(x))
        return self.out_proj(self.downsample(x))


class ISTFTHead(nn.Module):
    def __init__(self, dim: int, n_fft: int):
        super().__init__()
        self.out = nn.Linear(dim, n_fft + 2)


class RedAEDecoder(nn.Module):
    def __init__(self, cfg: RedAEConfig):
        super().__init__()
        self.cfg = cfg
        self.hidden = cfg.dec_hidden_size
        self.upsample = cfg.enc_extra_downsample_rate
        self.hop = cfg.audio_patch_size
        self.n_fft = 4 * cfg.audio_patch_size
        self.in_proj = nn.Linear(cfg.bottleneck_dim, self.upsample * self.hidden)
        self.qwen3 = Qwen3Stack(cfg.decoder)
        self.istft_head = ISTFTHead(self.hidden, self.n_fft)

    def frames(self, hidden: torch.Tensor) -> torch.Tensor:
        """(B, T, C) decoder states -> (B, T, n_fft) windowed time frames (float32)."""
        spec = self.istft_head.out(hidden)
        log_mag, phase = spec.chunk(2, dim=-1)
        return spectrum_to_frames(log_mag, phase, self.n_fft, hann_window(self.n_fft, hidden.device))

    def upsample_latents(self, latents: torch.Tensor) -> torch.Tensor:
        """(B, L, 64) -> (B, 2L, C): latent i gives frames 2i and 2i+1."""
        return self.in_proj(latents).reshape(latents.shape[0], -1, self.hidden)

    def forward(self, latents: torch.Tensor) -> torch.Tensor:
        """Whole-utterance decode without a cache: latents (B, L, 64) -> audio (B, L * 960)."""
        x = self.qwen3(self.upsample_latents(latents))
        istft = StreamingISTFT(latents.shape[0], self.n_fft, self.hop, latents.device)
        return torch.cat([istft.push(self.frames(x)), istft.flush()], dim=1)

    def stream(self, batch: int = 1) -> DecoderStream:
        return DecoderStream(self, batch)


class DecoderStream:
    """Incremental decode of B streams: the window cache of every layer plus the iSTFT tail.

    ``decode(latents)`` returns the samples finished so far; ``finish()`` returns the rest. Feeding a
    prompt first and discarding its samples primes the decoder exactly like offline decoding of
    [prompt + generated] latents.
    """

    def __init__(self, decoder: RedAEDecoder, batch: int):
        self.decoder = decoder
        self.cache = WindowCache(decoder.cfg.dec_num_hidden_layers, decoder.cfg.dec_sliding_window)
        self.istft: StreamingISTFT | None = None
        self.batch = batch
        self.position = 0  # next 50 Hz frame position

    @torch.inference_mode()
    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """latents (B, L, 64) -> (B, n) float32 samples finished by this chunk."""
        dec = self.decoder
        if self.istft is None:
            self.istft = StreamingISTFT(self.batch, dec.n_fft, dec.hop, latents.device)
        x = dec.upsample_latents(latents)
        t = x.shape[1]
        pos = torch.arange(self.position, self.position + t, device=x.device).expand(x.shape[0], t)
        mask = self.cache.begin(pos)
        x = dec.qwen3(x, positions=pos, cache=self.cache, mask=mask)
        self.cache.commit()
        self.position += t
        return self.istft.push(dec.frames(x))

    def clone(self) -> DecoderStream:
        """An independent copy of this stream's state (e.g. a primed prompt reused by many streams)."""
        new = copy.copy(self)
        new.cache = self.cache.clone()
        new.istft = self.istft.clone() if self.istft is not None else None
        return new

    @torch.inference_mode()
    def finish(self) -> torch.Tensor:
        if self.istft is None:
            return torch.zeros(self.batch, 0)
        return self.istft.flush()


def joinable(streams: list[DecoderStream]) -> bool:
    """Whether single-row streams can decode their next chunk in one batched forward: past the
    priming transient (cache full-shaped alike, iSTFT envelope in steady state, nothing left to trim)."""
    if len(streams) < 2:
        return False
    first = streams[0]
    if first.istft is None or first.cache.pos is None:
        return False
    for s in streams:
        if s.batch != 1 or s.istft is None or s.cache.pos is None or s.istft.to_trim:
            return False
        if s.istft.frames < s.istft.overlap or s.cache.pos.shape != first.cache.pos.shape:
            return False
        # frames >= overlap: the envelope tails are all the steady-state one, bit for bit (frames add in
        # order), so they are not compared on the device (a host sync per stream)
    return True


@torch.inference_mode()
def decode_together(streams: list[DecoderStream], latents: torch.Tensor) -> torch.Tensor:
    """One chunk of equal length for each of B :func:`joinable` streams in a single batched forward.

    Args:
        latents: (B, L, 64), row b for ``streams[b]``.
    Returns:
        (B, n) samples, row b equal (to float rounding) to ``streams[b].decode(latents[b:b+1])``.
    """
    dec = streams[0].decoder
    x = dec.upsample_latents(latents)
    t = x.shape[1]
    pos = torch.stack([torch.arange(s.position, s.position + t, device=x.device) for s in streams])
    cache = WindowCache.stack([s.cache for s in streams])
    mask = cache.begin(pos)
    x = dec.qwen3(x, positions=pos, cache=cache, mask=mask)
    cache.commit()
    istft = StreamingISTFT.stack([s.istft for s in streams])
    out = istft.push(dec.frames(x))
    for b, s in enumerate(streams):
        frames = s.istft.frames + t
        s.cache, s.istft = cache.row(b), istft.row(b)
        s.istft.frames = frames
        s.position += t
    return out
