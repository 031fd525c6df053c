"""CAM++ speaker encoder: Kaldi fbank frames -> one speaker embedding per utterance.

The module tree reproduces the parameter names and shapes of 3D-Speaker's `CAMPPlus`
as FireRedTTS3 uses it, so the released `campplus_voxceleb.bin` (a plain state dict)
loads strictly. One network in one file (over 300 lines because its blocks only make sense together and
mirror the released checkpoint's module tree). The network, front to back:

- `head`: a 2-D residual CNN over (frequency, time) that divides the frequency axis
  by 8 (three stride-2 steps) and flattens channels x frequency.
- `xvector.tdnn`: Conv1d k=5 stride 2 (halves the frame rate), BatchNorm, ReLU.
- `xvector.block{i}` / `transit{i}`: densely connected TDNN layers whose outputs are
  scaled by a context-aware gate (utterance mean + 100-frame segment means), each block
  followed by a 1x1 conv that halves the channels.
- statistics pooling (mean and unbiased std over time) and a 1x1 conv to the embedding,
  with a BatchNorm that has no affine part. The embedding is not length-normalised.
"""

from __future__ import annotations

import dataclasses
import os
import pickle
import re
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from engine.fbank import SPK_SAMPLE_RATE, kaldi_fbank
from engine.protocol import SAMPLE_RATE
from engine.resample import resample

_SEGMENT_FRAMES = 100  # the gate's local context: mean over 100-frame (2 s) segments
_HEAD_BLOCKS = 2  # residual blocks in each of the head's two stages (fixed in 3D-Speaker)


