"""The job API's bounds and defaults (``python -m gateway --jobs-*`` options), written once here."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

from client.longform import DEFAULT_PART_CHARS
from engine.config import cache_dir
from serving.contract import MAX_TEXT_CHARS


def default_jobs_dir() -> Path:
    """Beside the voice store, not in a run folder: the launcher makes a new run folder at each start, and a
    finished job must outlive a restart."""
    return cache_dir() / "jobs"


@dataclass(frozen=True)
class JobOptions:
    folder: Path | None = None  # the SQLite file and the jobs' audio (None: default_jobs_dir())
    max_chars: int = 100_000  # characters of a job's input (a long chapter); beyond, 413
    part_chars: int = DEFAULT_PART_CHARS  # characters of a part (one Triton request), at most MAX_TEXT_CHARS
    parts_at_once: int = 2  # parts of one job in flight at once (each one Triton stream of its address's share)
    running: int = 2  # jobs running at once, all clients together; the others wait, queued
    per_client: int = 8  # jobs kept (any state) per owner, and per client address; beyond, 429
    total: int = 512  # jobs kept, all clients together; beyond, 429
    max_bytes: int = 2 * 2**30  # bytes of the jobs' files on disk, all jobs together; beyond, refused / failed
    max_age_seconds: float = 24 * 3600.0  # an ended job and its files are deleted this long after it ended

    def __post_init__(self) -> None:
        for name in ("max_chars", "part_chars", "parts_at_once", "running", "per_client", "total", "max_bytes",
                     "max_age_seconds"):  # fmt: skip
            if not getattr(self, name) > 0:
                raise ValueError(f"jobs: {name} must be > 0, got {getattr(self, name)}")
        if self.part_chars > MAX_TEXT_CHARS:
            raise ValueError(f"jobs: part_chars is at most {MAX_TEXT_CHARS} (a speech request's bound), "
                             f"got {self.part_chars}")  # fmt: skip

    @property
    def path(self) -> Path:
        return self.folder or default_jobs_dir()


def add_arguments(ap: argparse.ArgumentParser) -> None:
    d = JobOptions()
    ap.add_argument("--jobs-dir", type=Path, help=f"where jobs (jobs.sqlite3) and their audio are kept (default: "
                    f"{default_jobs_dir()})")  # fmt: skip
    ap.add_argument("--job-max-chars", type=int, default=d.max_chars, help="characters of a job's input; beyond, 413")
    ap.add_argument("--job-part-chars", type=int, default=d.part_chars,
                    help=f"characters of a job's part, one Triton request (at most {MAX_TEXT_CHARS})")  # fmt: skip
    ap.add_argument("--job-parts-at-once", type=int, default=d.parts_at_once,
                    help="parts of one job in flight at once; each is a stream of its client's --streams-per-peer")  # fmt: skip
    ap.add_argument("--jobs-running", type=int, default=d.running, help="jobs running at once; the others wait")
    ap.add_argument("--jobs-per-client", type=int, default=d.per_client,
                    help="jobs kept per key (or address) and per address; beyond, 429")  # fmt: skip
    ap.add_argument("--jobs-total", type=int, default=d.total, help="jobs kept in all; beyond, 429")
    ap.add_argument("--jobs-max-mb", type=float, default=d.max_bytes / 2**20,
                    help="MB of job audio on disk in all; beyond, new jobs are refused and running ones fail")  # fmt: skip
    ap.add_argument("--job-max-age-hours", type=float, default=d.max_age_seconds / 3600,
                    help="hours an ended job is kept; then it and its audio are deleted")  # fmt: skip


def from_arguments(args: argparse.Namespace) -> JobOptions:
    return JobOptions(args.jobs_dir, args.job_max_chars, args.job_part_chars, args.job_parts_at_once,
                      args.jobs_running, args.jobs_per_client, args.jobs_total, int(args.jobs_max_mb * 2**20),
                      args.job_max_age_hours * 3600)  # fmt: skip
