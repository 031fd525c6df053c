"""FireRedTTS3-Instruct against a real server, as clients see it: voice design, Instruct cloning, semantic and
acoustic edits over gRPC and HTTP (the plan text first, in its own response); the release's per-task
defaults; bad input named; the gateway's ``instructions``, designed voices, edits and SSE plan events; the
page's two boxes in a headless browser.

These need a server whose checkpoint holds ``fireredtts3_instruct/`` (the tiny preset writes one) with the
Instruct model loaded. Every request is kept short (``SHORT``): the stop head of the tiny checkpoint may
never fire.
"""

from __future__ import annotations

import base64
import io
import json
import shutil
from urllib.parse import unquote

import httpx
import numpy as np
import pytest
import soundfile as sf

from client import InvalidRequest, TTSClient
from engine.chunking import ChunkSchedule
from tests.integration.helpers import in_parallel, serving, wait_gauges_zero
from tests.reference import snr_db

pytestmark = pytest.mark.integration
# compared bit for bit: chunk sizes move float32 rounding, so fixed ones
SHORT = {"max_patches": 6, "chunk_first": 2, "chunk_next": 2, "chunk_fixed": True}
RATE = 16000
CLIP = (0.1 * np.random.default_rng(11).standard_normal(RATE)).astype(np.float32)  # 1 s
DESCRIPTION = "a calm older man, slightly hoarse"
SEMANTIC = "Replace 'cats' with 'dogs'."
ACOUSTIC = "adjust the speed to 0.8x"


def client(server, protocol: str = "grpc") -> TTSClient:
    port = server.ports.grpc if protocol == "grpc" else server.ports.http
    return TTSClient(f"127.0.0.1:{port}", protocol, timeout=120)


def events(stream_of) -> list[tuple[str, object]]:
    """``stream_of(on_plan)`` -> [("plan", text) | ("audio", samples)] in the order they arrived."""
    seen: list[tuple[str, object]] = []
    for chunk in stream_of(lambda text: seen.append(("plan", text))):
        seen.append(("audio", chunk.audio))
    return seen


def audio_of(seen) -> np.ndarray:
    parts = [a for kind, a in seen if kind == "audio"]
    return np.concatenate(parts) if parts else np.zeros(0, np.float32)


def plans_of(seen) -> list[str]:
    return [text for kind, text in seen if kind == "plan"]


def design(tts, seed=None, **kw):
    return events(lambda on_plan: tts.stream("Hello there.", instruction=DESCRIPTION, seed=seed, parameters=SHORT,
                                             on_plan=on_plan, **kw))  # fmt: skip


def edit(tts, instruction, kind, seed=None):
    return events(lambda on_plan: tts.edit(CLIP, RATE, instruction, kind, seed=seed, parameters=SHORT, on_plan=on_plan))


@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_voice_design_sends_one_plan_before_the_audio(server, protocol):
    seen = design(client(server, protocol))
    kinds = [kind for kind, _ in seen]
    assert kinds[0] == "plan" and kinds.count("plan") == 1 and kinds[1:] and set(kinds[1:]) == {"audio"}
    assert isinstance(seen[0][1], str)


def test_design_is_the_same_over_both_protocols_and_takes_the_release_seed(server):
    by_grpc, by_http = design(client(server, "grpc")), design(client(server, "http"))
    assert plans_of(by_grpc) == plans_of(by_http) and np.array_equal(audio_of(by_grpc), audio_of(by_http))
    assert np.array_equal(audio_of(design(client(server), seed=2)), audio_of(by_grpc))  # the default is 2
    assert not np.array_equal(audio_of(design(client(server), seed=1234)), audio_of(by_grpc))
    via_task = design(client(server), task="design")
    assert np.array_equal(audio_of(via_task), audio_of(by_grpc))


