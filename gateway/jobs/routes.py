"""The job API for long text (docs/longform.md): ``POST /v1/audio/jobs`` (the speech route's fields, an
``input`` of up to ``--job-max-chars``), ``GET /v1/audio/jobs``, ``GET /v1/audio/jobs/{id}``,
``GET /v1/audio/jobs/{id}/events`` (SSE: the job's object at each change, until it ends),
``POST /v1/audio/jobs/{id}/cancel``, ``GET /v1/audio/jobs/{id}/audio`` and ``DELETE /v1/audio/jobs/{id}``.

Who may see a job: the gateway checks no API keys, so a job belongs to the ``Authorization: Bearer`` key
that made it (any key: keep it secret, it is the job's only lock), or without a key to the client address.
Another owner's job is 404, as an id that never was: ids cannot be probed.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import secrets
import time

from fastapi import FastAPI, Request
from fastapi.responses import FileResponse, StreamingResponse

from client.longform import JOIN_SILENCE_SECONDS, split_text
from engine.params import shown
from gateway.body import read_capped
from gateway.dialects.whole_text import Core
from gateway.encode import FORMATS
from gateway.errors import APIError
from gateway.fields import check_string, parse_json, speech_request
from gateway.jobs.options import JobOptions
from gateway.jobs.runner import STORAGE_FULL, JobRunner
from gateway.jobs.store import DONE, ENDED, Job, JobStore
from gateway.shares import RATE_LIMIT_TYPE, host_of

EVENT_WAKE_SECONDS = 1.0  # an events stream wakes at each change of the store, and at least this often
KEEPALIVE_SECONDS = 15.0  # an SSE comment this often when nothing changes (proxies close idle streams)
NOT_FOUND = "no job {id} (jobs are seen only with the key, or from the address, that made them)"


def owner_of(request: Request) -> tuple[str, str]:
    """The request's owner (``key:<sha256 of its Bearer key>``, or ``addr:<address>`` without one) and address."""
    address = host_of(request.scope)
    scheme, _, key = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() == "bearer" and key.strip():
        return "key:" + hashlib.sha256(key.strip().encode()).hexdigest(), address
    return "addr:" + address, address


def job_object(job: Job, eta: float | None = None) -> dict:
    """A job as the API shows it."""
    return {
        "id": job.id, "object": "audio.job", "status": job.state, "created_at": int(job.created),
        "finished_at": None if job.finished is None else int(job.finished),
        "error": None if job.error is None else {"message": job.error},
        "parts_done": job.parts_done, "parts_total": job.parts_total, "audio_seconds": round(audio_seconds(job), 3),
        "eta_seconds": None if eta is None else round(eta, 1), "characters": job.chars,
        "response_format": job.response_format, "sample_rate": job.sample_rate, "bytes": job.bytes,
    }  # fmt: skip


def audio_seconds(job: Job) -> float:
    """The parts made, with the silences the file will have between them (once done: the file's length)."""
    return job.audio_seconds + max(job.parts_done - 1, 0) * JOIN_SILENCE_SECONDS


