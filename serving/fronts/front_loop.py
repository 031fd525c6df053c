"""What the fronts and the metrics relay share: each runs on an asyncio event loop of its own thread in the
launcher's process, and checks its streams every REAP_SECONDS."""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Self

REAP_SECONDS = 0.5  # how often a front checks its streams against the unsent bounds
START_SECONDS = 30.0  # a front's start (binding its port) takes at most this long


class FrontLoop:
    """A server on ``host:port`` on an event loop of its own thread. ``start()`` runs ``_start()`` (by default
    an asyncio stream server whose connections go to ``_accept``; OSError if it cannot bind), then
    ``_reap(now)`` every REAP_SECONDS (``now``: monotonic seconds); ``close()`` runs ``_stop(grace)``."""

    def __init__(self, name: str, host: str, port: int):
        self.host, self.port = host, port
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
        self.reaper: asyncio.Future | None = None  # the check, once the front has started

    def start(self) -> Self:
        """Run ``_start()`` on the front's loop and return the front once it has (its error raised here)."""
        self.thread.start()
        asyncio.run_coroutine_threadsafe(self._begin(), self.loop).result(START_SECONDS)
        return self

    async def _start(self) -> None:
        self.server = await asyncio.start_server(self._accept, self.host, self.port, reuse_address=True)

    async def _begin(self) -> None:
        await self._start()
        self.reaper = asyncio.ensure_future(self._reaping())

    async def _reaping(self) -> None:
        while True:
            await asyncio.sleep(REAP_SECONDS)
            self._reap(time.monotonic())

    def _reap(self, now: float) -> None:
        pass

    async def _stop(self, grace: float) -> None:
        self.server.close()

    def close(self, grace: float = 1.0) -> None:
        """Cancel the reaper and run ``_stop(grace)`` (within ``grace`` + 10 s), then end the loop and its
        thread; calls in progress get ``grace`` seconds to end."""

        async def stopping() -> None:
            if self.reaper is not None:
                self.reaper.cancel()
            await self._stop(grace)

        if not self.thread.is_alive():
            return  # never started, or closed already
        asyncio.run_coroutine_threadsafe(stopping(), self.loop).result(grace + 10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)
