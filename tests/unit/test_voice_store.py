"""The voice store: reuse, restart survival, re-encoding, concurrency, names, no pickles."""

from __future__ import annotations

import logging
import multiprocessing as mp
import pickle

import numpy as np
import pytest
from safetensors import safe_open

from serving.intake.requests import check_name
from serving.voices.voice_store import VoiceNotFound, VoiceStore


class Counting:
    def __init__(self, model):
        self.model, self.calls = model, 0

    def __call__(self, audio, sr, text):
        self.calls += 1
        return self.model.encode_prompt(audio, sr, text)


def clip(seed=0, n=20000):
    return (0.1 * np.random.default_rng(seed).standard_normal(n)).astype(np.float32)


def test_anonymous_reuse_survives_a_new_store(model, tmp_path):
    enc = Counting(model)
    a = VoiceStore(tmp_path, model.identity, enc)
    p1, hit1 = a.prompt_for_audio(clip(), 16000, "hi")
    p2, hit2 = a.prompt_for_audio(clip(), 16000, "hi")
    assert (hit1, hit2) == (False, True) and enc.calls == 1
    b = VoiceStore(tmp_path, model.identity, enc)  # a restart
    p3, hit3 = b.prompt_for_audio(clip(), 16000, "hi")
    assert hit3 and enc.calls == 1
    assert np.array_equal(p1.latents, p3.latents) and np.array_equal(p1.speaker, p3.speaker) and p3.text == "hi"
    _, hit4 = b.prompt_for_audio(clip(), 16000, "other text")
    assert not hit4 and enc.calls == 2


def test_named_voice_register_get_list_remove(model, tmp_path):
    s = VoiceStore(tmp_path, model.identity, Counting(model))
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


def test_damaged_entry_is_reencoded_from_source(model, tmp_path, caplog):
    enc = Counting(model)
    s = VoiceStore(tmp_path, model.identity, enc)
    p = s.register("bob", clip(2), 16000, "text")
    prompt_file = tmp_path / "v1" / "named" / "bob.prompt.safetensors"
    prompt_file.write_bytes(prompt_file.read_bytes()[:50])  # truncated
    with caplog.at_level(logging.WARNING):
        q = s.get("bob")
    assert "re-encoding voice 'bob'" in caplog.text
    assert enc.calls == 2 and np.array_equal(p.latents, q.latents)
    assert s.get("bob") is not None and enc.calls == 2  # repaired on disk


def test_checkpoint_change_triggers_reencoding(model, tmp_path):
    enc = Counting(model)
    VoiceStore(tmp_path, model.identity, enc).register("carol", clip(3), 16000, "t")
    other = VoiceStore(tmp_path, "another-checkpoint", enc)
    other.get("carol")
    assert enc.calls == 2
    other.get("carol")
    assert enc.calls == 2


def test_unknown_version_is_reencoded(model, tmp_path):
    from safetensors.torch import load_file, save_file

    enc = Counting(model)
    s = VoiceStore(tmp_path, model.identity, enc)
    s.register("dave", clip(4), 16000, "t")
    f = tmp_path / "v1" / "named" / "dave.prompt.safetensors"
    save_file(load_file(str(f)), str(f), metadata={"format_version": "99", "checkpoint": model.identity})
    s.get("dave")
    assert enc.calls == 2


class Boom:
    def __reduce__(self):
        return (open, ("/tmp/voice_store_pwned", "w"))


def test_planted_pickle_is_never_loaded(model, tmp_path):
    import os

    if os.path.exists("/tmp/voice_store_pwned"):
        os.unlink("/tmp/voice_store_pwned")
    enc = Counting(model)
    s = VoiceStore(tmp_path, model.identity, enc)
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
    from engine.fireredtts3 import FireRedTTS3

    model = FireRedTTS3.from_checkpoint(ckpt)
    VoiceStore(root, identity, model.encode_prompt).register("same", clip(seed), 16000, f"text {seed}")


