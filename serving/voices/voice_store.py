"""Persistent, pickle-free store of encoded voice prompts, shared safely by several processes: locking,
registration, eviction, removal. Its layout, why a writer killed at any point leaves a whole voice, and
what is re-encoded, swept and evicted: docs/voices.md. The files' format: :mod:`serving.voices.voice_files`."""

from __future__ import annotations

import fcntl
import logging
import os
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from engine.audio import check_reference
from engine.config import cache_dir
from engine.prompt import VoicePrompt
from engine.protocol import SAMPLE_RATE
from engine.resample import resample
from serving.contract import VOICE_NAME
from serving.intake.requests import check_name
from serving.voices import voice_files as vf

log = logging.getLogger(__name__)
STALE_TMP_SECONDS = 3600.0  # temporary files are written in milliseconds: one this old is a killed writer's


class VoiceNotFound(KeyError):
    def __str__(self) -> str:
        return str(self.args[0])


def default_dir() -> Path:
    """Voices live in the user's cache unless the server is given --voice-dir."""
    return cache_dir() / "voices"


@dataclass(frozen=True)
class VoiceInfo:
    name: str
    text: str
    seconds: float
    created: float


class VoiceStore:
    """Named and anonymous voice prompts in ``root`` (created if it can be), encoded with the checkpoint
    ``identity`` by ``encode`` (audio, sample_rate, text) -> :class:`VoicePrompt`, which resamples with
    :func:`engine.resample.resample` as the store does (a 24 kHz source gives the same prompt). At most
    ``max_anonymous`` anonymous entries and ``max_bytes`` in all files (None: no bound); registering a named
    voice that would put named voices alone over ``max_bytes`` is refused."""

    def __init__(self, root: str | Path | None, identity: str, encode: Callable[..., VoicePrompt] | None,
                 max_anonymous: int = 256, max_bytes: int | None = None):  # fmt: skip
        self.root = Path(root or default_dir()) / f"v{vf.FORMAT_VERSION}"
        self.identity, self._encode, self.max_anonymous, self.max_bytes = identity, encode, max_anonymous, max_bytes
        self.encodes = 0  # prompts encoded by this process
        self.hits = 0  # prompts served from disk
        self._warned_read_only = False
        with self._unless_read_only():
            for sub in ("named", "anon"):
                (self.root / sub).mkdir(parents=True, exist_ok=True)

    @contextmanager
    def _unless_read_only(self) -> Iterator[None]:
        """A write the store can do without: an OSError is logged, once (the store cannot be written), and it
        keeps serving what it holds."""
        try:
            yield
        except OSError as e:
            if not self._warned_read_only:
                self._warned_read_only = True
                log.warning("voice store %s is not writable (%s): serving stored voices, storing nothing new",
                            self.root, e)  # fmt: skip

    @contextmanager
    def _locked(self) -> Iterator[None]:
        with open(self.root / ".lock", "a") as f:
            fcntl.flock(f, fcntl.LOCK_EX)  # released when the file closes
            yield

    @contextmanager
    def _writing(self, what: str) -> Iterator[None]:
        """Hold the lock for a write that must happen: an OSError becomes a RuntimeError naming ``what``."""
        try:
            with self._locked():
                yield
        except OSError as e:
            raise RuntimeError(f"cannot {what}: voice store {self.root} is not writable ({e})") from None

    def _paths(self, kind: str, key: str) -> tuple[Path, Path]:
        return self.root / kind / (key + vf.PROMPT_SUFFIX), self.root / kind / (key + vf.SOURCE_SUFFIX)

    # -- recency and eviction ------------------------------------------------------------------------
    def _entries(self, kind: str) -> dict[str, list]:
        """key -> [modification time of its prompt (0 if none), bytes of its files]."""
        out: dict[str, list] = {}
        for p in (self.root / kind).glob("*.safetensors"):
            key, _, part = p.name.removesuffix(".safetensors").rpartition(".")
            try:
                st = p.stat()
            except FileNotFoundError:  # removed by another process meanwhile
                continue
            entry = out.setdefault(key, [0.0, 0])
            entry[1] += st.st_size
            if part == "prompt":
                entry[0] = st.st_mtime
        return out

    def _sweep(self) -> None:
        """Remove what killed writers left: stale temporary files, named prompts without a source (lock held)."""
        now = time.time()
        for kind in ("named", "anon"):
            for p in (self.root / kind).glob(".*" + vf.TMP_SUFFIX):
                with suppress(FileNotFoundError):  # removed by another process meanwhile
                    if now - p.stat().st_mtime > STALE_TMP_SECONDS:
                        p.unlink()
        for p in (self.root / "named").glob("*" + vf.PROMPT_SUFFIX):
            if not p.with_name(p.name.removesuffix(vf.PROMPT_SUFFIX) + vf.SOURCE_SUFFIX).exists():
                p.unlink(missing_ok=True)

    def _evict(self) -> None:
        """Sweep, then drop the least recently used anonymous entries beyond max_anonymous or max_bytes
        (lock held)."""
        self._sweep()
        anon = sorted(self._entries("anon").items(), key=lambda kv: kv[1][0])
        total = sum(b for _, b in self._entries("named").values()) + sum(e[1] for _, e in anon)
        excess = len(anon) - self.max_anonymous
        for key, (_, size) in anon:
            if excess <= 0 and (self.max_bytes is None or total <= self.max_bytes):
                break
            for q in self._paths("anon", key):
                q.unlink(missing_ok=True)
            excess, total = excess - 1, total - size

    def _stored(self, p_path: Path, source: str | None = None) -> tuple[VoicePrompt | None, str]:
        """The stored prompt (a hit: counted, touched) -> (prompt, ""), else (None, why: "" if there is none)."""
        try:
            prompt = vf.load_prompt(p_path, self.identity, source)
        except FileNotFoundError:
            return None, ""
        except ValueError as e:
            return None, str(e)
        self.hits += 1
        with self._unless_read_only(), suppress(FileNotFoundError):  # (evicted by another process meanwhile)
            os.utime(p_path)  # most recently used now (the LRU order); a read-only store serves without it
        return prompt, ""

    # -- public API --------------------------------------------------------------------------------
    def prompt_for_audio(self, audio: np.ndarray, sample_rate: int, text: str) -> tuple[VoicePrompt, bool]:
        """The prompt of an anonymous reference; (prompt, True) when it came from disk."""
        audio = np.ascontiguousarray(audio, np.float32).reshape(-1)
        key = vf.content_key(audio, sample_rate, text, self.identity)
        p_path = self._paths("anon", key)[0]
        prompt, reason = self._stored(p_path)
        if prompt is not None:
            return prompt, True
        if reason:
            log.warning("voice store: re-encoding anonymous entry %s from the request: %s", key, reason)
        prompt = self._encode(audio, sample_rate, text)
        self.encodes += 1
        with self._unless_read_only(), self._locked():
            vf.write_atomic(p_path, *vf.prompt_file(prompt, self.identity))
            self._evict()
        return prompt, False

    def register(self, name: str, audio: np.ndarray, sample_rate: int, text: str) -> VoicePrompt:
        """Encode and store a named voice (replacing one of the same name); its source is kept at 24 kHz."""
        check_name(name)
        audio = resample(check_reference(audio, sample_rate), sample_rate, SAMPLE_RATE)
        prompt = self._encode(audio, SAMPLE_RATE, text)
        self.encodes += 1
        source, s_meta = vf.source_file(audio, SAMPLE_RATE, text)
        p_file = vf.prompt_file(prompt, self.identity, s_meta["sha256"])
        p_path, s_path = self._paths("named", name)
        with self._writing(f"register voice {name!r}"):
            if self.max_bytes is not None:
                others = sum(b for key, (_, b) in self._entries("named").items() if key != name)
                need = others + sum(t.nbytes for t in [*source.values(), *p_file[0].values()])  # + small headers
                if need > self.max_bytes:
                    raise ValueError(f"cannot register voice {name!r}: named voices would take {need / 1e9:.3f} GB, "
                                     f"over the voice store's cap of {self.max_bytes / 1e9:g} GB "
                                     "(--voice-store-max-gb); remove voices or raise the cap")  # fmt: skip
            vf.write_atomic(s_path, source, s_meta)  # the voice is registered (or replaced) here
            vf.write_atomic(p_path, *p_file)
            self._evict()
        return prompt

    def get(self, name: str) -> VoicePrompt:
        check_name(name)
        p_path, s_path = self._paths("named", name)
        prompt, reason = self._stored(p_path, _of_source(name, vf.source_digest, s_path))
        if prompt is not None:
            return prompt
        log.warning(
            "voice store: re-encoding voice %r from its stored source: %s", name, reason or "prompt file missing"
        )
        source = _of_source(name, vf.load_source, s_path)  # (it may have been removed meanwhile)
        prompt = self._encode(source.audio, source.sample_rate, source.text)
        self.encodes += 1
        with self._unless_read_only(), self._locked():
            if vf.is_source(s_path, source.digest):  # not removed or replaced while encoding
                vf.write_atomic(p_path, *vf.prompt_file(prompt, self.identity, source.digest))
        return prompt

    def remove(self, name: str) -> bool:
        check_name(name)
        s_path = self._paths("named", name)[1]
        with self._writing(f"remove voice {name!r}"):
            try:
                s_path.unlink()  # the voice is removed here
            except FileNotFoundError:
                return False
            finally:
                self._sweep()  # its prompt, and what killed writers left
        return True

    def list(self) -> list[VoiceInfo]:
        out = []
        for s_path in sorted((self.root / "named").glob("*" + vf.SOURCE_SUFFIX)):
            name = s_path.name[: -len(vf.SOURCE_SUFFIX)]
            if not VOICE_NAME.fullmatch(name):
                continue
            try:
                text, seconds = vf.source_info(s_path)
                out.append(VoiceInfo(name, text, seconds, s_path.stat().st_mtime))
            except Exception as e:
                log.warning("voice store: skipping unreadable %s (%s)", s_path.name, e)
        return out


def _of_source(name: str, read: Callable, s_path: Path):
    """``read(s_path)``, of a named voice's source: VoiceNotFound if it is not there, ValueError if damaged."""
    try:
        return read(s_path)
    except FileNotFoundError:
        raise VoiceNotFound(f"voice {name!r} is not registered") from None
    except ValueError as e:
        raise ValueError(f"voice {name!r} is damaged beyond repair ({e}); register it again") from None
