"""gateway.jobs.store: jobs and parts in SQLite, scoped by owner, kept across a reopen of the file."""

from __future__ import annotations

import time

from gateway.jobs.store import CANCELLED, DONE, QUEUED, RUNNING, JobStore


def test_a_job_and_its_parts_outlive_the_connection_and_only_its_owner_sees_it(tmp_path):
    store = JobStore(tmp_path / "jobs" / "jobs.sqlite3")
    store.add("job_a", "key:1", "10.0.0.1", {"seed": 7, "voice_id": "v"}, "wav", None, ["One.", "Two two."])
    store.part_made("job_a", 1, 480, 1920)
    store.close()
    store = JobStore(tmp_path / "jobs" / "jobs.sqlite3")
    job = store.get("job_a", "key:1")
    assert (job.state, job.request, job.parts_total, job.parts_done, job.chars, job.chars_done) == (
        QUEUED, {"seed": 7, "voice_id": "v"}, 2, 1, 12, 8)  # fmt: skip
    assert (job.samples, job.bytes, job.audio_seconds) == (480, 1920, 0.02)
    assert store.parts("job_a") == [(0, "One.", None), (1, "Two two.", 480)]
    assert store.get("job_a", "key:2") is None and store.of_owner("key:2") == []
    assert store.get("job_b") is None


def test_counts_by_owner_address_and_in_all_and_bytes(tmp_path):
    store = JobStore(tmp_path / "jobs.sqlite3")
    store.add("j1", "key:1", "a", {}, "mp3", None, ["x"])
    store.add("j2", "addr:a", "a", {}, "mp3", None, ["x"])
    store.add("j3", "key:2", "b", {}, "mp3", None, ["x"])
    store.set_bytes("j3", 100)
    assert store.count("key:1", "a") == (1, 2, 3)
    assert store.total_bytes() == 100
    assert [j.id for j in store.of_owner("key:1")] == ["j1"]


def test_an_ended_job_keeps_its_state_and_is_found_by_age_and_deleted_with_its_parts(tmp_path):
    store = JobStore(tmp_path / "jobs.sqlite3")
    store.add("j1", "o", "a", {}, "mp3", None, ["x", "y"])
    store.set_state("j1", RUNNING)
    assert store.get("j1").finished is None and [j.id for j in store.in_state(RUNNING)] == ["j1"]
    store.set_state("j1", CANCELLED)
    store.set_state("j1", DONE)  # too late: it was cancelled
    job = store.get("j1")
    assert job.state == CANCELLED and job.finished is not None
    assert store.ended_before(time.time() + 1) == ["j1"] and store.ended_before(job.finished - 1) == []
    store.delete("j1")
    assert store.get("j1") is None and store.parts("j1") == []


def test_each_write_sets_the_event_taken_before_it_and_no_later_one(tmp_path):
    """An events stream takes ``changed()`` before it reads: the next write wakes it (no part made is missed
    between two polls), and a read alone wakes nobody."""
    store = JobStore(tmp_path / "jobs.sqlite3")
    before_add = store.changed()
    store.add("j1", "o", "a", {}, "wav", None, ["x", "y"])
    assert before_add.is_set()
    before_part = store.changed()
    assert not before_part.is_set()
    store.get("j1"), store.parts("j1"), store.count("o", "a")
    assert not before_part.is_set()
    store.part_made("j1", 0, 10, 40)
    assert before_part.is_set() and not store.changed().is_set()
