"""Slot bookkeeping for the generator: which KV-cache row a stream owns. No torch here.

A :class:`Handle` carries the slot's epoch at allocation; a stale handle (its slot freed and reused
since) can neither read nor free the new owner's slot. Free slots are a FIFO so that a just-freed row
is the last to be reused.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass


@dataclass(frozen=True)
class Handle:
    slot: int
    epoch: int
    owner: int | str  # correlation id of the stream


class StaleHandle(LookupError):
    pass


class SlotTable:
    def __init__(self, slots: int):
        if slots < 1:
            raise ValueError("need at least one slot")
        self.size = slots
        self._free: deque[int] = deque(range(slots))
        self._epoch = [0] * slots
        self._owner: dict[int | str, Handle] = {}

    def __len__(self) -> int:
        """Slots in use."""
        return len(self._owner)

    def __contains__(self, owner) -> bool:
        return owner in self._owner

    def allocate(self, owner: int | str) -> Handle:
        if owner in self._owner:
            raise ValueError(f"{owner!r} already owns slot {self._owner[owner].slot}")
        if not self._free:
            raise RuntimeError(f"all {self.size} slots are in use")
        slot = self._free.popleft()
        self._epoch[slot] += 1
        h = Handle(slot, self._epoch[slot], owner)
        self._owner[owner] = h
        return h

    def get(self, owner) -> Handle | None:
        return self._owner.get(owner)

    def check(self, h: Handle) -> None:
        if self._epoch[h.slot] != h.epoch or self._owner.get(h.owner) != h:
            raise StaleHandle(f"stale handle for slot {h.slot} (epoch {h.epoch}, now {self._epoch[h.slot]})")

    def release(self, h: Handle) -> None:
        self.check(h)
        del self._owner[h.owner]
        self._epoch[h.slot] += 1  # invalidate every copy of the handle at once
        self._free.append(h.slot)
