"""Persistent, pickle-free store of encoded voice prompts.

Layout under the store's root (format version 1)::

    v1/named/<name>.prompt.safetensors    encoded prompt: latents, speaker (+ JSON metadata)
    v1/named/<name>.source.safetensors    the reference audio and transcript it was encoded from
    v1/anon/<key>.prompt.safetensors      the same for anonymous references, keyed by content hash
    v1/anon/<key>.source.safetensors
    v1/.lock                              writers hold an exclusive flock

Only safetensors (tensors + a str->str header) and JSON are ever read: nothing is unpickled. Writes go
to a unique temporary file and are renamed into place, so readers see a whole old or a whole new file.
A prompt whose checkpoint identity, format version or preprocessing differs, or which cannot be read,
is re-encoded from its source file (and logged). Anonymous entries are bounded by an LRU on file
modification times.
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import re
import time
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from engine.config import cache_dir
from engine.prompt import VoicePrompt

log = logging.getLogger(__name__)

FORMAT_VERSION = "1"
# Everything between the reference clip and the prompt besides the checkpoint: part of every key.
PREPROCESSING = "resample=sinc-hann-w6-r0.99;pad=left-3840;fbank=kaldi-80-16k-meansub"
NAME_RE = re.compile(r"[A-Za-z0-9_-]{1,64}")
MAX_SOURCE_SECONDS = 60


class VoiceNotFound(KeyError):
    def __str__(self) -> str:
        return str(self.args[0])


def default_dir() -> Path:
    """Voices live in the user's cache unless the server is given --voice-dir."""
    return cache_dir() / "voices"


def check_name(name: str) -> str:
    if not isinstance(name, str) or not NAME_RE.fullmatch(name):
        raise ValueError(f"voice name must match [A-Za-z0-9_-]{{1,64}}, got {name!r}")
    return name


def content_key(audio: np.ndarray, sample_rate: int, text: str, identity: str) -> str:
    h = hashlib.sha256()
    for part in (FORMAT_VERSION, PREPROCESSING, identity, str(int(sample_rate)), text):
        h.update(part.encode("utf-8") + b"\0")
    h.update(np.ascontiguousarray(audio, dtype="<f4").tobytes())
    return h.hexdigest()[:32]


@dataclass(frozen=True)
class VoiceInfo:
    name: str
    text: str
    seconds: float
    created: float


def _write_atomic(path: Path, tensors: dict[str, torch.Tensor], meta: dict[str, str]) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{time.monotonic_ns()}.tmp")
    try:
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp), metadata=meta)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()


