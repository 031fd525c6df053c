"""The on-disk format of a stored voice: a prompt file and a source file, checksummed safetensors (nothing
unpickled), written atomically; a damaged file, or a prompt whose ``source`` is not its voice's source,
raises ValueError. The layout and metadata: docs/voices.md."""

from __future__ import annotations

import hashlib
import os
import time
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from engine.prompt import VoicePrompt

FORMAT_VERSION = "1"
# Everything between the reference clip and the prompt besides the checkpoint: part of every key.
PREPROCESSING = "resample=sinc-hann-w6-r0.99;pad=left-3840;fbank=kaldi-80-16k-meansub"

PROMPT_SUFFIX, SOURCE_SUFFIX = ".prompt.safetensors", ".source.safetensors"
TMP_SUFFIX = ".tmp"  # of write_atomic's temporary files, which no glob of the suffixes above matches


def content_key(audio: np.ndarray, sample_rate: int, text: str, identity: str) -> str:
    """The key of an anonymous reference: a hash of the format, preprocessing, checkpoint, rate, transcript
    and samples (32 hex digits)."""
    h = hashlib.sha256()
    for part in (FORMAT_VERSION, PREPROCESSING, identity, str(int(sample_rate)), text):
        h.update(part.encode("utf-8") + b"\0")
    h.update(np.ascontiguousarray(audio, dtype="<f4").tobytes())
    return h.hexdigest()[:32]


def checksum(tensors: dict[str, torch.Tensor], text: str) -> str:
    """sha256 of a file's tensors (in name order) and transcript: what a damaged file no longer matches."""
    h = hashlib.sha256()
    for name in sorted(tensors):
        h.update(name.encode() + b"\0" + tensors[name].contiguous().numpy().tobytes())
    h.update(text.encode("utf-8"))
    return h.hexdigest()


def write_atomic(path: Path, tensors: dict[str, torch.Tensor], meta: dict[str, str]) -> None:
    """Write a safetensors file so that a reader sees the whole old file or the whole new one (fsync, rename)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{time.monotonic_ns()}{TMP_SUFFIX}")
    try:
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp), metadata=meta)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


@contextmanager
def opened(path: Path):
    """A safetensors file open for reading; FileNotFoundError if absent, any other problem raises ValueError."""
    try:
        with safe_open(str(path), framework="pt") as f:
            yield f
    except FileNotFoundError:
        raise
    except Exception as e:  # safetensors raises several types for damaged files
        raise ValueError(f"{path.name}: unreadable ({type(e).__name__}: {e})") from None


def read_checked(path: Path, unchecked_ok: bool = False) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Tensors and header of a safetensors file whose checksum matches (or, with ``unchecked_ok``, that
    has none: written before checksums); FileNotFoundError if absent, any other problem raises ValueError."""
    with opened(path) as f:
        tensors, meta = {k: f.get_tensor(k) for k in f.keys()}, dict(f.metadata() or {})
        actual = checksum(tensors, meta.get("text", ""))
    digest = meta.get("sha256")
    if (digest or not unchecked_ok) and digest != actual:
        raise ValueError(f"{path.name}: checksum mismatch (damaged, or written before checksums)")
    return tensors, meta


def _file(tensors: dict[str, torch.Tensor], text: str, **meta: str) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """A file's tensors and header: the format version, the transcript, the checksum and ``meta``."""
    return tensors, {"format_version": FORMAT_VERSION, "text": text, "sha256": checksum(tensors, text), **meta}


def prompt_file(prompt: VoicePrompt, identity: str, source: str = "") -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """``prompt``'s file, encoded with the checkpoint ``identity`` from the source whose sha256 is ``source``
    (a named voice's; "" for an anonymous prompt, which has none)."""
    tensors = {"latents": prompt.latents.float(), "speaker": prompt.speaker.float()}
    return _file(tensors, prompt.text, checkpoint=identity, preprocessing=PREPROCESSING, created=repr(time.time()),
                 source=source)  # fmt: skip


def load_prompt(p_path: Path, identity: str, source: str | None = None) -> VoicePrompt:
    """A prompt file's :class:`VoicePrompt`; ValueError if it is damaged, of another format version,
    encoded with another checkpoint or preprocessing than ``identity`` and :data:`PREPROCESSING`, or
    (``source`` given: a named voice's) from another source than the one whose sha256 is ``source``."""
    tensors, meta = read_checked(p_path)
    if meta.get("format_version") != FORMAT_VERSION:
        raise ValueError(f"{p_path.name}: format version {meta.get('format_version')!r} is not {FORMAT_VERSION}")
    if meta.get("checkpoint") != identity or meta.get("preprocessing") != PREPROCESSING:
        raise ValueError(f"{p_path.name}: encoded with another checkpoint or preprocessing")
    if source is not None and "source" not in meta:
        raise ValueError(f"{p_path.name}: names no source (written before prompts did)")
    if source is not None and meta["source"] != source:
        raise ValueError(f"{p_path.name}: encoded from another source than the stored one (a replacement cut short)")
    try:
        return VoicePrompt(tensors["latents"].float(), tensors["speaker"].float(), meta["text"])
    except (KeyError, ValueError) as e:
        raise ValueError(f"{p_path.name}: malformed entry ({e})") from None


def source_file(audio: np.ndarray, sample_rate: int, text: str) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """A source file: float32 samples (N,) at ``sample_rate`` Hz and their transcript."""
    return _file({"audio": torch.from_numpy(audio)}, text, sample_rate=str(sample_rate))


@dataclass(frozen=True)
class Source:
    audio: np.ndarray  # (N,) float32 samples
    sample_rate: int  # Hz
    text: str  # the transcript
    digest: str  # its sha256 ("" for a source written before checksums): what its prompt names


def load_source(s_path: Path) -> Source:
    """A source file; ValueError if damaged. A source from before checksums is accepted: it is still the
    best there is."""
    tensors, meta = read_checked(s_path, unchecked_ok=True)
    try:
        audio = tensors["audio"].numpy().astype(np.float32)
        return Source(audio, int(meta["sample_rate"]), meta["text"], meta.get("sha256", ""))
    except (KeyError, ValueError) as e:
        raise ValueError(f"{s_path.name}: malformed source ({e})") from None


def source_digest(s_path: Path) -> str:
    """The sha256 in a source file's header ("" if it has none), without reading its samples;
    FileNotFoundError if absent, ValueError if its header cannot be read."""
    with opened(s_path) as f:
        return dict(f.metadata() or {}).get("sha256", "")


def is_source(s_path: Path, digest: str) -> bool:
    """Whether the source file at ``s_path`` is there and is the one whose sha256 is ``digest``."""
    with suppress(FileNotFoundError, ValueError):
        return source_digest(s_path) == digest
    return False


def source_info(s_path: Path) -> tuple[str, float]:
    """(transcript, seconds) of a source file, from its header and the audio's shape (no samples read)."""
    with opened(s_path) as f:
        meta, n = dict(f.metadata() or {}), f.get_slice("audio").get_shape()[0]
    return meta.get("text", ""), n / int(meta["sample_rate"])
