"""The jobs' state in SQLite (stdlib ``sqlite3``, one file in the jobs folder): each job's request, owner,
state and parts, each part's text and, once made, its length in samples. Every query a route makes is
scoped by owner: a job of another owner is absent, not forbidden. Used from the event loop's thread only
(each call is one short statement)."""

from __future__ import annotations

import asyncio
import json
import sqlite3
import time
from dataclasses import dataclass
from pathlib import Path

from engine.protocol import SAMPLE_RATE

QUEUED, RUNNING, DONE, FAILED, CANCELLED = "queued", "running", "done", "failed", "cancelled"
ENDED = (DONE, FAILED, CANCELLED)  # a job in one of these states never changes again

SCHEMA = """
CREATE TABLE IF NOT EXISTS jobs (
    id TEXT PRIMARY KEY,
    owner TEXT NOT NULL,            -- who may see it: 'key:<sha256 of the key>' or 'addr:<client address>'
    address TEXT NOT NULL,          -- the client address that made it (its streams count against that share)
    created REAL NOT NULL,          -- Unix time
    finished REAL,                  -- Unix time it ended (done, failed, cancelled); NULL while it runs
    state TEXT NOT NULL,
    error TEXT,                     -- why it failed
    request TEXT NOT NULL,          -- JSON: AsyncTTSClient.stream's keywords but the text
    response_format TEXT NOT NULL,
    sample_rate INTEGER,            -- of the raw formats; NULL: the format's default
    chars INTEGER NOT NULL,         -- characters of its parts (the input but the whitespace between parts)
    bytes INTEGER NOT NULL DEFAULT 0  -- its files on disk now
);
CREATE INDEX IF NOT EXISTS jobs_owner ON jobs (owner);
CREATE INDEX IF NOT EXISTS jobs_address ON jobs (address);
CREATE TABLE IF NOT EXISTS parts (
    job TEXT NOT NULL REFERENCES jobs (id) ON DELETE CASCADE,
    idx INTEGER NOT NULL,           -- 0-based, in the text's order
    text TEXT NOT NULL,
    samples INTEGER,                -- its audio at 24 kHz once made (kept on disk); NULL until then
    PRIMARY KEY (job, idx)
);
"""


@dataclass(frozen=True)
class Job:
    """A job as the store has it, with its parts' tally."""

    id: str
    owner: str
    address: str
    created: float  # Unix time
    finished: float | None  # Unix time it ended; None while queued or running
    state: str  # QUEUED, RUNNING, DONE, FAILED or CANCELLED
    error: str | None  # why it failed (or was ended at a restart)
    request: dict  # AsyncTTSClient.stream's keywords but the text
    response_format: str
    sample_rate: int | None
    chars: int  # characters of its parts (the input but the whitespace between parts)
    bytes: int  # its files on disk now
    parts_total: int
    parts_done: int
    chars_done: int  # characters of the parts made
    samples: int  # audio made, at 24 kHz (parts made)

    @property
    def audio_seconds(self) -> float:
        return self.samples / SAMPLE_RATE


SELECT = """
SELECT j.id, j.owner, j.address, j.created, j.finished, j.state, j.error, j.request, j.response_format,
       j.sample_rate, j.chars, j.bytes, COUNT(p.idx), COUNT(p.samples),
       COALESCE(SUM(CASE WHEN p.samples IS NOT NULL THEN LENGTH(p.text) END), 0), COALESCE(SUM(p.samples), 0)
FROM jobs j LEFT JOIN parts p ON p.job = j.id
"""