def test_concurrent_registration_leaves_one_valid_entry(model, tiny_ckpt, tmp_path):
    with mp.get_context("spawn").Pool(2) as pool:
        pool.map(_register, [(str(tmp_path), model.identity, str(tiny_ckpt), i) for i in range(2)])
    s = VoiceStore(tmp_path, model.identity, Counting(model))
    [info] = s.list()
    assert info.text in ("text 0", "text 1")
    assert s.get("same").text == info.text  # prompt and source agree enough to load
    leftovers = [p.name for p in (tmp_path / "v1").rglob("*.tmp")]
    assert leftovers == []


def test_lru_bounds_anonymous_entries(model, tmp_path):
    import os
    import time

    s = VoiceStore(tmp_path, model.identity, Counting(model), max_anonymous=2)
    for i in range(3):
        s.prompt_for_audio(clip(10 + i, 4000), 16000, "")
        f = sorted((tmp_path / "v1" / "anon").glob("*.prompt.safetensors"), key=os.path.getmtime)[-1]
        os.utime(f, (time.time() + i, time.time() + i))
    assert len(list((tmp_path / "v1" / "anon").glob("*.prompt.safetensors"))) == 2
    _, hit = s.prompt_for_audio(clip(10, 4000), 16000, "")  # the oldest was evicted
    assert not hit


def corrupt_tensor_bytes(path, offset=16):
    """Flip bytes of a safetensors file's tensor data; its header stays intact, so it still parses."""
    raw = bytearray(path.read_bytes())
    start = 8 + int.from_bytes(raw[:8], "little") + offset
    raw[start : start + 8] = bytes(b ^ 0x5A for b in raw[start : start + 8])
    path.write_bytes(bytes(raw))


def test_corrupted_prompt_bytes_are_reencoded_to_the_same_prompt(model, tmp_path, caplog):
    enc = Counting(model)
    s = VoiceStore(tmp_path, model.identity, enc)
    p = s.register("frank", clip(6), 16000, "text")
    corrupt_tensor_bytes(tmp_path / "v1" / "named" / "frank.prompt.safetensors")
    with caplog.at_level(logging.WARNING):
        q = s.get("frank")
    assert "checksum mismatch" in caplog.text and enc.calls == 2
    assert np.array_equal(p.latents, q.latents) and np.array_equal(p.speaker, q.speaker)
    assert s.get("frank") is not None and enc.calls == 2  # repaired on disk
    corrupt_tensor_bytes(tmp_path / "v1" / "named" / "frank.prompt.safetensors")
    corrupt_tensor_bytes(tmp_path / "v1" / "named" / "frank.source.safetensors", offset=4000)
    with pytest.raises(ValueError, match="voice 'frank' is damaged beyond repair.*register it again"):
        s.get("frank")


def test_corrupted_anonymous_prompt_is_reencoded_from_the_request(model, tmp_path):
    enc = Counting(model)
    s = VoiceStore(tmp_path, model.identity, enc)
    p, _ = s.prompt_for_audio(clip(7), 22050, "anon")
    [f] = (tmp_path / "v1" / "anon").glob("*.prompt.safetensors")
    corrupt_tensor_bytes(f)
    q, hit = s.prompt_for_audio(clip(7), 22050, "anon")
    assert not hit and enc.calls == 2 and np.array_equal(p.latents, q.latents)
    assert s.prompt_for_audio(clip(7), 22050, "anon")[1]  # repaired on disk
    assert list((tmp_path / "v1" / "anon").glob("*.source.safetensors")) == []  # the request has the audio


