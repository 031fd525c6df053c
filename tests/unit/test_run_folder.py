"""The stubs' heartbeat instruments (serving.supervision.run_folder): the longest interval between beats, kept in the
heartbeat file, and the stacks dumped when a beat is late (faulthandler, re-armed at every beat)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from serving.supervision.run_folder import Beats, LateStacks, longest_beat

ROOT = Path(__file__).resolve().parents[2]


def test_the_heartbeat_file_holds_the_longest_interval_between_beats(tmp_path):
    path, now = tmp_path / "tts.1", [100.0]
    path.touch()
    beats = Beats(path, clock=lambda: now[0])
    assert longest_beat(path) is None  # no interval yet
    for step in (0.0, 1.0, 2.5, 1.0):
        now[0] += step
        beats.beat()
    seconds, at = longest_beat(path)
    assert seconds == 2.5 and at.count(":") == 2  # and when (HH:MM:SS)
    assert longest_beat(tmp_path / "gone") is None


# In a process of its own: faulthandler has one timer per process, which pytest may use too. Nothing
# re-arms after the first arm(), as when the heartbeat thread cannot run: the dump must name the thread
# that is busy (here sleeping in ``holder``), then the next beat notes the dump, and the cap ends dumping.
LATE = """
import sys, threading, time
from pathlib import Path
from serving.supervision.run_folder import LateStacks

path = Path(sys.argv[1])

def holder():
    time.sleep(60)

threading.Thread(target=holder, name="holder", daemon=True).start()
late = LateStacks(path, late=0.05, cap=1)
late.arm()
deadline = time.monotonic() + 30
while path.stat().st_size == 0 and time.monotonic() < deadline:
    time.sleep(0.05)
late.arm()  # the next beat: notes the dump, then stops (the file is over its cap)
print("disarmed" if late.file is None else "armed")
"""


def test_a_late_beat_dumps_every_threads_stack_once_then_the_cap_stops_it(tmp_path):
    path = tmp_path / "stacks" / "tts.1.txt"
    out = subprocess.run([sys.executable, "-c", LATE, str(path)], cwd=ROOT, capture_output=True, text=True,
                         timeout=60)  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "disarmed"
    text = path.read_text()
    assert text.count("Timeout (0:00:00.05") == 1
    assert "in holder" in text  # the busy thread's stack is there
    assert "^ dumped: a heartbeat 0.05 s late" in text


def test_without_a_writable_folder_there_are_no_dumps(tmp_path):
    (tmp_path / "stacks").write_text("a file, not a folder")
    late = LateStacks(tmp_path / "stacks" / "tts.1.txt")
    late.arm()  # nothing armed, nothing raised
    assert late.file is None
