"""The job API for long text (gateway/jobs) against a real gateway and tritonserver (the tiny no-stop
checkpoint: each utterance lasts exactly max_patches): a one-part job's file is the speech route's bytes for
the same fields; a text of several parts is spoken part by part, in order, with progress that moves; a
cancel frees the job's streams of its address's share; a restarted gateway keeps ended jobs and resumes a
running one from the parts on disk; each bound is a named error; one key never sees another's job."""

from __future__ import annotations

import json
import time

import httpx
import numpy as np
import pytest

from client.longform import JOIN_SILENCE_SECONDS
from engine.protocol import SAMPLE_RATE
from gateway.budget import Bounds
from gateway.jobs.options import JobOptions
from gateway.server import ServerOptions, in_thread
from tests.integration.helpers import wait_gauges_zero
from tests.integration.test_client import cli

pytestmark = pytest.mark.integration
SHORT = {"max_patches": 4, "chunk_first": 1, "chunk_next": 2, "chunk_fixed": True}
LONGER = {**SHORT, "max_patches": 24}  # a part that takes a while (progress is seen between parts)
ENDLESS = {**SHORT, "max_patches": 400}  # a part that is still running when the test cancels it
SENTENCES = ["The first sentence is here.", "A second one follows it.", "And the third ends it."]
GAP = round(JOIN_SILENCE_SECONDS * SAMPLE_RATE)


def body(text: str, fmt: str = "wav", **fields) -> dict:
    return {"model": "fireredtts3", "input": text, "response_format": fmt, "seed": 7, **SHORT, **fields}


def key(name: str) -> dict:
    return {"Authorization": f"Bearer {name}"}


def submit(url: str, fields: dict, headers: dict | None = None) -> dict:
    r = httpx.post(f"{url}/v1/audio/jobs", json=fields, headers=headers or {}, timeout=30)
    assert r.status_code == 200, r.text
    return r.json()


def wait(url: str, job_id: str, headers: dict | None = None, until=("done", "failed", "cancelled")) -> dict:
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        job = httpx.get(f"{url}/v1/audio/jobs/{job_id}", headers=headers or {}, timeout=30).json()
        if job["status"] in until if isinstance(until, tuple) else until(job):
            return job
        time.sleep(0.05)
    raise AssertionError(f"job {job_id} never got there: {job}")


def audio(url: str, job_id: str, headers: dict | None = None) -> bytes:
    r = httpx.get(f"{url}/v1/audio/jobs/{job_id}/audio", headers=headers or {}, timeout=30)
    assert r.status_code == 200, r.text
    return r.content


def speech(url: str, fields: dict) -> bytes:
    r = httpx.post(f"{url}/v1/audio/speech", json=fields, timeout=60)
    assert r.status_code == 200, r.text
    return r.content


def pcm(wav: bytes) -> np.ndarray:
    return np.frombuffer(wav[44:], "<i2").astype(np.float32)


def snr_db(got: np.ndarray, want: np.ndarray) -> float:
    return 10 * np.log10(np.sum(want**2) / max(np.sum((got - want) ** 2), 1e-9))


@pytest.fixture(scope="module")
def gateway_jobs(server, tmp_path_factory):
    """A gateway whose jobs cut parts at 40 characters, two at once."""
    jobs = JobOptions(tmp_path_factory.mktemp("jobs"), part_chars=40, parts_at_once=2, per_client=50)
    with in_thread(f"127.0.0.1:{server.ports.grpc}", jobs=jobs) as url:
        yield url


def test_a_one_part_job_is_the_speech_routes_bytes(gateway_jobs):
    for fmt in ("flac", "wav"):
        job = submit(gateway_jobs, body("Served words.", fmt))
        assert (job["status"], job["parts_total"], job["object"]) in {("queued", 1, "audio.job"),
                                                                      ("running", 1, "audio.job")}  # fmt: skip
        assert wait(gateway_jobs, job["id"])["status"] == "done"
        got, want = audio(gateway_jobs, job["id"]), speech(gateway_jobs, body("Served words.", fmt))
        if fmt == "flac":
            assert got == want
        else:  # the streamed WAV says "unknown length"; the file's header has its sizes
            assert got[44:] == want[44:] and got[:4] == want[:4] and got[8:40] == want[8:40]
            assert int.from_bytes(got[4:8], "little") == len(got) - 8
            assert int.from_bytes(got[40:44], "little") == len(got) - 44