def _read(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Tensors and header of a safetensors file; any problem raises ValueError."""
    try:
        with safe_open(str(path), framework="pt") as f:
            return {k: f.get_tensor(k) for k in f.keys()}, dict(f.metadata() or {})
    except FileNotFoundError:
        raise
    except Exception as e:  # safetensors raises several types for damaged files
        raise ValueError(f"{path.name}: unreadable ({type(e).__name__}: {e})") from None


class VoiceStore:
    """Named and anonymous voice prompts on disk, shared safely by several processes.

    Args:
        root: store directory (created).
        identity: checkpoint identity; prompts encoded with another checkpoint are re-encoded.
        encode: reference (audio, sample_rate, text) -> :class:`VoicePrompt`.
        max_anonymous: LRU bound for anonymous entries.
    """

    def __init__(
        self,
        root: str | Path | None,
        identity: str,
        encode: Callable[..., VoicePrompt] | None,
        max_anonymous: int = 256,
    ):
        self.root = Path(root or default_dir()) / f"v{FORMAT_VERSION}"
        self.identity = identity
        self._encode = encode
        self.max_anonymous = max_anonymous
        self.encodes = 0  # prompts encoded by this process
        self.hits = 0  # prompts served from disk
        for sub in ("named", "anon"):
            (self.root / sub).mkdir(parents=True, exist_ok=True)

    @contextmanager
    def _locked(self):
        with open(self.root / ".lock", "a") as f:
            fcntl.flock(f, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(f, fcntl.LOCK_UN)

    def _paths(self, kind: str, key: str) -> tuple[Path, Path]:
        base = self.root / kind / key
        return base.with_name(key + ".prompt.safetensors"), base.with_name(key + ".source.safetensors")

    # -- encode and (re)write --------------------------------------------------------------------
    def _encode_and_write(self, kind: str, key: str, audio: np.ndarray, sr: int, text: str, write_source: bool):
        prompt = self._encode(audio, sr, text)
        self.encodes += 1
        p_path, s_path = self._paths(kind, key)
        meta = {"format_version": FORMAT_VERSION, "checkpoint": self.identity, "preprocessing": PREPROCESSING,
                "text": text, "created": repr(time.time())}  # fmt: skip
        with self._locked():
            if write_source:
                _write_atomic(s_path, {"audio": torch.from_numpy(np.ascontiguousarray(audio, np.float32))},
                              {"format_version": FORMAT_VERSION, "sample_rate": str(int(sr)), "text": text})  # fmt: skip
            _write_atomic(p_path, {"latents": prompt.latents.float(), "speaker": prompt.speaker.float()}, meta)
        return prompt

    def _load_prompt(self, p_path: Path) -> VoicePrompt:
        tensors, meta = _read(p_path)
        if meta.get("format_version") != FORMAT_VERSION:
            raise ValueError(f"{p_path.name}: format version {meta.get('format_version')!r} is not {FORMAT_VERSION}")
        if meta.get("checkpoint") != self.identity or meta.get("preprocessing") != PREPROCESSING:
            raise ValueError(f"{p_path.name}: encoded with another checkpoint or preprocessing")
        try:
            return VoicePrompt(tensors["latents"].float(), tensors["speaker"].float(), meta["text"])
        except (KeyError, ValueError) as e:
            raise ValueError(f"{p_path.name}: malformed entry ({e})") from None

    def _load_source(self, s_path: Path) -> tuple[np.ndarray, int, str]:
        tensors, meta = _read(s_path)
        try:
            audio = tensors["audio"].numpy().astype(np.float32)
            return audio, int(meta["sample_rate"]), meta["text"]
        except (KeyError, ValueError) as e:
            raise ValueError(f"{s_path.name}: malformed source ({e})") from None

    def _get_or_reencode(self, kind: str, key: str, what: str) -> VoicePrompt:
        p_path, s_path = self._paths(kind, key)
        try:
            prompt = self._load_prompt(p_path)
            self.hits += 1
            os.utime(p_path)  # LRU: most recently used
            return prompt
        except FileNotFoundError:
            if not s_path.exists():
                raise
            reason = "prompt file missing"
        except ValueError as e:
            reason = str(e)
        log.warning("voice store: re-encoding %s from its stored source: %s", what, reason)
        audio, sr, text = self._load_source(s_path)
        return self._encode_and_write(kind, key, audio, sr, text, write_source=False)

    # -- public API --------------------------------------------------------------------------------
    def prompt_for_audio(self, audio: np.ndarray, sample_rate: int, text: str) -> tuple[VoicePrompt, bool]:
        """The prompt of an anonymous reference; (prompt, True) when it came from disk."""
        audio = np.ascontiguousarray(audio, np.float32).reshape(-1)
        key = content_key(audio, sample_rate, text, self.identity)
        try:
            before = self.encodes
            prompt = self._get_or_reencode("anon", key, f"anonymous entry {key}")
            return prompt, self.encodes == before
        except FileNotFoundError:
            pass
        prompt = self._encode_and_write("anon", key, audio, sample_rate, text, write_source=True)
        self._evict()
        return prompt, False

    def register(self, name: str, audio: np.ndarray, sample_rate: int, text: str) -> VoicePrompt:
        """Encode and store a named voice (replacing one of the same name)."""
        check_name(name)
        audio = np.ascontiguousarray(audio, np.float32).reshape(-1)
        if audio.size == 0 or audio.size > MAX_SOURCE_SECONDS * sample_rate:
            raise ValueError(
                f"voice audio must be 0..{MAX_SOURCE_SECONDS} s, got {audio.size / max(sample_rate, 1):.1f} s"
            )
        return self._encode_and_write("named", name, audio, sample_rate, text, write_source=True)

    def get(self, name: str) -> VoicePrompt:
        check_name(name)
        try:
            return self._get_or_reencode("named", name, f"voice {name!r}")
        except FileNotFoundError:
            raise VoiceNotFound(f"voice {name!r} is not registered") from None
        except ValueError as e:
            raise ValueError(f"voice {name!r} is damaged beyond repair ({e}); register it again") from None

    def remove(self, name: str) -> bool:
        check_name(name)
        removed = False
        with self._locked():
            for p in self._paths("named", name):
                if p.exists():
                    p.unlink()
                    removed = True
        return removed

    def list(self) -> list[VoiceInfo]:
        out = []
        for s_path in sorted((self.root / "named").glob("*.source.safetensors")):
            name = s_path.name[: -len(".source.safetensors")]
            if not NAME_RE.fullmatch(name):
                continue
            try:
                with safe_open(str(s_path), framework="pt") as f:
                    meta = dict(f.metadata() or {})
                    n = f.get_slice("audio").get_shape()[0]
                sr = int(meta["sample_rate"])
                out.append(VoiceInfo(name, meta.get("text", ""), n / sr, s_path.stat().st_mtime))
            except Exception as e:
                log.warning("voice store: skipping unreadable %s (%s)", s_path.name, e)
        return out

    def _evict(self) -> None:
        def mtime(p: Path) -> float:
            try:
                return p.stat().st_mtime
            except FileNotFoundError:  # removed by another process meanwhile
                return float("inf")

        with self._locked():
            entries = sorted((self.root / "anon").glob("*.prompt.safetensors"), key=mtime)
            for p in entries[: max(0, len(entries) - self.max_anonymous)]:
                key = p.name[: -len(".prompt.safetensors")]
                for q in self._paths("anon", key):
                    q.unlink(missing_ok=True)