def test_prompt_without_checksum_is_reencoded_once(model, tmp_path):
    """A prompt written before checksums is re-encoded; a source from then is still trusted."""
    from safetensors.torch import load_file, save_file

    enc = Counting(model)
    s = VoiceStore(tmp_path, model.identity, enc)
    p = s.register("gina", clip(8), 16000, "t")
    for part in ("prompt", "source"):
        f = tmp_path / "v1" / "named" / f"gina.{part}.safetensors"
        with safe_open(str(f), "pt") as h:
            meta = {k: v for k, v in h.metadata().items() if k != "sha256"}
        save_file(load_file(str(f)), str(f), metadata=meta)
    assert np.array_equal(s.get("gina").latents, p.latents) and enc.calls == 2
    s.get("gina")
    assert enc.calls == 2


def test_192khz_reference_is_stored_at_24khz_and_reencodes_to_the_same_prompt(model, tmp_path):
    audio = clip(9, 60 * 192_000)  # the longest reference accepted, at the highest rate
    s = VoiceStore(tmp_path, model.identity, Counting(model))
    p = s.register("hifi", audio, 192_000, "sixty seconds")
    direct = model.encode_prompt(audio, 192_000, "sixty seconds")
    assert np.array_equal(p.latents, direct.latents) and np.array_equal(p.speaker, direct.speaker)
    source = tmp_path / "v1" / "named" / "hifi.source.safetensors"
    with safe_open(str(source), "pt") as h:
        assert h.metadata()["sample_rate"] == "24000"
        assert h.get_slice("audio").get_shape() == [60 * 24_000]
    assert source.stat().st_size < 60 * 24_000 * 4 + 4096  # 5.8 MB, not 46 MB
    assert abs(s.list()[0].seconds - 60.0) < 1e-9
    (tmp_path / "v1" / "named" / "hifi.prompt.safetensors").unlink()
    again = s.get("hifi")  # re-encoded from the 24 kHz copy
    assert np.array_equal(again.latents, direct.latents) and np.array_equal(again.speaker, direct.speaker)


def test_reference_checks_name_the_problem(model, tmp_path):
    s = VoiceStore(tmp_path, model.identity, Counting(model))
    for audio, sr, needle in [
        (clip(1, 100) * 1e4, 16000, "peaks at"),
        (np.full(100, np.nan, np.float32), 16000, "NaN or infinite"),
        (clip(1, 61 * 8000), 8000, "limit is 60 s"),
        (clip(1, 100), 4000, "sample rate must be an integer in 8000..192000"),
    ]:
        with pytest.raises(ValueError, match=needle):
            s.register("x", audio, sr, "")
    assert s.list() == []


def _serves_read_only(store, model, enc, caplog):
    """What a store that cannot be written still does (shared by the chmod and the simulated test)."""
    before = enc.calls
    with caplog.at_level(logging.WARNING):
        assert np.array_equal(store.get("ro").latents, model.encode_prompt(clip(12), 16000, "ro").latents)
        assert store.prompt_for_audio(clip(13, 8000), 16000, "")[1]  # stored anonymous: a hit
        for _ in range(2):
            prompt, hit = store.prompt_for_audio(clip(14, 8000), 16000, "")  # new: encoded, served, not stored
            assert not hit and prompt.latents.shape[1] == 64
    assert enc.calls == before + 2
    assert caplog.text.count("is not writable") == 1  # one warning, however many touches and writes fail
    with pytest.raises(RuntimeError, match="cannot register voice 'new'.*not writable"):
        store.register("new", clip(15), 16000, "")
    assert [v.name for v in store.list()] == ["ro"]


def _fill(root, model, enc):
    s = VoiceStore(root, model.identity, enc)
    s.register("ro", clip(12), 16000, "ro")
    s.prompt_for_audio(clip(13, 8000), 16000, "")


def test_read_only_store_serves_its_voices_simulated(model, tmp_path, caplog, monkeypatch):
    """utime, the lock and every write raise PermissionError, as on a read-only mount (runs as root too)."""
    enc = Counting(model)
    _fill(tmp_path, model, enc)

    def refuse(*args, **kwargs):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr("serving.voices.voice_store.os.utime", refuse)
    monkeypatch.setattr(VoiceStore, "_locked", refuse)
    _serves_read_only(VoiceStore(tmp_path, model.identity, enc), model, enc, caplog)