def test_parts_are_spoken_in_order_with_the_stated_silence_and_progress_moves(gateway_jobs, server):
    text = " ".join(SENTENCES)  # 3 parts of under 40 characters
    job = submit(gateway_jobs, body(text, **LONGER))
    assert job["parts_total"] == 3 and job["characters"] == len("".join(SENTENCES))
    seen = []
    with httpx.stream("GET", f"{gateway_jobs}/v1/audio/jobs/{job['id']}/events", timeout=120) as events:
        for line in events.iter_lines():
            if line.startswith("data: "):
                seen.append(json.loads(line[6:]))
    assert seen[-1]["status"] == "done" and seen[-1]["parts_done"] == 3, seen[-1]
    done = [e["parts_done"] for e in seen]
    assert done == sorted(done) and any(0 < d < 3 for d in done), done  # it moved, part by part
    assert [e["audio_seconds"] for e in seen] == sorted(e["audio_seconds"] for e in seen)
    got = pcm(audio(gateway_jobs, job["id"]))
    alone = [pcm(speech(gateway_jobs, body(s, **LONGER))) for s in SENTENCES]
    assert got.size == sum(a.size for a in alone) + 2 * GAP
    assert seen[-1]["audio_seconds"] == pytest.approx(got.size / SAMPLE_RATE, abs=1e-3)
    at = 0
    for i, want in enumerate(alone):  # each part is its own sentence's audio (float-close: batched beside another)
        part = got[at : at + want.size]
        assert snr_db(part, want) > 40, i
        assert all(snr_db(part, other) < 20 for other in alone if other is not want), i
        at += want.size
        if i < 2:
            assert not got[at : at + GAP].any()
            at += GAP
    wait_gauges_zero(server, 30)


def test_a_cancel_frees_the_jobs_streams_of_its_addresss_share(server, tmp_path):
    """With a share of 2 and 2 parts at once, the running job holds its address's share: that address's
    speech request is refused until the cancel, then served; the server's gauges go back to 0."""
    jobs = JobOptions(tmp_path, part_chars=40, parts_at_once=2)
    options = ServerOptions(bounds=Bounds(streams_per_peer=2))
    with in_thread(f"127.0.0.1:{server.ports.grpc}", options=options, jobs=jobs) as url:
        job = submit(url, body(" ".join(SENTENCES * 2), **ENDLESS))
        wait(url, job["id"], until=lambda j: j["status"] == "running")
        refused = None
        for _ in range(50):  # the job's two parts take the share as soon as they start
            r = httpx.post(f"{url}/v1/audio/speech", json=body("Short.", "pcm"), timeout=60)
            if r.status_code == 429:
                refused = r
                break
            time.sleep(0.05)
        assert refused is not None and "too many streams from your address" in refused.json()["error"]["message"]
        r = httpx.post(f"{url}/v1/audio/jobs/{job['id']}/cancel", timeout=30)
        assert r.status_code == 200 and r.json()["status"] == "cancelled", r.text
        assert speech(url, body("Short.", "pcm"))  # the share is free again
        again = httpx.post(f"{url}/v1/audio/jobs/{job['id']}/cancel", timeout=30)
        assert again.status_code == 409 and "has ended (cancelled)" in again.json()["error"]["message"]
        assert httpx.get(f"{url}/v1/audio/jobs/{job['id']}/audio", timeout=30).status_code == 409
    m = wait_gauges_zero(server, 30)
    assert m["tts_generator_active_slots"] == 0 and m["tts_vocoder_active_streams"] == 0


def test_a_restart_keeps_ended_jobs_and_resumes_a_running_one_from_its_parts_on_disk(server, tmp_path):
    jobs = JobOptions(tmp_path, part_chars=40, parts_at_once=1)
    triton = f"127.0.0.1:{server.ports.grpc}"
    text = " ".join([*SENTENCES, "A fourth one closes it."])  # 4 parts
    with in_thread(triton, jobs=jobs) as url:
        ended = submit(url, body("Kept across a restart.", "mp3"))
        kept = audio(url, wait(url, ended["id"])["id"])
        running = submit(url, body(text, **LONGER))
        wait(url, running["id"], until=lambda j: j["parts_done"] >= 2)
    parts_on_disk = sorted(p.name for p in (tmp_path / running["id"]).glob("part-*.f32"))
    assert 2 <= len(parts_on_disk) < 4, parts_on_disk  # stopped mid-job, what was made is kept
    wait_gauges_zero(server, 30)  # the part cut by the stop has left the server: the next ones run alone
    with in_thread(triton, jobs=jobs) as url:
        assert audio(url, ended["id"]) == kept
        resumed = wait(url, running["id"])
        assert resumed["status"] == "done" and resumed["parts_done"] == 4, resumed
        fresh = submit(url, body(text, **LONGER))
        assert audio(url, wait(url, fresh["id"])["id"]) == audio(url, running["id"])  # alone, the same bytes
    assert not list((tmp_path / running["id"]).glob("part-*.f32"))  # the parts are gone once joined


