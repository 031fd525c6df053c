"""Runs the jobs: at most ``running`` jobs at once (the next is the oldest queued job of an owner with the
fewest running), each with at most ``parts_at_once`` parts in flight. Each part is one Triton stream opened
as the speech route opens one (``AsyncTTSClient.stream`` with the job's keywords) and held against the
job's client address's share (:mod:`gateway.shares`): a part waits while the address's share is full, so a
job never takes the places of its client's short requests beyond ``parts_at_once``.

A part's audio is kept on disk (``<id>/part-NNNNN.f32``, float32 at 24 kHz) as soon as it is made; once
every part is, they are encoded in order into ``<id>/audio.<format>`` (:data:`client.longform.JOIN_SILENCE_SECONDS`
between two parts) and the part files deleted. A gateway that stops mid-job leaves the job ``running``;
:meth:`JobRunner.start` queues it again and it goes on from its first part not on disk.
"""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import time
from pathlib import Path

import numpy as np

from client.aio import AsyncTTSClient
from client.longform import silence
from client.request import TTSError
from engine.protocol import UNAVAILABLE
from gateway.encode import Encoder, wav_header
from gateway.errors import log
from gateway.jobs.options import JobOptions
from gateway.jobs.store import CANCELLED, DONE, FAILED, QUEUED, RUNNING, Job, JobStore
from gateway.shares import StreamShares

SHARE_WAIT_SECONDS = 0.2  # between two asks for a share of a full address
RETRIES = 8  # times a part is tried again after the server was busy or unreachable
RETRY_FIRST_SECONDS, RETRY_MOST_SECONDS = 0.5, 8.0
REAP_EVERY_SECONDS = 60.0
STORAGE_FULL = "the jobs' storage is full ({mb:.0f} MB on disk): delete ended jobs or retry when old ones expire"


class JobFailed(Exception):
    """A part could not be made; the message says which and why."""


