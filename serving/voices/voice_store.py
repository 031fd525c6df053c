"""Persistent, pickle-free store of encoded voice prompts: where they live and which are kept.

Layout under the store's root (format version 1)::

    v1/named/<name>.prompt.safetensors    encoded prompt: latents, speaker (+ JSON metadata)
    v1/named/<name>.source.safetensors    the reference it was encoded from, resampled to 24 kHz, and transcript
    v1/anon/<key>.prompt.safetensors      the prompt of an anonymous reference, keyed by content hash
    v1/.lock                              writers hold an exclusive flock

The files' format (safetensors, checksummed, written atomically: nothing is ever unpickled) is
:mod:`serving.voices.voice_files`. A named voice *is* its source file: it is registered when the source is
renamed into place (the prompt follows), removed when the source is unlinked (the prompt follows), and
listed and spoken only while the source is there; its prompt is a cache of the source's encoding,
used only if it names that source's sha256. So a writer killed at any point leaves the old voice, the
new one, or none, never a mixture, and nothing is cached in memory: every lookup reads the files.
A named prompt that is damaged, stale, unreadable, or made with another checkpoint, format version or
preprocessing is re-encoded from its source (and logged); an anonymous one from the request's audio
(the key hashes that audio, so no source is kept for it). What a killed writer left (a temporary file,
a prompt without its source) is swept by the next add or removal.
Anonymous entries are evicted least recently used first (file modification times) to stay within
``max_anonymous`` entries and, with named voices, ``max_bytes``; named voices are never evicted.
A read-only store still serves what it holds.
Past 300 lines on purpose: a voice's life in the store (locking, registration, eviction, removal) is one story
in one class; the file format is apart (voice_files).
"""

from __future__ import annotations

import fcntl
import logging
import os
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
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
from serving.voices.voice_files import (
    FORMAT_VERSION,
    PROMPT_SUFFIX,
    SOURCE_SUFFIX,
    TMP_SUFFIX,
    content_key,
    is_source,
    load_prompt,
    load_source,
    nbytes,
    prompt_file,
    source_digest,
    source_file,
    source_info,
    write_atomic,
)

log = logging.getLogger(__name__)
# Temporary files are written under the lock, in milliseconds: one this old is a killed writer's. (The
# age, not the lock alone, decides, so that a volume whose locks do not reach every replica loses
# nothing in flight to the sweep.)
STALE_TMP_SECONDS = 3600.0


class VoiceNotFound(KeyError):
    def __str__(self) -> str:
        return str(self.args[0])