class JobStore:
    """``path``: the SQLite file (made with its folder if absent)."""

    def __init__(self, path: Path):
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)  # users' texts and audio
        # autocommit (`with self.db` for a transaction); made where the app is made, used on its event loop's
        # thread only (one thread at a time: no lock)
        self.db = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
        self.db.execute("PRAGMA journal_mode=WAL")
        self.db.execute("PRAGMA foreign_keys=ON")
        self.db.executescript(SCHEMA)
        self._change = asyncio.Event()  # set (and replaced) at each write: events streams wake on it

    def changed(self) -> asyncio.Event:
        """The event the next write sets: take it *before* reading, so a write between the read and the
        wait still wakes the waiter."""
        return self._change

    def _wrote(self) -> None:
        self._change.set()
        self._change = asyncio.Event()

    def close(self) -> None:
        self.db.close()

    def add(self, job_id: str, owner: str, address: str, request: dict, response_format: str,
            sample_rate: int | None, parts: list[str]) -> None:  # fmt: skip
        """A new job, QUEUED, with its parts' texts."""
        with self.db:
            self.db.execute("BEGIN")
            self.db.execute(
                "INSERT INTO jobs (id, owner, address, created, state, request, response_format, sample_rate, chars)"
                " VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (job_id, owner, address, time.time(), QUEUED, json.dumps(request), response_format, sample_rate,
                 sum(map(len, parts))),
            )  # fmt: skip
            self.db.executemany("INSERT INTO parts (job, idx, text) VALUES (?, ?, ?)",
                                [(job_id, i, text) for i, text in enumerate(parts)])  # fmt: skip
        self._wrote()

    def get(self, job_id: str, owner: str | None = None) -> Job | None:
        """The job ``job_id``, or None (also when ``owner`` is given and is not its owner)."""
        where, args = ("j.id = ?", (job_id,)) if owner is None else ("j.id = ? AND j.owner = ?", (job_id, owner))
        rows = self._jobs(where, args)
        return rows[0] if rows else None

    def of_owner(self, owner: str) -> list[Job]:
        """``owner``'s jobs, newest first."""
        return self._jobs("j.owner = ?", (owner,), order="j.created DESC")

    def in_state(self, *states: str) -> list[Job]:
        """Every job in one of ``states``, oldest first."""
        return self._jobs(f"j.state IN ({','.join('?' * len(states))})", states, order="j.created")

    def _jobs(self, where: str, args, order: str = "j.created") -> list[Job]:
        rows = self.db.execute(f"{SELECT} WHERE {where} GROUP BY j.id ORDER BY {order}", args).fetchall()
        return [Job(*row[:7], json.loads(row[7]), *row[8:]) for row in rows]

    def count(self, owner: str, address: str) -> tuple[int, int, int]:
        """Jobs kept of ``owner``, made from ``address``, and in all."""
        one = "SELECT COUNT(*) FROM jobs WHERE "
        return (self.db.execute(one + "owner = ?", (owner,)).fetchone()[0],
                self.db.execute(one + "address = ?", (address,)).fetchone()[0],
                self.db.execute("SELECT COUNT(*) FROM jobs").fetchone()[0])  # fmt: skip

    def total_bytes(self) -> int:
        return self.db.execute("SELECT COALESCE(SUM(bytes), 0) FROM jobs").fetchone()[0]

    def parts(self, job_id: str) -> list[tuple[int, str, int | None]]:
        """``(index, text, samples or None)`` of each part, in order."""
        return self.db.execute("SELECT idx, text, samples FROM parts WHERE job = ? ORDER BY idx", (job_id,)).fetchall()

    def part_made(self, job_id: str, index: int, samples: int, nbytes: int) -> None:
        """Part ``index`` is on disk: ``samples`` long, ``nbytes`` more bytes of the job's."""
        with self.db:
            self.db.execute("BEGIN")
            self.db.execute("UPDATE parts SET samples = ? WHERE job = ? AND idx = ?", (samples, job_id, index))
            self.db.execute("UPDATE jobs SET bytes = bytes + ? WHERE id = ?", (nbytes, job_id))
        self._wrote()

    def part_lost(self, job_id: str, index: int) -> None:
        """Part ``index``'s file is gone: it is made again."""
        self.db.execute("UPDATE parts SET samples = NULL WHERE job = ? AND idx = ?", (job_id, index))
        self._wrote()

    def set_bytes(self, job_id: str, nbytes: int) -> None:
        self.db.execute("UPDATE jobs SET bytes = ? WHERE id = ?", (nbytes, job_id))
        self._wrote()

    def set_state(self, job_id: str, state: str, error: str | None = None) -> None:
        """``state`` (an ended one stamps ``finished``); a job that has ended keeps its state."""
        finished = time.time() if state in ENDED else None
        self.db.execute(
            f"UPDATE jobs SET state = ?, error = ?, finished = ? WHERE id = ? AND state NOT IN ({','.join('?' * 3)})",
            (state, error, finished, job_id, *ENDED),
        )
        self._wrote()

    def requeue(self, job_id: str) -> None:
        """A job left running by a gateway that stopped is queued again (its made parts kept)."""
        self.db.execute("UPDATE jobs SET state = ? WHERE id = ? AND state = ?", (QUEUED, job_id, RUNNING))
        self._wrote()

    def ended_before(self, when: float) -> list[str]:
        """Ids of the jobs that ended before Unix time ``when``."""
        rows = self.db.execute("SELECT id FROM jobs WHERE finished IS NOT NULL AND finished < ?", (when,))
        return [row[0] for row in rows]

    def delete(self, job_id: str) -> None:
        self.db.execute("DELETE FROM jobs WHERE id = ?", (job_id,))  # its parts go with it (ON DELETE CASCADE)
        self._wrote()