@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_instruct_cloning_is_another_model_than_base(server, protocol):
    tts = client(server, protocol)
    instruct = tts.synthesize("Hello there.", ref_audio=CLIP, ref_sample_rate=RATE, task="clone", parameters=SHORT)
    base = tts.synthesize("Hello there.", ref_audio=CLIP, ref_sample_rate=RATE, parameters=SHORT)
    assert instruct.size and base.size and not np.array_equal(instruct, base)
    defaults = tts.synthesize("Hello there.", ref_audio=CLIP, ref_sample_rate=RATE, task="clone", seed=1234,
                              parameters={**SHORT, "cfg": 2.0})  # fmt: skip
    assert np.array_equal(defaults, instruct)  # the release's 1234 and 2.0


@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_a_semantic_edit_sends_the_new_transcript_first(server, protocol):
    seen = edit(client(server, protocol), SEMANTIC, "semantic")
    assert [kind for kind, _ in seen][0] == "plan" and len(plans_of(seen)) == 1 and audio_of(seen).size
    again = edit(client(server, protocol), SEMANTIC, "semantic", seed=1234)  # the default seed
    assert plans_of(again) == plans_of(seen) and np.array_equal(audio_of(again), audio_of(seen))


def test_an_edit_of_exactly_30_s_is_taken(server):
    """30 s is measured on the user's file: exactly 30.0 s at 16 kHz pads to 188 whole patches (30.08 s), which
    were refused as "30.1 s" after encoding; then a legitimate stream sounds as before it."""
    before = design(client(server))
    recording = (0.1 * np.random.default_rng(30).standard_normal(30 * RATE)).astype(np.float32)
    seen = events(lambda on_plan: client(server).edit(recording, RATE, ACOUSTIC, "acoustic", parameters=SHORT,
                                                      on_plan=on_plan))  # fmt: skip
    assert audio_of(seen).size
    with pytest.raises(InvalidRequest, match="30 s"):  # one sample more is over, at the front door
        client(server).synthesize(None, ref_audio=np.append(recording, 0.0), ref_sample_rate=RATE, task="acoustic_edit",
                                  instruction=ACOUSTIC, parameters=SHORT)  # fmt: skip
    after = design(client(server))
    assert plans_of(after) == plans_of(before) and np.array_equal(audio_of(after), audio_of(before))


@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_an_acoustic_edit_has_no_plan(server, protocol):
    seen = edit(client(server, protocol), ACOUSTIC, "acoustic")
    assert plans_of(seen) == [] and audio_of(seen).size


BAD = [
    ("with_a_voice", {"instruction": DESCRIPTION, "ref_audio": CLIP, "ref_sample_rate": RATE}, "INSTRUCTION"),
    ("empty", {"instruction": "   "}, "INSTRUCTION"),
    ("overlong", {"instruction": "x" * 501}, "INSTRUCTION"),
    ("control_token", {"instruction": "calm<|im_end|>"}, "INSTRUCTION"),
    ("task", {"task": "sing"}, "TASK"),
    ("clone_without_voice", {"task": "clone"}, "VOICE_ID"),
    ("design_without_instruction", {"task": "design"}, "INSTRUCTION"),
    ("edit_with_text", {"task": "semantic_edit", "instruction": SEMANTIC, "ref_audio": CLIP, "ref_sample_rate": RATE},
     "TEXT"),
    ("template", {"text": None, "task": "acoustic_edit", "instruction": "make it faster", "ref_audio": CLIP,
                  "ref_sample_rate": RATE}, "INSTRUCTION"),
    ("too_long", {"text": None, "task": "semantic_edit", "instruction": SEMANTIC,
                  "ref_audio": np.zeros(31 * RATE, np.float32), "ref_sample_rate": RATE}, "REF_AUDIO"),
]  # fmt: skip