@dataclass(frozen=True)
class CamppConfig:
    """Sizes of a CAM++ network; the defaults are the released VoxCeleb model."""

    feat_dim: int = 80  # fbank bins per frame; a multiple of 8 (the head strides 2 three times)
    embedding_size: int = 512  # width of the speaker embedding
    m_channels: int = 32  # channels of the 2-D head
    init_channels: int = 128  # output channels of the first TDNN layer
    growth_rate: int = 32  # channels each dense TDNN layer adds
    bn_size: int = 4  # bottleneck width of a dense layer, in multiples of growth_rate
    block_layers: tuple[int, ...] = (12, 24, 16)  # dense layers per block
    kernel_sizes: tuple[int, ...] = (3, 3, 3)  # temporal kernel of each block (odd)
    dilations: tuple[int, ...] = (1, 2, 2)  # temporal dilation of each block

    def __post_init__(self) -> None:
        sizes = dataclasses.asdict(self)
        for name in ("feat_dim", "embedding_size", "m_channels", "init_channels", "growth_rate", "bn_size"):
            if sizes[name] <= 0:
                raise ValueError(f"CamppConfig.{name} must be positive, got {sizes[name]}")
        if self.feat_dim % 8:
            raise ValueError(f"CamppConfig.feat_dim must be a multiple of 8, got {self.feat_dim}")
        n = len(self.block_layers)
        if n == 0 or len(self.kernel_sizes) != n or len(self.dilations) != n:
            raise ValueError(
                "CamppConfig.block_layers, kernel_sizes and dilations must be non-empty and of equal "
                f"length, got {self.block_layers}, {self.kernel_sizes}, {self.dilations}"
            )
        if any(k <= 0 or k % 2 == 0 for k in self.kernel_sizes):
            raise ValueError(f"CamppConfig.kernel_sizes must be odd and positive, got {self.kernel_sizes}")
        if any(v <= 0 for v in self.block_layers + self.dilations):
            raise ValueError("CamppConfig.block_layers and dilations must be positive")

    @property
    def head_channels(self) -> int:
        """Channels entering the TDNN: head channels x remaining frequency bins."""
        return self.m_channels * (self.feat_dim // 8)

    @classmethod
    def tiny(cls) -> CamppConfig:
        """A small random-weight variant for tests (the `tiny` preset's sizes); same input and output sizes."""
        return cls(m_channels=8, init_channels=32, growth_rate=8, bn_size=2, block_layers=(2, 2, 2))

    @classmethod
    def from_state_dict(cls, sd: dict[str, torch.Tensor], dilations: tuple[int, ...] | None = None) -> CamppConfig:
        """Infers the sizes from parameter names and shapes.

        Dilations leave no trace in the weights: unless given, the released model's
        pattern is assumed (1 for the first block, 2 for every later one).

        Raises:
            ValueError: a tensor the inference needs is missing or inconsistent.
        """

        def shape(key: str) -> tuple[int, ...]:
            if key not in sd:
                raise ValueError(f"not a CAM++ state dict: it has no {key!r}")
            return tuple(sd[key].shape)

        m_channels = shape("head.conv1.weight")[0]
        init_channels, head_channels, _ = shape("xvector.tdnn.linear.weight")
        if head_channels % m_channels:
            raise ValueError(
                f"CAM++ state dict: TDNN input {head_channels} is not a multiple of head channels {m_channels}"
            )
        layers: dict[int, int] = {}
        for key in sd:
            hit = re.match(r"xvector\.block(\d+)\.tdnnd(\d+)\.", key)
            if hit:
                block, layer = int(hit[1]), int(hit[2])
                layers[block] = max(layers.get(block, 0), layer)
        if sorted(layers) != list(range(1, len(layers) + 1)) or not layers:
            raise ValueError(f"CAM++ state dict: dense blocks must be numbered 1..n, found {sorted(layers)}")
        growth_rate, bottleneck = shape("xvector.block1.tdnnd1.cam_layer.linear_local.weight")[:2]
        n = len(layers)
        return cls(
            feat_dim=8 * (head_channels // m_channels),
            embedding_size=shape("xvector.dense.linear.weight")[0],
            m_channels=m_channels,
            init_channels=init_channels,
            growth_rate=growth_rate,
            bn_size=bottleneck // growth_rate,
            block_layers=tuple(layers[b] for b in range(1, n + 1)),
            kernel_sizes=tuple(
                shape(f"xvector.block{b}.tdnnd1.cam_layer.linear_local.weight")[2] for b in range(1, n + 1)
            ),
            dilations=dilations if dilations is not None else (1,) + (2,) * (n - 1),
        )


class _BatchNormAct(nn.Module):
    """BatchNorm1d, optionally followed by ReLU (stored as `.batchnorm` for the names)."""

    def __init__(self, channels: int, relu: bool = True, affine: bool = True) -> None:
        super().__init__()
        self.batchnorm = nn.BatchNorm1d(channels, affine=affine)
        self.relu = relu

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.batchnorm(x)
        return F.relu(x) if self.relu else x


class _ResBlock2d(nn.Module):
    """Two 3x3 convs with a skip; `stride` applies to frequency only."""

    def __init__(self, channels: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(channels, channels, 3, stride=(stride, 1), padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(channels)
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(channels)
        self.shortcut = None
        if stride != 1:
            self.shortcut = nn.Sequential(
                nn.Conv2d(channels, channels, 1, stride=(stride, 1), bias=False), nn.BatchNorm2d(channels)
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        skip = x if self.shortcut is None else self.shortcut(x)
        y = F.relu(self.bn1(self.conv1(x)))
        return F.relu(self.bn2(self.conv2(y)) + skip)


class _FrequencyHead(nn.Module):
    """(B, F, T) fbank -> (B, m_channels * F/8, T) feature maps."""

    def __init__(self, cfg: CamppConfig) -> None:
        super().__init__()
        c = cfg.m_channels
        self.conv1 = nn.Conv2d(1, c, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(c)
        self.layer1 = nn.Sequential(*[_ResBlock2d(c, 2 if i == 0 else 1) for i in range(_HEAD_BLOCKS)])
        self.layer2 = nn.Sequential(*[_ResBlock2d(c, 2 if i == 0 else 1) for i in range(_HEAD_BLOCKS)])
        self.conv2 = nn.Conv2d(c, c, 3, stride=(2, 1), padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(c)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.bn1(self.conv1(x.unsqueeze(1))))
        x = self.layer2(self.layer1(x))
        x = F.relu(self.bn2(self.conv2(x)))
        return x.flatten(1, 2)


class _ConvBN(nn.Module):
    """`linear` conv then `nonlinear` BatchNorm(+ReLU): the TDNN input and embedding layers."""

    def __init__(self, c_in: int, c_out: int, kernel: int, stride: int = 1, relu: bool = True, affine: bool = True):
        super().__init__()
        self.linear = nn.Conv1d(c_in, c_out, kernel, stride=stride, padding=kernel // 2, bias=False)
        self.nonlinear = _BatchNormAct(c_out, relu=relu, affine=affine)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.nonlinear(self.linear(x))


class _ContextGate(nn.Module):
    """Dilated conv whose output is gated by utterance- and segment-level context."""

    def __init__(self, c_in: int, c_out: int, kernel: int, dilation: int) -> None:
        super().__init__()
        self.linear_local = nn.Conv1d(
            c_in, c_out, kernel, padding=(kernel - 1) // 2 * dilation, dilation=dilation, bias=False
        )
        self.linear1 = nn.Conv1d(c_in, c_in // 2, 1)
        self.linear2 = nn.Conv1d(c_in // 2, c_out, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        frames = x.shape[-1]
        segments = F.avg_pool1d(x, _SEGMENT_FRAMES, _SEGMENT_FRAMES, ceil_mode=True)
        segments = segments.repeat_interleave(_SEGMENT_FRAMES, dim=-1)[..., :frames]
        context = x.mean(-1, keepdim=True) + segments
        gate = torch.sigmoid(self.linear2(F.relu(self.linear1(context))))
        return self.linear_local(x) * gate


class _DenseLayer(nn.Module):
    """BN-ReLU, 1x1 bottleneck, BN-ReLU, context-gated conv: adds growth_rate channels."""

    def __init__(self, c_in: int, cfg: CamppConfig, kernel: int, dilation: int) -> None:
        super().__init__()
        bottleneck = cfg.bn_size * cfg.growth_rate
        self.nonlinear1 = _BatchNormAct(c_in)
        self.linear1 = nn.Conv1d(c_in, bottleneck, 1, bias=False)
        self.nonlinear2 = _BatchNormAct(bottleneck)
        self.cam_layer = _ContextGate(bottleneck, cfg.growth_rate, kernel, dilation)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.cam_layer(self.nonlinear2(self.linear1(self.nonlinear1(x))))


class _DenseBlock(nn.Module):
    """Layers `tdnnd1..N`; each sees the concatenation of the input and all earlier outputs."""

    def __init__(self, c_in: int, num_layers: int, cfg: CamppConfig, kernel: int, dilation: int) -> None:
        super().__init__()
        for i in range(num_layers):
            self.add_module(f"tdnnd{i + 1}", _DenseLayer(c_in + i * cfg.growth_rate, cfg, kernel, dilation))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.children():
            x = torch.cat([x, layer(x)], dim=1)
        return x


class _Transition(nn.Module):
    """BN-ReLU then a 1x1 conv that halves the channels."""

    def __init__(self, c_in: int, c_out: int) -> None:
        super().__init__()
        self.nonlinear = _BatchNormAct(c_in)
        self.linear = nn.Conv1d(c_in, c_out, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(self.nonlinear(x))


class _XVector(nn.Module):
    """(B, head_channels, T) -> (B, embedding_size)."""

    def __init__(self, cfg: CamppConfig) -> None:
        super().__init__()
        self.tdnn = _ConvBN(cfg.head_channels, cfg.init_channels, 5, stride=2)
        channels = cfg.init_channels
        self.num_blocks = len(cfg.block_layers)
        for i, (n, k, d) in enumerate(zip(cfg.block_layers, cfg.kernel_sizes, cfg.dilations), start=1):
            self.add_module(f"block{i}", _DenseBlock(channels, n, cfg, k, d))
            channels += n * cfg.growth_rate
            self.add_module(f"transit{i}", _Transition(channels, channels // 2))
            channels //= 2
        self.out_nonlinear = _BatchNormAct(channels)
        self.dense = _ConvBN(2 * channels, cfg.embedding_size, 1, relu=False, affine=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.tdnn(x)
        for i in range(1, self.num_blocks + 1):
            x = getattr(self, f"transit{i}")(getattr(self, f"block{i}")(x))
        x = self.out_nonlinear(x)
        stats = torch.cat([x.mean(-1), x.std(-1, unbiased=True)], dim=-1)
        return self.dense(stats.unsqueeze(-1)).squeeze(-1)


class SpeakerEncoder(nn.Module):
    """CAM++ x-vector network; built in eval mode (it is only used for inference)."""

    def __init__(self, config: CamppConfig | None = None) -> None:
        super().__init__()
        self.config = config or CamppConfig()
        self.head = _FrequencyHead(self.config)
        self.xvector = _XVector(self.config)
        for m in self.modules():
            # He-normal TDNN weights as 3D-Speaker initialises them, so random test
            # checkpoints give activations of a realistic scale.
            if isinstance(m, nn.Conv1d):
                nn.init.kaiming_normal_(m.weight)
                if m.bias is not None:
                    nn.init.zeros_(m.bias)
        self.eval()

    @torch.inference_mode()
    def forward(self, feats: torch.Tensor) -> torch.Tensor:
        """Args: feats (B, T, feat_dim) mean-normalised fbank, T >= 3. Returns (B, embedding_size)."""
        if feats.dim() != 3 or feats.shape[-1] != self.config.feat_dim:
            raise ValueError(f"expected fbank of shape (B, T, {self.config.feat_dim}), got {tuple(feats.shape)}")
        if feats.shape[1] < 3:
            # the TDNN halves T and the std pooling needs two frames
            raise ValueError(f"need at least 3 fbank frames (50 ms), got {feats.shape[1]}")
        return self.xvector(self.head(feats.transpose(1, 2)))


@torch.inference_mode()
def speaker_embedding(model: SpeakerEncoder, audio_24k_left_padded: np.ndarray) -> torch.Tensor:
    """Embeds a prompt the way the reference does.

    Args:
        model: the speaker encoder.
        audio_24k_left_padded: the prompt at 24 kHz after left padding to whole
            patches, float32 shape (N,); padding is part of what the reference embeds.

    Returns:
        (1, embedding_size) tensor on the model's device, in its dtype.
    """
    audio_16k = resample(audio_24k_left_padded, SAMPLE_RATE, SPK_SAMPLE_RATE)
    param = next(model.parameters())
    feats = torch.from_numpy(kaldi_fbank(audio_16k)).to(device=param.device, dtype=param.dtype)
    return model(feats.unsqueeze(0))


def _mismatch_report(expected: dict[str, torch.Tensor], got: dict[str, torch.Tensor], limit: int = 20) -> str:
    missing = sorted(expected.keys() - got.keys())
    unexpected = sorted(got.keys() - expected.keys())
    misshaped = [
        f"{k}: file {tuple(got[k].shape)} vs model {tuple(expected[k].shape)}"
        for k in sorted(expected.keys() & got.keys())
        if got[k].shape != expected[k].shape
    ]
    lines = []
    for title, items in (("missing", missing), ("unexpected", unexpected), ("mis-shaped", misshaped)):
        if items:
            more = f" (+{len(items) - limit} more)" if len(items) > limit else ""
            lines.append(f"{title} ({len(items)}): " + ", ".join(items[:limit]) + more)
    return "; ".join(lines)


def load_campp(
    path: str | os.PathLike, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32
) -> SpeakerEncoder:
    """Loads a CAM++ plain state dict (e.g. `campplus_voxceleb.bin`), inferring its sizes.

    The file is read with `weights_only=True`: a pickle holding anything but tensors
    and plain containers is refused.

    Raises:
        FileNotFoundError: no such file.
        ValueError: the file is not a plain tensor state dict, or its names and
            shapes do not fit a CAM++ network (the message lists the offending names).
    """
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"CAM++ checkpoint not found: {path}")
    try:
        sd = torch.load(path, weights_only=True, map_location="cpu")
    except (pickle.UnpicklingError, RuntimeError, EOFError) as e:
        raise ValueError(f"{path} is not a loadable tensor state dict: {e}") from e
    if not isinstance(sd, dict) or not all(isinstance(k, str) and torch.is_tensor(v) for k, v in sd.items()):
        raise ValueError(f"{path} does not hold a plain state dict (a dict of name -> tensor)")
    model = SpeakerEncoder(CamppConfig.from_state_dict(sd))
    problems = _mismatch_report(model.state_dict(), sd)
    if problems:
        raise ValueError(f"{path} does not match CAM++ {model.config}: {problems}")
    model.load_state_dict(sd, strict=True)
    return model.to(device=device, dtype=dtype).eval()


def save_campp(model: SpeakerEncoder, path: str | os.PathLike) -> None:
    """Writes the model as a plain state dict of CPU tensors, the layout `load_campp` reads."""
    torch.save({k: v.detach().cpu() for k, v in model.state_dict().items()}, os.fspath(path))