def test_each_bound_is_a_named_error(server, tmp_path):
    jobs = JobOptions(tmp_path, part_chars=40, max_chars=200, per_client=2)
    with in_thread(f"127.0.0.1:{server.ports.grpc}", jobs=jobs) as url:

        def refused(fields, status, headers=None):
            r = httpx.post(f"{url}/v1/audio/jobs", json=fields, headers=headers or {}, timeout=30)
            assert r.status_code == status, r.text
            return r.json()["error"]

        error = refused(body("word " * 41), 413)
        assert error["message"] == "input is 205 characters; a job takes at most 200" and error["param"] == "input"
        error = refused(body("ok. " + "z" * 50), 400)
        assert "50 characters without a space" in error["message"]
        assert refused(body("Hi.", stream_format="sse"), 400)["param"] == "stream_format"
        assert refused(body("Hi.", seed="x"), 400)["param"] == "seed"  # the speech route's checks
        assert refused(body("Hi.", response_format="ogg"), 400)["param"] == "response_format"
        first = submit(url, body("One.", **ENDLESS), key("a"))
        assert httpx.get(f"{url}/v1/audio/jobs/{first['id']}/audio", headers=key("a"), timeout=30).status_code == 409
        submit(url, body("Two."), key("a"))
        error = refused(body("Three."), 429, key("a"))
        assert (
            error["message"].startswith("too many jobs: you have 2, at most 2") and error["type"] == "rate_limit_error"
        )
        error = refused(body("Three."), 429, key("b"))  # another key from the same address
        assert error["message"].startswith("too many jobs from your address")
        r = httpx.delete(f"{url}/v1/audio/jobs/{first['id']}", headers=key("a"), timeout=30)
        assert r.json() == {"id": first["id"], "object": "audio.job.deleted", "deleted": True}
        assert not (tmp_path / first["id"]).exists()
        submit(url, body("Three."), key("b"))  # room again


def test_one_key_never_sees_anothers_job(gateway_jobs):
    job = submit(gateway_jobs, body("Mine alone."), key("alice"))
    wait(gateway_jobs, job["id"], key("alice"))
    path = f"{gateway_jobs}/v1/audio/jobs/{job['id']}"
    for headers in (key("mallory"), {}):  # another key, and no key (this address's own jobs)
        for method, suffix in (("GET", ""), ("GET", "/audio"), ("GET", "/events"), ("POST", "/cancel"),
                               ("DELETE", "")):  # fmt: skip
            r = httpx.request(method, path + suffix, headers=headers, timeout=30)
            assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error", (method, suffix, r.text)
        listed = httpx.get(f"{gateway_jobs}/v1/audio/jobs", headers=headers, timeout=30).json()["data"]
        assert job["id"] not in [j["id"] for j in listed]
    assert [j["id"] for j in httpx.get(f"{gateway_jobs}/v1/audio/jobs", headers=key("alice")).json()["data"]] == [
        job["id"]
    ]
    assert audio(gateway_jobs, job["id"], key("alice"))[:4] == b"RIFF"


def test_the_clis_text_file_is_each_part_alone_joined_with_the_stated_silence(gateway_jobs, server, tmp_path):
    """The client's own run of a long text over Triton (no job): its WAV is the speech route's audio of each
    part, alone, in order, with the silence between them, sample for sample."""
    (tmp_path / "chapter.txt").write_text(f"{SENTENCES[0]}\n\n{SENTENCES[1]}\n")
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in SHORT.items() if k != "chunk_fixed"] + ["--chunk-fixed"]
    done = cli(server, "--text-file", str(tmp_path / "chapter.txt"), "--part-chars", "40", "--seed", "7", *flags,
               "--out", str(tmp_path / "chapter.wav"))  # fmt: skip
    assert done.returncode == 0, done.stderr.decode()
    assert "part 2/2:" in done.stderr.decode()
    got = (tmp_path / "chapter.wav").read_bytes()[44:]
    want = [speech(gateway_jobs, body(s, "pcm")) for s in SENTENCES[:2]]
    assert got == want[0] + bytes(2 * GAP) + want[1]
    refused = cli(server, "--text-file", "-", "--part-chars", "10", "--out", str(tmp_path / "x.wav"), stdin="z" * 11)
    assert refused.returncode == 2 and "11 characters without a space" in refused.stderr.decode()


def test_the_reaper_deletes_an_ended_job_and_its_files_after_the_age_bound(server, tmp_path):
    jobs = JobOptions(tmp_path, max_age_seconds=1.0)
    with in_thread(f"127.0.0.1:{server.ports.grpc}", jobs=jobs) as url:
        job = wait(url, submit(url, body("Short lived."))["id"])
        assert job["status"] == "done" and (tmp_path / job["id"] / "audio.wav").exists()
        gone = wait(url, job["id"], until=lambda j: "error" in j and j["error"] and "no job" in str(j["error"]))
        assert gone["error"]["type"] == "not_found_error"
        assert not (tmp_path / job["id"]).exists()