class JobRunner:
    """The jobs of ``store`` in ``options.path``, spoken through ``tts`` within ``shares``. On the event loop."""

    def __init__(self, store: JobStore, tts: AsyncTTSClient, shares: StreamShares, options: JobOptions):
        self.store, self.tts, self.shares, self.options = store, tts, shares, options
        self.folder = options.path
        self.tasks: dict[str, asyncio.Task] = {}  # running jobs
        self.owners: dict[str, str] = {}  # running job -> its owner
        self.clock: dict[str, tuple[float, int]] = {}  # running job -> (monotonic start, chars done then)
        self.reaper: asyncio.Task | None = None

    def start(self) -> None:
        """Jobs left running by a gateway that stopped are queued again (their parts on disk kept); the queue
        starts, and the reaper."""
        for job in self.store.in_state(RUNNING):
            for index, _, samples in self.store.parts(job.id):
                if samples is not None and not self.part_path(job.id, index).exists():
                    self.store.part_lost(job.id, index)
            self.store.requeue(job.id)
            log.info("job %s: resumed after a restart, from its first part not on disk", job.id)
        self.reaper = asyncio.create_task(self._reap())
        self.schedule()

    async def stop(self) -> None:
        """Running jobs stop where they are (still ``running`` in the store: the next start resumes them)."""
        tasks = [*self.tasks.values(), *([self.reaper] if self.reaper else [])]
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task

    def schedule(self) -> None:
        """Start queued jobs while fewer than ``running`` run: first the owners with the fewest running."""
        queued = [job for job in self.store.in_state(QUEUED) if job.id not in self.tasks]
        while queued and len(self.tasks) < self.options.running:
            running = list(self.owners.values())
            job = min(queued, key=lambda j: (running.count(j.owner), j.created))
            queued.remove(job)
            self.store.set_state(job.id, RUNNING)
            self.owners[job.id] = job.owner
            self.tasks[job.id] = asyncio.create_task(self._run(job), name=f"job {job.id}")

    def eta(self, job: Job) -> float | None:
        """Seconds left, from this run's pace in characters (None until a part is made in this run)."""
        if job.id not in self.clock:
            return None
        t0, chars0 = self.clock[job.id]
        made = job.chars_done - chars0
        return (job.chars - job.chars_done) * (time.monotonic() - t0) / made if made > 0 else None

    async def cancel(self, job_id: str) -> None:
        """Ends a job now (its streams are closed, its share given back); the store says cancelled."""
        self.store.set_state(job_id, CANCELLED)
        task = self.tasks.get(job_id)
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            self.schedule()

    async def delete(self, job_id: str) -> None:
        await self.cancel(job_id)
        self.store.delete(job_id)
        await asyncio.to_thread(shutil.rmtree, self.folder / job_id, True)

    def part_path(self, job_id: str, index: int) -> Path:
        return self.folder / job_id / f"part-{index:05d}.f32"

    def audio_path(self, job: Job) -> Path:
        return self.folder / job.id / f"audio.{job.response_format}"

    async def _run(self, job: Job) -> None:
        try:
            (self.folder / job.id).mkdir(parents=True, exist_ok=True)
            self.clock[job.id] = (time.monotonic(), self.store.get(job.id).chars_done)
            todo = asyncio.Queue()
            for index, text, samples in self.store.parts(job.id):
                if samples is None:
                    todo.put_nowait((index, text))
            async with asyncio.TaskGroup() as group:  # a failed part cancels the others
                for _ in range(min(self.options.parts_at_once, todo.qsize())):
                    group.create_task(self._worker(job, todo))
            nbytes = await asyncio.to_thread(self._encode, job)
            self.store.set_bytes(job.id, nbytes)
            self.store.set_state(job.id, DONE)
        except* JobFailed as group:
            reason = str(group.exceptions[0])
            log.warning("job %s failed: %s", job.id, reason)
            self.store.set_state(job.id, FAILED, reason)
        except* Exception as group:  # a file that cannot be written, a format that cannot be encoded
            log.error("job %s failed", job.id, exc_info=group.exceptions[0])
            self.store.set_state(job.id, FAILED, f"error: {type(group.exceptions[0]).__name__}: {group.exceptions[0]}")
        finally:
            self.tasks.pop(job.id, None), self.owners.pop(job.id, None), self.clock.pop(job.id, None)
            if not asyncio.current_task().cancelling():  # a cancel schedules after it; a stop starts nothing
                self.schedule()

    async def _worker(self, job: Job, todo: asyncio.Queue) -> None:
        while not todo.empty():
            check_cancelled()
            index, text = todo.get_nowait()
            if self.store.total_bytes() >= self.options.max_bytes:
                raise JobFailed(STORAGE_FULL.format(mb=self.options.max_bytes / 2**20))
            audio = await self._speak(job, index, text)
            path = self.part_path(job.id, index)
            await asyncio.to_thread(audio.tofile, path)
            self.store.part_made(job.id, index, audio.size, audio.nbytes)

    async def _speak(self, job: Job, index: int, text: str) -> np.ndarray:
        """Part ``index``'s audio, (n,) float32 at 24 kHz; a busy or unreachable server is retried (the same
        request: the same audio), any other error fails the job."""
        wait = RETRY_FIRST_SECONDS
        for attempt in range(RETRIES + 1):
            share = await self._share(job.address)
            try:
                chunks = []
                async with contextlib.aclosing(self.tts.stream(text, **job.request)) as stream:  # closed at a cancel
                    async for chunk in stream:
                        chunks.append(chunk.audio)
                        check_cancelled()
                return np.concatenate(chunks).astype(np.float32) if chunks else np.zeros(0, np.float32)
            except (TTSError, ConnectionError, TimeoutError) as e:
                busy = not isinstance(e, TTSError) or e.kind == UNAVAILABLE
                if not busy or attempt == RETRIES:
                    raise JobFailed(f"part {index + 1}: {e}") from None
            finally:
                share.give_back()
            await asyncio.sleep(wait)
            wait = min(2 * wait, RETRY_MOST_SECONDS)
        raise AssertionError("unreachable")

    async def _share(self, address: str):
        """A stream of ``address``'s share, waited for while it is full."""
        while (share := self.shares.try_take(address)) is None:
            await asyncio.sleep(SHARE_WAIT_SECONDS)
        return share

    def _encode(self, job: Job) -> int:
        """The parts in order, joined, encoded into the job's audio file -> its size; the part files are
        deleted. (In a thread: a long job's encoding takes seconds.)"""
        encoder = Encoder(job.response_format, job.sample_rate)
        path = self.audio_path(job)
        parts = self.store.parts(job.id)
        with path.open("wb") as out:
            for index, _, _ in parts:
                if index:
                    out.write(encoder.push(silence()))
                out.write(encoder.push(np.fromfile(self.part_path(job.id, index), np.float32)))
            out.write(encoder.finish())
        if job.response_format == "wav":
            fix_wav_sizes(path, encoder.rate)
        for index, _, _ in parts:
            self.part_path(job.id, index).unlink(missing_ok=True)
        return path.stat().st_size

    async def _reap(self) -> None:
        """Deletes jobs (and their files) that ended over ``max_age_seconds`` ago, every minute or so."""
        while True:
            for job_id in self.store.ended_before(time.time() - self.options.max_age_seconds):
                log.info("job %s: deleted, ended over %g s ago", job_id, self.options.max_age_seconds)
                await self.delete(job_id)
            await asyncio.sleep(min(REAP_EVERY_SECONDS, self.options.max_age_seconds / 4))


def check_cancelled() -> None:
    """Raises CancelledError if this task was asked to stop: Python 3.11's ``asyncio.wait_for`` (under
    ``AsyncTTSClient.stream``) drops a cancel that meets a chunk, and the job went on speaking after its cancel."""
    if asyncio.current_task().cancelling():
        raise asyncio.CancelledError


def fix_wav_sizes(path: Path, rate: int) -> None:
    """A whole file's WAV header says its sizes (the streaming encoder's says "unknown"), when they fit."""
    size = path.stat().st_size
    header = len(wav_header(rate))
    if size - 8 < 2**32:
        with path.open("r+b") as f:
            f.seek(4)
            f.write((size - 8).to_bytes(4, "little"))
            f.seek(header - 4)
            f.write((size - header).to_bytes(4, "little"))