def test_read_only_store_serves_its_voices_chmod(model, tmp_path, caplog):
    import os
    import stat

    if os.geteuid() == 0:
        pytest.skip("root ignores file modes; test_read_only_store_serves_its_voices_simulated covers this")
    enc = Counting(model)
    _fill(tmp_path, model, enc)
    paths = [p for p in tmp_path.rglob("*")] + [tmp_path]
    for p in paths:
        p.chmod(p.stat().st_mode & ~(stat.S_IWUSR | stat.S_IWGRP | stat.S_IWOTH))
    try:
        _serves_read_only(VoiceStore(tmp_path, model.identity, enc), model, enc, caplog)
    finally:
        for p in paths:
            p.chmod(p.stat().st_mode | stat.S_IWUSR)


def test_byte_cap_evicts_anonymous_entries_never_named_ones(model, tmp_path):
    import os
    import time

    enc = Counting(model)
    s = VoiceStore(tmp_path, model.identity, enc)
    s.register("keep", clip(20, 48000), 24000, "")
    named = sum(f.stat().st_size for f in (tmp_path / "v1" / "named").iterdir())
    s.prompt_for_audio(clip(21, 24000), 24000, "")
    [anon_file] = (tmp_path / "v1" / "anon").iterdir()
    entry = anon_file.stat().st_size
    s.max_bytes = named + 2 * entry + entry // 2  # room for two anonymous entries
    past = time.time() - 1000  # distinct use times, all before the next write
    os.utime(anon_file, (past, past))
    for i in range(1, 4):
        s.prompt_for_audio(clip(21 + i, 24000), 24000, "")
        newest = max((tmp_path / "v1" / "anon").iterdir(), key=os.path.getmtime)
        os.utime(newest, (past + i, past + i))
    assert len(list((tmp_path / "v1" / "anon").iterdir())) == 2
    assert not s.prompt_for_audio(clip(22, 24000), 24000, "")[1]  # the least recently used went first
    assert s.prompt_for_audio(clip(24, 24000), 24000, "")[1]
    assert [v.name for v in s.list()] == ["keep"]
    with pytest.raises(ValueError, match=r"cannot register voice 'big'.*cap of .* GB \(--voice-store-max-gb\)"):
        s.register("big", clip(25, 48000), 24000, "")
    s.register("keep", clip(26, 48000), 24000, "")  # replacing a voice counts its new size only
    assert len(list((tmp_path / "v1" / "anon").iterdir())) == 2
    s.max_bytes = named + entry // 2  # named voices leave no room: anonymous prompts are served, not kept
    assert not s.prompt_for_audio(clip(27, 24000), 24000, "")[1]
    assert list((tmp_path / "v1" / "anon").iterdir()) == [] and s.get("keep") is not None


def _named(tmp_path, name, part):
    return tmp_path / "v1" / "named" / f"{name}.{part}.safetensors"


def test_a_replacement_cut_short_after_its_source_speaks_the_new_voice(model, tmp_path):
    """A kill between the two renames of a replacement leaves the new source beside the old prompt: the
    listing shows the new voice, so the new voice is what is spoken (re-encoded from that source)."""
    enc = Counting(model)
    s = VoiceStore(tmp_path, model.identity, enc)
    s.register("turned", clip(30), 24000, "before")
    VoiceStore(tmp_path / "other", model.identity, enc).register("turned", clip(31), 24000, "after")
    _named(tmp_path, "turned", "source").write_bytes(_named(tmp_path / "other", "turned", "source").read_bytes())
    [info] = s.list()
    assert info.text == "after"
    expected = model.encode_prompt(clip(31), 24000, "after")
    got = s.get("turned")
    assert got.text == "after" and np.array_equal(got.latents, expected.latents)
    assert enc.calls == 3
    s.get("turned")
    assert enc.calls == 3  # repaired on disk