def add_job_routes(app: FastAPI, core: Core, runner: JobRunner, store: JobStore, options: JobOptions) -> None:
    """The routes above, over ``runner`` and ``store``; ``core``: the speech route's (fields, voices, body time)."""
    body_bytes = 6 * options.max_chars + 64 * 1024  # JSON escapes a character in up to 6 bytes ("\\u00e9")

    def mine(job_id: str, request: Request) -> Job:
        job = store.get(job_id, owner_of(request)[0])
        if job is None:
            raise APIError(404, NOT_FOUND.format(id=shown(job_id)), "id", kind="not_found_error")
        return job

    def shown_job(job: Job) -> dict:
        return job_object(job, runner.eta(job))

    @app.post("/v1/audio/jobs")
    async def submit(request: Request):
        owner, address = owner_of(request)
        too_big = (
            f"the request body is over {body_bytes} bytes (a job's input is at most {options.max_chars} characters)"
        )
        body = {k: v for k, v in parse_json(await read_capped(request, body_bytes, too_big, core.body_timeout)).items()
                if v is not None}  # fmt: skip
        if "stream_format" in body:
            raise APIError(400, "a job's audio is a file (GET .../audio): stream_format is /v1/audio/speech's",
                           "stream_format")  # fmt: skip
        text = check_string("input", body.get("input", ""))
        if not text.strip():
            raise APIError(400, "input must be a non-empty string", "input")
        if len(text) > options.max_chars:
            raise APIError(413, f"input is {len(text)} characters; a job takes at most {options.max_chars}", "input")
        check_room(store, options, owner, address)
        try:
            parts = split_text(text, options.part_chars)
        except ValueError as e:
            raise APIError(400, str(e), "input") from None
        kw = await speech_request({**body, "input": parts[0]}, core.voices)  # every field checked as speech's
        kw.pop("text")
        fmt = body.get("response_format", "mp3")
        job_id = "job_" + secrets.token_hex(12)
        store.add(job_id, owner, address, kw, fmt, body.get("sample_rate"), parts)
        runner.schedule()
        return shown_job(store.get(job_id))

    @app.get("/v1/audio/jobs")
    async def list_jobs(request: Request):
        return {"object": "list", "data": [shown_job(job) for job in store.of_owner(owner_of(request)[0])]}

    @app.get("/v1/audio/jobs/{job_id}")
    async def get_job(job_id: str, request: Request):
        return shown_job(mine(job_id, request))

    @app.get("/v1/audio/jobs/{job_id}/events")
    async def job_events(job_id: str, request: Request):
        mine(job_id, request)
        return StreamingResponse(events(job_id, store, shown_job), media_type="text/event-stream")

    @app.post("/v1/audio/jobs/{job_id}/cancel")
    async def cancel_job(job_id: str, request: Request):
        job = mine(job_id, request)
        if job.state in ENDED:
            raise APIError(409, f"job {job_id} has ended ({job.state}): nothing to cancel", "id")
        await runner.cancel(job_id)
        return shown_job(store.get(job_id))

    @app.get("/v1/audio/jobs/{job_id}/audio")
    async def job_audio(job_id: str, request: Request):
        job = mine(job_id, request)
        if job.state != DONE:
            raise APIError(409, f"job {job_id} is {job.state} ({job.parts_done} of {job.parts_total} parts made): "
                                "its audio is there once it is done", "id")  # fmt: skip
        media_type = FORMATS[job.response_format][0]
        return FileResponse(runner.audio_path(job), media_type=media_type,
                            filename=f"{job.id}.{job.response_format}")  # fmt: skip

    @app.delete("/v1/audio/jobs/{job_id}")
    async def delete_job(job_id: str, request: Request):
        mine(job_id, request)
        await runner.delete(job_id)
        return {"id": job_id, "object": "audio.job.deleted", "deleted": True}


def check_room(store: JobStore, options: JobOptions, owner: str, address: str) -> None:
    """429 naming the bound a new job would pass: jobs per owner, per address, in all, bytes on disk."""
    by_owner, by_address, total = store.count(owner, address)
    limited = {"kind": RATE_LIMIT_TYPE}
    if by_owner >= options.per_client:
        raise APIError(429, f"too many jobs: you have {by_owner}, at most {options.per_client} are kept per key "
                            "(or address); delete ended ones", **limited)  # fmt: skip
    if by_address >= options.per_client:
        raise APIError(429, f"too many jobs from your address: at most {options.per_client} are kept; delete "
                            "ended ones", **limited)  # fmt: skip
    if total >= options.total:
        raise APIError(429, f"too many jobs on this server: at most {options.total}; retry when old ones expire",
                       **limited)  # fmt: skip
    if store.total_bytes() >= options.max_bytes:
        raise APIError(429, STORAGE_FULL.format(mb=options.max_bytes / 2**20), **limited)


async def events(job_id: str, store: JobStore, shown_job):
    """SSE: ``data: <job object>`` now and at each change, until the job ends (or is deleted: an error event).
    It wakes at each write of the store (every part made is seen), and each second for the changing ETA."""
    last, quiet = None, 0.0
    while True:
        change = store.changed()  # taken before the read: a write after it still wakes us
        job = store.get(job_id)
        if job is None:
            yield f"data: {json.dumps({'error': {'message': NOT_FOUND.format(id=job_id)}})}\n\n"
            return
        shown = shown_job(job)
        now = {k: v for k, v in shown.items() if k != "eta_seconds"}
        if now != last:
            last, quiet = now, 0.0
            yield f"data: {json.dumps(shown)}\n\n"
        elif quiet >= KEEPALIVE_SECONDS:
            quiet = 0.0
            yield ": keep-alive\n\n"
        if job.state in ENDED:
            return
        started = time.monotonic()
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(EVENT_WAKE_SECONDS):
                await change.wait()
        quiet += time.monotonic() - started