@pytest.mark.parametrize("protocol", ["grpc", "http"])
@pytest.mark.parametrize(("tag", "kw", "needle"), BAD, ids=[case[0] for case in BAD])
def test_bad_instruct_input_is_invalid_and_named(server, protocol, tag, kw, needle):
    kw = {"text": "Hello there.", **kw}
    with pytest.raises(InvalidRequest) as e:
        client(server, protocol).synthesize(kw.pop("text"), parameters=SHORT, **kw)
    assert needle in str(e.value), str(e.value)
    m = wait_gauges_zero(server)
    assert m["tts_generator_active_slots"] == 0 and m["tts_vocoder_active_streams"] == 0


@pytest.fixture(scope="module")
def offline(nostop_ckpt):
    import torch

    from engine.fireredtts3 import FireRedTTS3

    torch.set_num_threads(1)
    return FireRedTTS3.from_checkpoint(nostop_ckpt)


@pytest.mark.parametrize("task", ["design", "clone", "semantic_edit", "acoustic_edit"])
def test_streamed_instruct_equals_offline(server, offline, task):
    """Through tts (front end, prompt_encoder, generator, vocoder over BLS) as engine.synthesize.instruct_run
    makes it in this process: the same plan text, and the same audio."""
    from engine.synthesize import instruct_run

    kw = {"design": {"text": "Hello there.", "instruction": DESCRIPTION},
          "clone": {"text": "Hello there.", "audio": CLIP, "sample_rate": RATE},
          "semantic_edit": {"instruction": SEMANTIC, "audio": CLIP, "sample_rate": RATE},
          "acoustic_edit": {"instruction": ACOUSTIC, "audio": CLIP, "sample_rate": RATE}}[task]  # fmt: skip
    schedule = ChunkSchedule(2, 2, fixed=True)
    ref = instruct_run(offline, task, seed=5, max_patches=SHORT["max_patches"], schedule=schedule, **kw)
    voice = {"ref_audio": kw["audio"], "ref_sample_rate": RATE} if "audio" in kw else {}
    seen = events(lambda on_plan: client(server).stream(kw.get("text"), instruction=kw.get("instruction"),
                                                        task=task, seed=5, parameters=SHORT, on_plan=on_plan,
                                                        **voice))  # fmt: skip
    assert plans_of(seen) == ([ref.plan_text] if task in ("design", "semantic_edit") else [])
    got = audio_of(seen)
    assert got.shape == ref.audio.shape and snr_db(ref.audio, got) >= 60


def test_eight_mixed_streams_each_equal_their_solo_run(server):
    """Base and design streams at once (some designs in their text phase while Base streams speak)."""

    def one(i: int):
        tts = client(server)
        if i % 2:
            return design(tts, seed=i)
        return [("audio", tts.synthesize("Hello there.", seed=i, parameters=SHORT))]

    solo = {i: one(i) for i in range(8)}
    together = in_parallel(one, 8)
    for i in range(8):  # the same tokens; audio as close as batched float math allows (as for Base)
        assert plans_of(together[i]) == plans_of(solo[i]), i
        a, b = audio_of(together[i]), audio_of(solo[i])
        assert a.shape == b.shape and snr_db(b, a) >= 60, i


def test_a_design_cancelled_at_once_frees_its_slot(server):
    """Cancelled as soon as it is sent (in its text phase, or queued before it), and after its first audio."""
    import tritonclient.grpc as grpcclient

    from client.request import grpc_inputs, request_fields

    fields = request_fields("Hello there.", instruction=DESCRIPTION)
    triton = grpcclient.InferenceServerClient(f"127.0.0.1:{server.ports.grpc}")
    triton.start_stream(callback=lambda result, error: None)
    triton.async_stream_infer("tts", grpc_inputs(fields), parameters={"max_patches": 400})
    triton.stop_stream(cancel_requests=True)
    triton.close()
    stream = client(server).stream("Hello there.", instruction=DESCRIPTION, parameters={"max_patches": 400})
    next(stream)
    stream.close()
    m = wait_gauges_zero(server, 30)
    assert m["tts_generator_active_slots"] == 0 and m["tts_vocoder_active_streams"] == 0
    assert audio_of(design(client(server))).size  # and the server goes on


