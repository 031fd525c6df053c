"""Two launchers on one ``--voice-dir``, as two replicas of the Deployment on one ReadWriteMany volume.

A voice added on one is spoken identically by the other; adds from both sides at once are all kept; a
removal on one is seen by the other at once (the store caches nothing: every lookup and listing reads
the files); and a kill -9 of the adding replica in the middle of a write leaves no torn or half-visible
voice, for the other replica and for the killed one restarted. The guarantees are written down in
deploy/k8s/README.md. The last test kills replica A.
"""

from __future__ import annotations

import os
import shutil
import signal
import threading
import time

import numpy as np
import pytest

from client import TTSError
from client.voices import VoiceClient
from engine.protocol import MAX_REFERENCE_SECONDS, SAMPLE_RATE
from serving.voices.voice_files import PROMPT_SUFFIX, SOURCE_SUFFIX
from tests.integration.helpers import in_parallel
from tests.integration.launcher import Launcher

pytestmark = pytest.mark.integration

ADMIN_KEY = f"replicas-{os.urandom(12).hex()}"
# compared bit for bit: chunk sizes move float32 rounding, so fixed ones
SPEAK = {"seed": 5, "parameters": {"max_patches": 6, "chunk_fixed": True}}
READY_SECONDS = 300.0  # two launchers start side by side on a small machine


def ref_clip(seed: int, n: int = 24000) -> np.ndarray:
    return (0.1 * np.random.default_rng(seed).standard_normal(n)).astype(np.float32)


def start(ckpt, shared) -> Launcher:
    return Launcher.start(ckpt, shared, "--slots", "2", "--admin-key-file", str(shared / "key"))


@pytest.fixture(scope="module")
def shared(tmp_path_factory):
    """What both replicas mount: the admin key and the voice folder (``voices/`` under it)."""
    tmp = tmp_path_factory.mktemp("replicas")
    (tmp / "key").write_text(ADMIN_KEY + "\n")
    return tmp


@pytest.fixture(scope="module")
def replicas(tiny_ckpt, shared):
    with start(tiny_ckpt, shared) as a, start(tiny_ckpt, shared) as b:
        a.wait_ready(READY_SECONDS)
        b.wait_ready(READY_SECONDS)
        yield a, b


def named_dir(shared):
    return shared / "voices" / "v1" / "named"


def voices(ln: Launcher) -> VoiceClient:
    return VoiceClient(f"127.0.0.1:{ln.ports.grpc}", admin_key=ADMIN_KEY)


def listed(ln: Launcher) -> dict[str, dict]:
    return {v["name"]: v for v in voices(ln).list()}


def speak(ln: Launcher, name: str) -> np.ndarray:
    return ln.client().synthesize("Two replicas", voice_id=name, **SPEAK)


def speak_reference(ln: Launcher, audio: np.ndarray, text: str) -> np.ndarray:
    """What ``ln`` says with ``audio`` as an anonymous reference: encoded there, from the request."""
    return ln.client().synthesize("Two replicas", ref_audio=audio, ref_sample_rate=SAMPLE_RATE, ref_text=text, **SPEAK)


def not_a_voice(ln: Launcher, name: str) -> None:
    assert name not in listed(ln)
    with pytest.raises(TTSError, match="is not registered"):
        speak(ln, name)


def test_a_voice_added_on_one_is_spoken_identically_by_the_other(replicas):
    a, b = replicas
    clip = ref_clip(1)
    voices(a).add("shared-1", clip, SAMPLE_RATE, "added on a")
    assert listed(b)["shared-1"]["text"] == "added on a"
    on_a, on_b = speak(a, "shared-1"), speak(b, "shared-1")
    assert on_a.size > 0 and np.array_equal(on_a, on_b)
    assert np.array_equal(on_b, speak_reference(b, clip, "added on a"))  # b's own encoding of the clip


def test_concurrent_adds_from_both_sides_are_all_kept(replicas, shared):
    a, b = replicas
    names = [f"crowd-{i}" for i in range(8)]
    in_parallel(lambda i: voices((a, b)[i % 2]).add(names[i], ref_clip(100 + i), SAMPLE_RATE, f"crowd {i}"), 8)
    for ln in (a, b):
        seen = listed(ln)
        assert {n: seen[n]["text"] for n in names} == {n: f"crowd {i}" for i, n in enumerate(names)}
    before = [ln.metrics() for ln in (a, b)]
    for i, name in enumerate(names):  # each spoken by the replica that did not add it, from its file
        assert speak((b, a)[i % 2], name).size > 0
    for ln, m0 in zip((a, b), before):
        m1 = ln.metrics()
        assert m1["tts_prompt_encodes_total"] == m0["tts_prompt_encodes_total"]  # no entry needed repair
        assert m1["tts_prompt_cache_hits_total"] - m0["tts_prompt_cache_hits_total"] == 4
    assert not list(named_dir(shared).glob(".*.tmp"))


