"""What the fronts and the metrics relay share: each runs on an asyncio event loop of its own thread in the
launcher's process, and checks its streams every REAP_SECONDS."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Coroutine
from typing import Self

REAP_SECONDS = 0.5  # how often a front checks its streams against the unsent bounds
START_SECONDS = 30.0  # a front's start (binding its port) takes at most this long


class FrontLoop:
    """A front on an event loop of its own thread. A subclass writes ``_start()`` (bind its port; OSError if
    it cannot) and ``_reap(now)`` (its check of every stream; ``now``: monotonic seconds); ``start()`` and
    ``_close(stop)`` run them, and its ``stop`` coroutine, on the loop from any thread."""

    def __init__(self, name: str):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
        self.reaper: asyncio.Future | None = None  # the check, once the front has started

    def start(self) -> Self:
        """Run ``_start()`` on the front's loop and return the front once it has (its error raised here)."""
        self.thread.start()
        asyncio.run_coroutine_threadsafe(self._begin(), self.loop).result(START_SECONDS)
        return self

    async def _begin(self) -> None:
        await self._start()
        self.reaper = asyncio.ensure_future(self._reaping())

    async def _reaping(self) -> None:
        while True:
            await asyncio.sleep(REAP_SECONDS)
            self._reap(time.monotonic())

    def _close(self, stop: Coroutine, timeout: float) -> None:
        """Cancel the reaper and run ``stop`` (within ``timeout`` s), then end the loop and its thread."""

        async def stopping() -> None:
            if self.reaper is not None:
                self.reaper.cancel()
            await stop

        if not self.thread.is_alive():
            stop.close()  # never started, or closed already
            return
        asyncio.run_coroutine_threadsafe(stopping(), self.loop).result(timeout)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)