# ---- the gateway ----


@pytest.fixture(scope="module")
def sdk(gateway):
    from openai import OpenAI

    return OpenAI(base_url=f"{gateway}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def grpc_design(server):
    return design(client(server), seed=7)


def pcm(data: bytes) -> np.ndarray:
    return np.frombuffer(data, "<i2")


def quantized(audio: np.ndarray) -> np.ndarray:
    return np.round(np.clip(audio, -1, 1) * 32767).astype("<i2")


def test_the_openai_sdk_designs_a_voice_from_instructions(sdk, grpc_design):
    """A stock voice name with instructions is voice design: the gRPC audio of the same design."""
    response = sdk.audio.speech.create(
        model="fireredtts3", voice="alloy", input="Hello there.", instructions=DESCRIPTION, response_format="pcm",
        extra_body={"seed": 7, **SHORT},
    )  # fmt: skip
    assert np.array_equal(pcm(response.content), quantized(audio_of(grpc_design)))


def test_the_plan_text_in_the_header_and_as_the_first_sse_event(gateway, grpc_design):
    body = {"input": "Hello there.", "instructions": DESCRIPTION, "response_format": "pcm", "seed": 7, **SHORT}
    r = httpx.post(f"{gateway}/v1/audio/speech", json=body, timeout=120)
    assert r.status_code == 200 and [unquote(r.headers["x-plan-text"])] == plans_of(grpc_design)
    r = httpx.post(f"{gateway}/v1/audio/speech", json={**body, "stream_format": "sse"}, timeout=120)
    sse = [json.loads(line[5:]) for line in r.text.splitlines() if line.startswith("data:")]
    assert sse[0] == {"type": "speech.plan", "text": plans_of(grpc_design)[0]}
    audio = b"".join(base64.b64decode(e["audio"]) for e in sse if e["type"] == "speech.audio.delta")
    assert np.array_equal(pcm(audio), quantized(audio_of(grpc_design)))


def test_instructions_with_a_registered_voice_are_a_400(sdk, server, gateway):
    import openai

    admin = {"Authorization": f"Bearer {server.admin_key}"}
    # registered through the gateway, so that its cached voice list knows the voice at once
    r = httpx.post(f"{gateway}/v1/audio/voices", data={"name": "clip-voice", "text": ""}, headers=admin,
                   files={"file": ("clip.wav", wav_upload(CLIP))}, timeout=120)  # fmt: skip
    assert r.status_code == 200, r.text
    try:
        with pytest.raises(openai.BadRequestError) as e:
            sdk.audio.speech.create(model="fireredtts3", voice="clip-voice", input="Hi", instructions=DESCRIPTION)
        assert e.value.body["param"] == "instructions" and "Drop instructions" in e.value.body["message"]
    finally:
        httpx.delete(f"{gateway}/v1/audio/voices/clip-voice", headers=admin, timeout=30)


def wav_upload(audio: np.ndarray, rate: int = RATE) -> bytes:
    out = io.BytesIO()
    sf.write(out, audio, rate, format="WAV", subtype="FLOAT")  # float: the gateway decodes the same samples
    return out.getvalue()


@pytest.mark.parametrize("stream_format", ["audio", "sse"])
def test_the_edit_endpoint_streams_the_edit_and_its_transcript(gateway, server, stream_format):
    seen = edit(client(server), SEMANTIC, "semantic", seed=3)
    form = {"instructions": SEMANTIC, "type": "semantic", "response_format": "pcm", "seed": "3",
            "stream_format": stream_format, **{k: json.dumps(v) for k, v in SHORT.items()}}  # fmt: skip
    r = httpx.post(f"{gateway}/v1/audio/edits", data=form, files={"file": ("in.wav", wav_upload(CLIP))}, timeout=120)
    assert r.status_code == 200, r.text
    assert [unquote(r.headers["x-plan-text"])] == plans_of(seen)
    if stream_format == "sse":
        sse = [json.loads(line[5:]) for line in r.text.splitlines() if line.startswith("data:")]
        assert sse[0] == {"type": "speech.plan", "text": plans_of(seen)[0]}
        data = b"".join(base64.b64decode(e["audio"]) for e in sse if e["type"] == "speech.audio.delta")
    else:
        data = r.content
    assert np.array_equal(pcm(data), quantized(audio_of(seen)))  # the same recording, seed and settings


def test_a_designed_voice_is_registered_once_and_base_speaks_it_the_same_every_time(gateway, server):
    admin = {"Authorization": f"Bearer {server.admin_key}"}
    body = {"name": "designed-calm", "instructions": DESCRIPTION, "text": "Good evening, and welcome.", "seed": 5,
            "max_patches": 12}  # fmt: skip
    r = httpx.post(f"{gateway}/v1/audio/voices", json=body, headers=admin, timeout=300)
    assert r.status_code == 200, r.text
    voice = r.json()
    assert voice["name"] == "designed-calm" and isinstance(voice["plan"], str) and voice["seconds"] > 0
    try:
        names = [v["name"] for v in httpx.get(f"{gateway}/v1/audio/voices", timeout=30).json()["voices"]]
        assert "designed-calm" in names
        speak = {"input": "A later sentence.", "voice": "designed-calm", "response_format": "pcm", "seed": 9, **SHORT}
        first = httpx.post(f"{gateway}/v1/audio/speech", json=speak, timeout=120)
        second = httpx.post(f"{gateway}/v1/audio/speech", json=speak, timeout=120)
        assert first.status_code == 200 and first.content == second.content and "x-plan-text" not in first.headers
        by_grpc = client(server).synthesize("A later sentence.", voice_id="designed-calm", seed=9, parameters=SHORT)
        assert np.array_equal(pcm(first.content), quantized(by_grpc))  # Base with the stored reference
    finally:
        httpx.delete(f"{gateway}/v1/audio/voices/designed-calm", headers=admin, timeout=30)


def test_a_designed_voice_survives_a_restart(server, server_options, gateway, tmp_path):
    """Designed through the gateway of one server (the module's), spoken by Base on the next one from the same
    voice folder (a server started like it on that folder: one start, not two)."""
    from dataclasses import replace

    from serving.config.repository import build
    from serving.supervision.triton_env import Ports, TritonServer

    body = {"name": "designed-kept", "instructions": DESCRIPTION, "text": "Good evening.", "max_patches": 8}
    admin = {"Authorization": f"Bearer {server.admin_key}"}
    try:
        assert httpx.post(f"{gateway}/v1/audio/voices", json=body, headers=admin, timeout=300).status_code == 200
        before = client(server).synthesize("After restart.", voice_id="designed-kept", seed=4, parameters=SHORT)
        options = replace(server_options, cancel_dir=str(tmp_path / "cancel"), run_dir=str(tmp_path))
        with serving(TritonServer(build(tmp_path / "repo", options), tmp_path, Ports.free())) as srv:
            after = client(srv).synthesize("After restart.", voice_id="designed-kept", seed=4, parameters=SHORT)
    finally:
        httpx.delete(f"{gateway}/v1/audio/voices/designed-kept", headers=admin, timeout=30)
    assert before.size and np.array_equal(before, after)


def test_a_design_with_a_wrong_key_registers_nothing(server, gateway):
    def designs() -> float:  # tts requests so far: a design is one
        return sum(v for k, v in server.metrics(("tts_requests_total",)).items())

    body = {"name": "not-mine", "instructions": DESCRIPTION, "text": "Hello.", "max_patches": 6}
    before = designs()
    r = httpx.post(f"{gateway}/v1/audio/voices", json=body, headers={"Authorization": "Bearer wrong"}, timeout=300)
    assert r.status_code == 403 and r.json()["error"]["type"] == "permission_error", r.text
    assert designs() == before  # the key is checked before the design runs
    names = [v["name"] for v in httpx.get(f"{gateway}/v1/audio/voices", timeout=30).json()["voices"]]
    assert "not-mine" not in names


# ---- the page (headless Chromium, as tests/integration/test_page.py) ----

BROWSER = shutil.which("chromium") and shutil.which("chromedriver")


@pytest.fixture()
def browser(tmp_path):
    if not BROWSER:
        pytest.skip("no chromium/chromedriver: run `make test-browser` to install them")
    from tests.integration.test_page import chromium

    yield from chromium(tmp_path)


@pytest.mark.browser
def test_the_page_describes_a_voice_plays_it_and_saves_it(browser, gateway, server):
    from selenium.webdriver.common.by import By

    from tests.integration.test_page import player, wait_for

    browser.get(gateway + "/")
    browser.find_element(By.CSS_SELECTOR, "#speak button[type=submit]").click()  # something heard before
    wait_for(lambda: "/v1/audio/speech?" in player(browser)["src"], what="Speak")
    browser.find_element(By.ID, "dinstr").send_keys(DESCRIPTION)
    browser.find_element(By.CSS_SELECTOR, "#design button[type=submit]").click()
    plan = wait_for(lambda: browser.find_element(By.ID, "dplan").text, timeout=300, what="the plan on Play")
    assert plan.startswith("voice plan: ")
    wait_for(lambda: player(browser)["src"].startswith("blob:") and player(browser)["t"] > 0.1, timeout=300,
             what="the designed voice to play")  # fmt: skip
    # Download is the design just heard, not the Speak before it
    assert browser.find_element(By.ID, "download").get_attribute("href") == player(browser)["src"]
    assert browser.find_element(By.ID, "design-error").text == ""
    browser.find_element(By.ID, "dname").send_keys("designed-on-the-page")
    browser.find_element(By.ID, "dkey").send_keys(server.admin_key)
    browser.find_element(By.ID, "dsave").click()
    wait_for(lambda: browser.execute_script("return document.getElementById('voice').value")
             == "designed-on-the-page", timeout=300, what="the designed voice in the picker")  # fmt: skip
    assert "saved as designed-on-the-page" in browser.find_element(By.ID, "dplan").text
    browser.get("about:blank")
    admin = {"Authorization": f"Bearer {server.admin_key}"}
    httpx.delete(f"{gateway}/v1/audio/voices/designed-on-the-page", headers=admin, timeout=30)


@pytest.mark.browser
def test_the_page_edits_a_recording_and_shows_the_transcript(browser, gateway, tmp_path):
    from selenium.webdriver.common.by import By

    from tests.integration.test_page import player, wait_for

    recording = tmp_path / "edit-me.wav"
    sf.write(recording, CLIP, RATE)
    browser.get(gateway + "/")
    browser.find_element(By.ID, "format").send_keys("wav")
    browser.find_element(By.ID, "efile").send_keys(str(recording))
    browser.find_element(By.ID, "einstr").send_keys(SEMANTIC)
    browser.find_element(By.CSS_SELECTOR, "#edit button[type=submit]").click()
    transcript = wait_for(lambda: (t := browser.find_element(By.ID, "etranscript").text).startswith("transcript:")
                          and t, timeout=300, what="the transcript")  # fmt: skip
    assert transcript.startswith("transcript: ")
    # the tiny checkpoint never stops on its own: the edit runs to its patch limit (~64 s of audio), which
    # a loaded 2-core machine generates in more than wait_for's default 30 s; the same bound as the transcript
    wait_for(lambda: player(browser)["src"].startswith("blob:"), timeout=300, what="the edited audio in the player")
    assert browser.find_element(By.ID, "download").get_attribute("href") == player(browser)["src"]
    assert browser.find_element(By.ID, "edit-error").text == ""