def test_a_removal_on_one_is_seen_by_the_other_at_once(replicas):
    a, b = replicas
    voices(a).add("leaving", ref_clip(2), SAMPLE_RATE, "leaving")
    assert speak(b, "leaving").size > 0
    assert voices(b).remove("leaving")["removed"]
    not_a_voice(a, "leaving")  # the very next request: nothing is cached
    with pytest.raises(TTSError, match="is not registered"):
        voices(a).remove("leaving")


def test_what_a_kill_leaves_mid_write_is_never_a_torn_voice(replicas, shared):
    """The states a kill -9 can leave in a register or remove, made by hand (a real kill lands in one of
    them by chance: the next test): the other replica lists and speaks only whole voices."""
    a, b = replicas
    named = named_dir(shared)
    whole_clip, old_clip = ref_clip(3), ref_clip(4, 36000)
    voices(a).add("whole", whole_clip, SAMPLE_RATE, "whole")
    voices(a).add("turned", old_clip, SAMPLE_RATE, "before")
    whole = speak(b, "whole")
    source, prompt = (named / f"whole{suffix}" for suffix in (SOURCE_SUFFIX, PROMPT_SUFFIX))
    # killed inside write_atomic: a temporary file, cut short, never renamed
    for name in ("ghost" + SOURCE_SUFFIX, "ghost" + PROMPT_SUFFIX, "whole" + PROMPT_SUFFIX):
        (named / f".{name}.4242.{time.monotonic_ns()}.tmp").write_bytes(source.read_bytes()[:1000])
    # a new voice killed between its source's rename and its prompt's: the source is the voice
    shutil.copyfile(source, named / f"halfway{SOURCE_SUFFIX}")
    # a replacement killed there: the new source, the old voice's prompt
    shutil.copyfile(source, named / f"turned{SOURCE_SUFFIX}")
    # a removal killed after the source went: a prompt alone is not a voice
    shutil.copyfile(prompt, named / f"orphan{PROMPT_SUFFIX}")
    for ln in (a, b):
        seen = listed(ln)
        assert {n: (v["text"], v["seconds"]) for n, v in seen.items() if n in ("whole", "halfway", "turned")} == {
            n: ("whole", 1.0) for n in ("whole", "halfway", "turned")
        }
        not_a_voice(ln, "ghost")
        not_a_voice(ln, "orphan")
        for name in ("whole", "halfway", "turned"):
            assert np.array_equal(speak(ln, name), whole), name


def test_kill_9_of_the_adding_replica_mid_add_leaves_a_consistent_store(replicas, shared, tiny_ckpt):
    """SIGKILL replica A (its prompt_encoder, which writes, first) as soon as a temporary file of a long
    voice appears in the store, or when the add ends if none was seen; B and A restarted then agree on
    a store of whole voices, and the long voice is either whole on both or on neither."""
    a, b = replicas
    named = named_dir(shared)
    clip = ref_clip(5, int(MAX_REFERENCE_SECONDS * SAMPLE_RATE))  # the longest: the slowest write
    writer = a.stubs()["prompt_encoder"]
    add = threading.Thread(target=lambda: _add_ignoring_the_kill(a, clip), daemon=True)
    add.start()
    seen_tmp = ""
    while add.is_alive() and not seen_tmp:
        seen_tmp = next((e.name for e in os.scandir(named) if e.name.startswith(".long.")), "")
    os.kill(writer, signal.SIGKILL)
    a.kill()
    add.join(30)
    left = sorted(p.name for p in named.glob(".long.*"))
    print(f"temporary file seen before the kill: {seen_tmp or 'none'}; left after it: {left or 'none'}")
    whole = {n for n in listed(b) if n != "long"}
    assert {"shared-1", "whole", "halfway", "turned"} <= whole
    with start(tiny_ckpt, shared) as again:
        again.wait_ready(READY_SECONDS)
        assert set(listed(again)) - {"long"} == whole and set(listed(b)) - {"long"} == whole
        for name in sorted(whole):
            assert np.array_equal(speak(again, name), speak(b, name)), name
        if "long" in listed(b):
            assert listed(again)["long"]["seconds"] == MAX_REFERENCE_SECONDS
            expected = speak_reference(b, clip, "long")
            assert np.array_equal(speak(b, "long"), expected) and np.array_equal(speak(again, "long"), expected)
        else:
            not_a_voice(b, "long")
            not_a_voice(again, "long")


def _add_ignoring_the_kill(a: Launcher, clip: np.ndarray) -> None:
    try:
        voices(a).add("long", clip, SAMPLE_RATE, "long")
    except (TTSError, ConnectionError):
        pass  # the server died under it: what the store holds is the question
