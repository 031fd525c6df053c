"""The backbone's KV-cache pages as bookkeeping over ints: which pages each slot holds and has been promised.

No torch: the tensors live in :class:`~engine.kv_cache.PagedCache`. :class:`~engine.scheduler.Scheduler`
owns this object: it decides with it who may start (a stream first *reserves* every page it may ever
need, so a live stream never runs out mid-utterance), takes the pages each step's keys need (its plan
carries them to the cache's page table) and gives a stream's pages back when it ends.

Pages are numbered 1..num_pages; page 0 is the cache's zero page, never handed out (it backs padding).
"""

from __future__ import annotations

from collections import deque

PAGE_SIZE = 16  # positions per page


def pages_for(positions: int, page_size: int = PAGE_SIZE) -> int:
    """Pages that hold ``positions`` positions."""
    return -(-positions // page_size)


def pool_pages(slots: int, max_len: int, num_pages: int | None = None, page_size: int = PAGE_SIZE) -> int:
    """The pool's size in pages: ``num_pages``, or by default ``slots`` streams of ``max_len`` positions."""
    if slots < 1 or max_len < 1 or page_size < 1:
        raise ValueError("slots, max_len and page_size must be positive")
    if num_pages is None:
        num_pages = slots * pages_for(max_len, page_size)
    if num_pages < 1:
        raise ValueError(f"the KV cache pool needs at least one page, got {num_pages}")
    return num_pages


class BlockManager:
    """Page reservations and page lists of ``slots`` page-table rows over a pool of ``num_pages`` pages.

    ``max_len`` is the longest stream in positions (a page-table row holds ``pages_for(max_len)`` pages);
    the default pool (``num_pages`` None) holds ``slots`` streams of ``max_len``.
    """

    def __init__(self, slots: int, max_len: int, num_pages: int | None = None, page_size: int = PAGE_SIZE):
        self.num_pages = pool_pages(slots, max_len, num_pages, page_size)
        self.slots, self.max_len, self.page_size = slots, max_len, page_size
        self.pages_per_stream = pages_for(max_len, page_size)
        self.pages: list[list[int]] = [[] for _ in range(slots)]  # pages each slot holds, in position order
        self.reserved = [0] * slots  # pages promised to each slot (held or not yet)
        self.free_pages: deque[int] = deque(range(1, self.num_pages + 1))  # FIFO: a freed page is reused last

    @property
    def committed(self) -> int:
        """Pages promised to streams (reserved, whether taken yet or not)."""
        return sum(self.reserved)

    @property
    def pages_available(self) -> int:
        """Pages not promised to any stream."""
        return self.num_pages - self.committed

    @property
    def pages_in_use(self) -> int:
        return self.num_pages - len(self.free_pages)

    def check_fits(self, positions: int) -> None:
        """ValueError when a stream of ``positions`` could never be served by this pool."""
        if positions > self.max_len:
            raise ValueError(f"{positions} positions exceed the cache length {self.max_len}")
        need = pages_for(positions, self.page_size)
        if need > self.num_pages:
            raise ValueError(
                f"a stream of {positions} positions needs {need} KV-cache pages of {self.page_size} positions; "
                f"the whole pool has {self.num_pages} (give the server more KV-cache memory, or shorten the text, "
                "the reference audio or max_patches)"
            )

    def reserve(self, slot: int, positions: int) -> bool:
        """Promise ``slot`` the pages for ``positions``; False (nothing changed) when they are not free now."""
        self._check_slot(slot)
        self.check_fits(positions)
        if self.reserved[slot]:
            raise RuntimeError(f"slot {slot} already holds a reservation")
        need = pages_for(positions, self.page_size)
        if need > self.pages_available:
            return False
        self.reserved[slot] = need
        return True

    def grow(self, slot: int, positions: int) -> list[tuple[int, int]]:
        """Take the pages ``slot`` needs to hold ``positions`` -> the new (row index, page) pairs."""
        self._check_slot(slot)
        need = pages_for(positions, self.page_size)
        if need > self.reserved[slot]:
            raise RuntimeError(
                f"slot {slot}: {positions} positions exceed its reservation of {self.reserved[slot]} pages"
            )
        owned, new = self.pages[slot], []
        while len(owned) < need:
            page = self.free_pages.popleft()  # cannot be empty: reservations never exceed the pool
            new.append((len(owned), page))
            owned.append(page)
        return new

    def release(self, slot: int) -> None:
        """Return the slot's pages and reservation (its stream ended, was cancelled or failed)."""
        self._check_slot(slot)
        self.free_pages.extend(self.pages[slot])
        self.pages[slot] = []
        self.reserved[slot] = 0

    def _check_slot(self, slot: int) -> None:
        if not 0 <= slot < self.slots:
            raise IndexError(f"slot {slot} out of range 0..{self.slots - 1}")
