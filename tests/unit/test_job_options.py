"""The job API's options on python -m gateway's command line (and so in the launcher's --gateway-args)."""

from __future__ import annotations

from pathlib import Path

import pytest

from gateway.__main__ import check, parser
from gateway.jobs.options import JobOptions, default_jobs_dir, from_arguments


def test_the_options_reach_the_job_options_and_bad_ones_are_refused_by_name():
    args = parser().parse_args(["--jobs-dir", "/tmp/j", "--job-part-chars", "300", "--jobs-max-mb", "1.5",
                                "--job-max-age-hours", "0.5", "--jobs-running", "3"])  # fmt: skip
    options = from_arguments(args)
    assert (options.path, options.part_chars, options.max_bytes, options.max_age_seconds, options.running) == (
        Path("/tmp/j"), 300, int(1.5 * 2**20), 1800.0, 3)  # fmt: skip
    assert check(["--job-part-chars", "300"]) is None
    assert (
        check(["--job-part-chars", "5000"]) == "jobs: part_chars is at most 4000 (a speech request's bound), got 5000"
    )
    assert check(["--jobs-running", "0"]) == "jobs: running must be > 0, got 0"


def test_the_default_folder_outlives_a_run_folder():
    assert JobOptions().path == default_jobs_dir() and default_jobs_dir().name == "jobs"
    with pytest.raises(ValueError, match="parts_at_once must be > 0"):
        JobOptions(parts_at_once=0)