class StoreNotWritable(RuntimeError):
    """A registration or removal that needs to write to a store that cannot be written."""


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
    """Named and anonymous voice prompts on disk, shared safely by several processes.

    Args:
        root: store directory (created if it can be).
        identity: checkpoint identity; prompts encoded with another checkpoint are re-encoded.
        encode: reference (audio, sample_rate, text) -> :class:`VoicePrompt`; resamples with
            :func:`engine.resample.resample` as the store does, so a 24 kHz source gives the same prompt.
        max_anonymous: LRU bound for anonymous entries.
        max_bytes: bound on all files (None: none); anonymous entries are evicted to stay under it, and
            registering a named voice that would put named voices alone over it is refused.
    """

    def __init__(
        self,
        root: str | Path | None,
        identity: str,
        encode: Callable[..., VoicePrompt] | None,
        max_anonymous: int = 256,
        max_bytes: int | None = None,
    ):
        self.root = Path(root or default_dir()) / f"v{FORMAT_VERSION}"
        self.identity = identity
        self._encode = encode
        self.max_anonymous = max_anonymous
        self.max_bytes = max_bytes
        self.encodes = 0  # prompts encoded by this process
        self.hits = 0  # prompts served from disk
        self._warned_read_only = False
        try:
            for sub in ("named", "anon"):
                (self.root / sub).mkdir(parents=True, exist_ok=True)
        except OSError as e:
            self._read_only(e)

    def _read_only(self, error: OSError) -> None:
        """Log, once, that the store cannot be written: it keeps serving what it holds."""
        if not self._warned_read_only:
            self._warned_read_only = True
            log.warning("voice store %s is not writable (%s): serving stored voices, storing nothing new",
                        self.root, error)  # fmt: skip

    @contextmanager
    def _locked(self) -> Iterator[None]:
        with open(self.root / ".lock", "a") as f:
            fcntl.flock(f, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(f, fcntl.LOCK_UN)

    @contextmanager
    def _writing(self, what: str) -> Iterator[None]:
        """Hold the lock for a write that must happen: an OSError becomes StoreNotWritable naming ``what``."""
        try:
            with self._locked():
                yield
        except OSError as e:
            raise StoreNotWritable(f"cannot {what}: voice store {self.root} is not writable ({e})") from None

    def _paths(self, kind: str, key: str) -> tuple[Path, Path]:
        base = self.root / kind / key
        return base.with_name(key + PROMPT_SUFFIX), base.with_name(key + SOURCE_SUFFIX)

    # -- recency and eviction ------------------------------------------------------------------------
    def _touch(self, path: Path) -> None:
        """Mark an entry most recently used (the LRU order); a read-only store serves without it."""
        try:
            os.utime(path)
        except FileNotFoundError:
            pass  # evicted by another process meanwhile
        except OSError as e:
            self._read_only(e)

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
            for p in (self.root / kind).glob(".*" + TMP_SUFFIX):
                try:
                    if now - p.stat().st_mtime > STALE_TMP_SECONDS:
                        p.unlink()
                except FileNotFoundError:
                    pass
        for p in (self.root / "named").glob("*" + PROMPT_SUFFIX):
            if not p.with_name(p.name.removesuffix(PROMPT_SUFFIX) + SOURCE_SUFFIX).exists():
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

    # -- public API --------------------------------------------------------------------------------
    def prompt_for_audio(self, audio: np.ndarray, sample_rate: int, text: str) -> tuple[VoicePrompt, bool]:
        """The prompt of an anonymous reference; (prompt, True) when it came from disk."""
        audio = np.ascontiguousarray(audio, np.float32).reshape(-1)
        key = content_key(audio, sample_rate, text, self.identity)
        p_path = self._paths("anon", key)[0]
        try:
            prompt = load_prompt(p_path, self.identity)
        except FileNotFoundError:
            pass
        except ValueError as e:
            log.warning("voice store: re-encoding anonymous entry %s from the request: %s", key, e)
        else:
            self.hits += 1
            self._touch(p_path)
            return prompt, True
        prompt = self._encode(audio, sample_rate, text)
        self.encodes += 1
        try:
            with self._locked():
                write_atomic(p_path, *prompt_file(prompt, self.identity))
                self._evict()
        except OSError as e:
            self._read_only(e)
        return prompt, False

    def register(self, name: str, audio: np.ndarray, sample_rate: int, text: str) -> VoicePrompt:
        """Encode and store a named voice (replacing one of the same name); its source is kept at 24 kHz."""
        check_name(name)
        audio = resample(check_reference(audio, sample_rate), sample_rate, SAMPLE_RATE)
        prompt = self._encode(audio, SAMPLE_RATE, text)
        self.encodes += 1
        source, s_meta = source_file(audio, SAMPLE_RATE, text)
        p_file = prompt_file(prompt, self.identity, s_meta["sha256"])
        p_path, s_path = self._paths("named", name)
        with self._writing(f"register voice {name!r}"):
            if self.max_bytes is not None:
                others = sum(b for key, (_, b) in self._entries("named").items() if key != name)
                need = others + nbytes(source) + nbytes(p_file[0])
                if need > self.max_bytes:
                    raise ValueError(
                        f"cannot register voice {name!r}: named voices would take {need / 1e9:.3f} GB, over the "
                        f"voice store's cap of {self.max_bytes / 1e9:g} GB (--voice-store-max-gb); remove voices "
                        "or raise the cap"
                    )
            write_atomic(s_path, source, s_meta)  # the voice is registered (or replaced) here
            write_atomic(p_path, *p_file)
            self._evict()
        return prompt

    def get(self, name: str) -> VoicePrompt:
        check_name(name)
        p_path, s_path = self._paths("named", name)
        try:
            digest = source_digest(s_path)
        except FileNotFoundError:
            raise VoiceNotFound(f"voice {name!r} is not registered") from None
        except ValueError as e:
            raise ValueError(f"voice {name!r} is damaged beyond repair ({e}); register it again") from None
        try:
            prompt = load_prompt(p_path, self.identity, digest)
        except FileNotFoundError:
            reason = "prompt file missing"
        except ValueError as e:
            reason = str(e)
        else:
            self.hits += 1
            self._touch(p_path)
            return prompt
        log.warning("voice store: re-encoding voice %r from its stored source: %s", name, reason)
        try:
            source = load_source(s_path)
        except FileNotFoundError:  # removed by another process meanwhile
            raise VoiceNotFound(f"voice {name!r} is not registered") from None
        except ValueError as e:
            raise ValueError(f"voice {name!r} is damaged beyond repair ({e}); register it again") from None
        prompt = self._encode(source.audio, source.sample_rate, source.text)
        self.encodes += 1
        try:
            with self._locked():
                if is_source(s_path, source.digest):  # not removed or replaced while encoding
                    write_atomic(p_path, *prompt_file(prompt, self.identity, source.digest))
        except OSError as e:
            self._read_only(e)
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
        for s_path in sorted((self.root / "named").glob("*" + SOURCE_SUFFIX)):
            name = s_path.name[: -len(SOURCE_SUFFIX)]
            if not VOICE_NAME.fullmatch(name):
                continue
            try:
                text, seconds = source_info(s_path)
                out.append(VoiceInfo(name, text, seconds, s_path.stat().st_mtime))
            except Exception as e:
                log.warning("voice store: skipping unreadable %s (%s)", s_path.name, e)
        return out
