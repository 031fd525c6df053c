"""Voices through Triton: named voices, anonymous reuse, and survival across a server restart."""

from __future__ import annotations

import numpy as np
import pytest

from client import TTSClient, TTSError
from client.voices import VoiceClient
from serving.config.repository import ServeOptions, build
from serving.supervision.triton_env import Ports, TritonServer
from tests.integration.helpers import metrics, serving

pytestmark = pytest.mark.integration
# compared bit for bit: chunk sizes move float32 rounding, so fixed ones
SAME_BITS = {"max_patches": 6, "chunk_fixed": True}


def ref_clip(seed=7, n=30000):
    return (0.1 * np.random.default_rng(seed).standard_normal(n)).astype(np.float32)


def test_named_voice_lifecycle(server):
    url = f"127.0.0.1:{server.ports.grpc}"
    voices = VoiceClient(url, admin_key=server.admin_key)
    added = voices.add("narrator-1", ref_clip(1), 16000, "a narrator")
    assert added["name"] == "narrator-1"
    assert any(v["name"] == "narrator-1" for v in voices.list())
    tts = TTSClient(url)
    by_id = tts.synthesize("Hello", voice_id="narrator-1", seed=3, parameters=SAME_BITS)
    by_audio = tts.synthesize("Hello", ref_audio=ref_clip(1), ref_sample_rate=16000, ref_text="a narrator",
                              seed=3, parameters=SAME_BITS)  # fmt: skip
    assert np.array_equal(by_id, by_audio)
    assert voices.remove("narrator-1")["removed"]
    with pytest.raises(TTSError, match="not registered"):
        tts.synthesize("Hello", voice_id="narrator-1", parameters={"max_patches": 6})
    http = VoiceClient(f"127.0.0.1:{server.ports.http}", "http")
    assert not any(v["name"] == "narrator-1" for v in http.list())


@pytest.mark.parametrize("name", ["../etc", "a/b", "x" * 65, "with space"])
def test_bad_voice_names_rejected(server, name):
    with pytest.raises(TTSError, match="voice name"):
        VoiceClient(f"127.0.0.1:{server.ports.grpc}", admin_key=server.admin_key).add(name, ref_clip(), 16000, "t")


@pytest.mark.parametrize("protocol", ["grpc", "http"])
@pytest.mark.parametrize("key", [None, "", "wrong"])
def test_adding_and_removing_voices_needs_the_admin_key(server, protocol, key):
    port = server.ports.grpc if protocol == "grpc" else server.ports.http
    admin = VoiceClient(f"127.0.0.1:{port}", protocol, admin_key=server.admin_key)
    admin.add("guarded", ref_clip(3), 16000, "guarded")
    other = VoiceClient(f"127.0.0.1:{port}", protocol, admin_key=key or "")
    told = "the admin key is wrong" if key else "needs the admin key"  # a wrong key and none are told apart
    with pytest.raises(TTSError, match=told):
        other.add("intruder", ref_clip(4), 16000, "x")
    with pytest.raises(TTSError, match=told):
        other.remove("guarded")
    names = [v["name"] for v in other.list()]  # listing is open
    assert "guarded" in names and "intruder" not in names
    assert admin.remove("guarded")["removed"]


def test_anonymous_reference_is_encoded_once(server):
    url = f"127.0.0.1:{server.ports.grpc}"
    clip = ref_clip(42)
    m0 = metrics(server)
    for _ in range(2):
        TTSClient(url).synthesize(
            "Twice", ref_audio=clip, ref_sample_rate=22050, ref_text="x", parameters={"max_patches": 6}
        )
    m1 = metrics(server)
    assert m1["tts_prompt_encodes_total"] - m0["tts_prompt_encodes_total"] == 1
    assert m1["tts_prompt_cache_hits_total"] - m0["tts_prompt_cache_hits_total"] == 1


def test_voices_survive_restart(nostop_ckpt, tmp_path):
    voice_dir = tmp_path / "voices"
    clip = ref_clip(9)
    kw = dict(seed=21, parameters={"max_patches": 7, "chunk_fixed": True})

    def serve(tag):
        work = tmp_path / tag
        repo = build(work / "repo", ServeOptions(checkpoint=str(nostop_ckpt), slots=2, max_len=512,
                                                 voice_dir=str(voice_dir), cancel_dir=str(work / "cancel")))  # fmt: skip
        return TritonServer(repo, work, Ports.free())

    # each stopped on a thread (the store is shared safely by several processes: the second may start while the
    # first stops); nothing reads their files after
    with serving(serve("first")) as srv:
        url = f"127.0.0.1:{srv.ports.grpc}"
        VoiceClient(url, admin_key=srv.admin_key).add("keeper", clip, 24000, "kept voice")
        named1 = TTSClient(url).synthesize("After restart", voice_id="keeper", **kw)
        anon1 = TTSClient(url).synthesize("After restart", ref_audio=clip[:20000], ref_sample_rate=24000, **kw)
        assert metrics(srv)["tts_prompt_encodes_total"] == 2
    with serving(serve("second")) as srv:
        url = f"127.0.0.1:{srv.ports.grpc}"
        named2 = TTSClient(url).synthesize("After restart", voice_id="keeper", **kw)
        anon2 = TTSClient(url).synthesize("After restart", ref_audio=clip[:20000], ref_sample_rate=24000, **kw)
        m = metrics(srv)
        assert m["tts_prompt_encodes_total"] == 0
        assert m["tts_prompt_cache_hits_total"] == 2
        assert [v["name"] for v in VoiceClient(url).list()] == ["keeper"]
    assert np.array_equal(named1, named2) and np.array_equal(anon1, anon2)


def test_cli_voices_add_list_use_remove(server, tmp_path):
    import os
    import subprocess
    import sys

    import soundfile as sf

    wav = tmp_path / "ref.wav"
    sf.write(wav, ref_clip(11, 24000), 24000)
    url = ["--url", f"127.0.0.1:{server.ports.grpc}"]

    def cli(*args):
        return subprocess.run(
            [sys.executable, "-m", "client", *url, *args],
            capture_output=True,
            text=True,
            timeout=120,
            env={**os.environ, "TTS_ADMIN_KEY": server.admin_key},
        )

    r = cli("voices", "add", "cli_voice", "--audio", str(wav), "--text", "from the cli")
    assert r.returncode == 0, r.stderr
    r = cli("voices", "list")
    assert r.returncode == 0 and "cli_voice" in r.stdout and "from the cli" in r.stdout
    out = tmp_path / "out.wav"
    r = cli("--text", "Hello", "--voice-id", "cli_voice", "--max-patches", "6", "--out", str(out), "-q")
    assert r.returncode == 0, r.stderr
    assert sf.info(out).samplerate == 24000
    r = cli("voices", "add", "bad/name", "--audio", str(wav))
    assert r.returncode == 1 and "voice name" in r.stderr
    assert cli("voices", "remove", "cli_voice").returncode == 0
    r = cli("voices", "remove", "cli_voice")
    assert r.returncode == 1 and "not registered" in r.stderr