def test_a_prompt_without_its_source_is_not_a_voice(model, tmp_path):
    """A kill between the two unlinks of a removal (the source goes first) leaves a prompt alone: it is
    neither listed nor spoken, and the next write sweeps it away."""
    s = VoiceStore(tmp_path, model.identity, Counting(model))
    s.register("orphan", clip(32), 24000, "")
    _named(tmp_path, "orphan", "source").unlink()
    assert s.list() == []
    with pytest.raises(VoiceNotFound, match="'orphan' is not registered"):
        s.get("orphan")
    s.register("next", clip(33), 24000, "")
    assert not _named(tmp_path, "orphan", "prompt").exists()


def test_a_removal_takes_the_source_first(model, tmp_path, monkeypatch):
    """The source is the voice: a removal killed after its first unlink has removed the voice."""
    from pathlib import Path

    s = VoiceStore(tmp_path, model.identity, Counting(model))
    s.register("leaving", clip(34), 24000, "")
    unlinked = []
    real_unlink = Path.unlink
    monkeypatch.setattr(Path, "unlink", lambda p, *a, **k: (unlinked.append(p.name), real_unlink(p, *a, **k)))
    assert s.remove("leaving")
    assert unlinked[0] == "leaving.source.safetensors"


def test_a_repair_does_not_bring_back_a_voice_removed_meanwhile(model, tmp_path):
    """Another replica removes the voice while this one re-encodes it from its source: the new prompt is
    not written (it would be a prompt without a source)."""
    s = VoiceStore(tmp_path, model.identity, None)

    def encode_while_removed(audio, sr, text):
        VoiceStore(tmp_path, model.identity, None).remove("racing")
        return model.encode_prompt(audio, sr, text)

    VoiceStore(tmp_path, model.identity, model.encode_prompt).register("racing", clip(35), 24000, "")
    _named(tmp_path, "racing", "prompt").unlink()
    s._encode = encode_while_removed
    assert s.get("racing") is not None  # the request in flight is served
    assert list((tmp_path / "v1" / "named").iterdir()) == []
    with pytest.raises(VoiceNotFound):
        s.get("racing")


def test_what_a_killed_writer_left_is_swept_by_the_next_write(model, tmp_path):
    """Temporary files are only written under the store's lock, so one older than a write can take is a
    killed writer's: invisible to readers, and removed by the next write (a fresh one is left alone)."""
    import os
    import time

    s = VoiceStore(tmp_path, model.identity, Counting(model))
    s.register("kept", clip(36), 24000, "")
    named = tmp_path / "v1" / "named"
    stale, fresh = named / ".ghost.source.safetensors.1.2.tmp", named / ".ghost.prompt.safetensors.1.3.tmp"
    for p in (stale, fresh):
        p.write_bytes(_named(tmp_path, "kept", "source").read_bytes()[:1000])
    os.utime(stale, (time.time() - 7200, time.time() - 7200))
    assert [v.name for v in s.list()] == ["kept"]
    with pytest.raises(VoiceNotFound):
        s.get("ghost")
    s.prompt_for_audio(clip(37, 8000), 16000, "")
    assert not stale.exists() and fresh.exists()


def test_a_prompt_from_before_prompts_named_their_source_is_reencoded_once(model, tmp_path, caplog):
    from safetensors.torch import load_file, save_file

    enc = Counting(model)
    s = VoiceStore(tmp_path, model.identity, enc)
    p = s.register("older", clip(38), 24000, "t")
    f = _named(tmp_path, "older", "prompt")
    with safe_open(str(f), "pt") as h:
        meta = {k: v for k, v in h.metadata().items() if k != "source"}
    save_file(load_file(str(f)), str(f), metadata=meta)
    with caplog.at_level(logging.WARNING):
        assert np.array_equal(s.get("older").latents, p.latents)
    assert "names no source (written before prompts did)" in caplog.text and enc.calls == 2
    s.get("older")
    assert enc.calls == 2  # repaired on disk
