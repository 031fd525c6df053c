"""The voice store: reuse, restart survival, re-encoding, concurrency, names, no pickles."""

from __future__ import annotations

import logging
import multiprocessing as mp
import pickle

import numpy as np
import pytest

from serving.voice_store import VoiceNotFound, VoiceStore, check_name


class Counting:
    def __init__(self, tts):
        self.tts, self.calls = tts, 0

    def __call__(self, audio, sr, text):
        self.calls += 1
        return self.tts.encode_prompt(audio, sr, text)


def clip(seed=0, n=20000):
    return (0.1 * np.random.default_rng(seed).standard_normal(n)).astype(np.float32)


def test_anonymous_reuse_survives_a_new_store(tts, tmp_path):
    enc = Counting(tts)
    a = VoiceStore(tmp_path, tts.identity, enc)
    p1, hit1 = a.prompt_for_audio(clip(), 16000, "hi")
    p2, hit2 = a.prompt_for_audio(clip(), 16000, "hi")
    assert (hit1, hit2) == (False, True) and enc.calls == 1
    b = VoiceStore(tmp_path, tts.identity, enc)  # a restart
    p3, hit3 = b.prompt_for_audio(clip(), 16000, "hi")
    assert hit3 and enc.calls == 1
    assert np.array_equal(p1.latents, p3.latents) and np.array_equal(p1.speaker, p3.speaker) and p3.text == "hi"
    _, hit4 = b.prompt_for_audio(clip(), 16000, "other text")
    assert not hit4 and enc.calls == 2


def test_named_voice_register_get_list_remove(tts, tmp_path):
    s = VoiceStore(tmp_path, tts.identity, Counting(tts))
    p = s.register("alice_1", clip(1), 24000, "hello there")
    assert np.array_equal(s.get("alice_1").latents, p.latents)
    [info] = s.list()
    assert info.name == "alice_1" and info.text == "hello there" and abs(info.seconds - 20000 / 24000) < 1e-6
    assert s.remove("alice_1") and not s.remove("alice_1")
    with pytest.raises(VoiceNotFound, match="alice_1"):
        s.get("alice_1")


@pytest.mark.parametrize("bad", ["../x", "a/b", "", "x" * 65, "with space", "dot.name", "ü"])
def test_bad_names_rejected(bad):
    with pytest.raises(ValueError, match="voice name"):
        check_name(bad)


def test_damaged_entry_is_reencoded_from_source(tts, tmp_path, caplog):
    enc = Counting(tts)
    s = VoiceStore(tmp_path, tts.identity, enc)
    p = s.register("bob", clip(2), 16000, "text")
    prompt_file = tmp_path / "v1" / "named" / "bob.prompt.safetensors"
    prompt_file.write_bytes(prompt_file.read_bytes()[:50])  # truncated
    with caplog.at_level(logging.WARNING):
        q = s.get("bob")
    assert "re-encoding voice 'bob'" in caplog.text
    assert enc.calls == 2 and np.array_equal(p.latents, q.latents)
    assert s.get("bob") is not None and enc.calls == 2  # repaired on disk


def test_checkpoint_change_triggers_reencoding(tts, tmp_path):
    enc = Counting(tts)
    VoiceStore(tmp_path, tts.identity, enc).register("carol", clip(3), 16000, "t")
    other = VoiceStore(tmp_path, "another-checkpoint", enc)
    other.get("carol")
    assert enc.calls == 2
    other.get("carol")
    assert enc.calls == 2


def test_unknown_version_is_reencoded(tts, tmp_path):
    from safetensors.torch import load_file, save_file

    enc = Counting(tts)
    s = VoiceStore(tmp_path, tts.identity, enc)
    s.register("dave", clip(4), 16000, "t")
    f = tmp_path / "v1" / "named" / "dave.prompt.safetensors"
    save_file(load_file(str(f)), str(f), metadata={"format_version": "99", "checkpoint": tts.identity})
    s.get("dave")
    assert enc.calls == 2


class Boom:
    def __reduce__(self):
        return (open, ("/tmp/voice_store_pwned", "w"))


def test_planted_pickle_is_never_loaded(tts, tmp_path):
    import os

    if os.path.exists("/tmp/voice_store_pwned"):
        os.unlink("/tmp/voice_store_pwned")
    enc = Counting(tts)
    s = VoiceStore(tmp_path, tts.identity, enc)
    s.register("eve", clip(5), 16000, "t")
    named = tmp_path / "v1" / "named"
    payload = pickle.dumps(Boom())
    (named / "eve.prompt.safetensors").write_bytes(payload)
    (named / "evil.pkl").write_bytes(payload)
    (named / "mallory.source.safetensors").write_bytes(payload)
    s.get("eve")  # re-encoded from the source, the pickle is only ever parsed as safetensors
    assert [v.name for v in s.list()] == ["eve"]
    assert not os.path.exists("/tmp/voice_store_pwned")


def _register(args):
    root, identity, ckpt, seed = args
    from engine.pipeline import FireRedTTS3

    tts = FireRedTTS3.from_checkpoint(ckpt)
    VoiceStore(root, identity, tts.encode_prompt).register("same", clip(seed), 16000, f"text {seed}")


def test_concurrent_registration_leaves_one_valid_entry(tts, tiny_ckpt, tmp_path):
    with mp.get_context("spawn").Pool(2) as pool:
        pool.map(_register, [(str(tmp_path), tts.identity, str(tiny_ckpt), i) for i in range(2)])
    s = VoiceStore(tmp_path, tts.identity, Counting(tts))
    [info] = s.list()
    assert info.text in ("text 0", "text 1")
    assert s.get("same").text == info.text  # prompt and source agree enough to load
    leftovers = [p.name for p in (tmp_path / "v1").rglob("*.tmp")]
    assert leftovers == []


def test_lru_bounds_anonymous_entries(tts, tmp_path):
    import os
    import time

    s = VoiceStore(tmp_path, tts.identity, Counting(tts), max_anonymous=2)
    for i in range(3):
        s.prompt_for_audio(clip(10 + i, 4000), 16000, "")
        f = sorted((tmp_path / "v1" / "anon").glob("*.prompt.safetensors"), key=os.path.getmtime)[-1]
        os.utime(f, (time.time() + i, time.time() + i))
    assert len(list((tmp_path / "v1" / "anon").glob("*.prompt.safetensors"))) == 2
    _, hit = s.prompt_for_audio(clip(10, 4000), 16000, "")  # the oldest was evicted
    assert not hit
