"""Which live generator streams Triton still hands the generator (no Triton, no torch).

Triton may stop handing the generator a live stream's request: when another START takes its correlation
id, or when the request's memory is freed under it (a tts cleanup cut short did that, dropping the
streams batched with it too; tts now holds the request to the end). Every live stream is rescheduled
into the very next batch, so one missing from a few batches in a row is gone: its slot is freed.
"""

from __future__ import annotations

MISSED_EXECUTES, MISSED_SECONDS = 3, 0.5
ORPHAN_SECONDS = 10.0  # also without executes in between (checked by a thread)
PAUSE_SECONDS = 3.0  # a 1 s reaper tick this late means the whole machine stopped (a VM pause)


class Attendance:
    """Which live streams the executes still have (see MISSED_EXECUTES)."""

    def __init__(self):
        self.seen: dict[int, float] = {}  # when an execute last had the stream's request
        self.missed: dict[int, int] = {}  # executes in a row without it

    def orphans(self, live: list[int], present: list[int] | None, now: float) -> list[int]:
        """After an execute with ``present`` (None: a check between executes) -> the live streams gone."""
        gone, live_set = [], set(live)
        for i in live:
            if present is not None and i in present:
                self.seen[i], self.missed[i] = now, 0
                continue
            self.seen.setdefault(i, now)
            self.missed[i] = self.missed.get(i, 0) + (present is not None)
            absent = now - self.seen[i]
            if (self.missed[i] >= MISSED_EXECUTES and absent >= MISSED_SECONDS) or absent >= ORPHAN_SECONDS:
                gone.append(i)
        for i in [i for i in self.seen if i not in live_set or i in gone]:
            del self.seen[i], self.missed[i]
        return gone

    def restart(self, now: float) -> None:
        """After a pause of the whole machine: count absence from now on."""
        self.seen = dict.fromkeys(self.seen, now)
