"""What the launcher's own ports share: :class:`FrontLoop` and the launcher's counters; and the metrics port in
front of Triton's own (on a private loopback port): the same page, with the generator's run-secret name shown
as ``generator``, and those counters. Open to anyone, so bounded (docs/operations.md, "What each port
accepts"; docs/security.md)."""

from __future__ import annotations

import asyncio
import threading
import time
import urllib.request
from typing import Self

from serving.security.auth import GENERATOR

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
        self.reaper = None  # the check (a concurrent Future), once the front has started

    def start(self) -> Self:
        """Run ``_start()`` on the front's loop and return the front once it has (its error raised here)."""
        self.thread.start()
        try:
            asyncio.run_coroutine_threadsafe(self._start(), self.loop).result(START_SECONDS)
        except BaseException:  # (cannot bind): its loop and thread end with it
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(5)
            raise
        self.reaper = asyncio.run_coroutine_threadsafe(self._reaping(), self.loop)
        return self

    async def _start(self) -> None:
        self.server = await asyncio.start_server(self._accept, self.host, self.port, reuse_address=True)

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
        if not self.thread.is_alive():
            return  # never started, or closed already
        if self.reaper is not None:
            self.reaper.cancel()  # (its task is cancelled on the loop, before _stop runs there)
        asyncio.run_coroutine_threadsafe(self._stop(grace), self.loop).result(grace + 10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)


class Counters:
    """The launcher's own counters, added to the relayed page (e.g. how often it restarted the gateway)."""

    def __init__(self):
        self.lock, self.values, self.help = threading.Lock(), {}, {}

    def add(self, name: str, help_text: str) -> str:
        with self.lock:
            self.values.setdefault(name, 0)
            self.help[name] = help_text
        return name

    def increment(self, name: str) -> None:
        with self.lock:
            self.values[name] = self.values.get(name, 0) + 1
            self.help.setdefault(name, name)

    def text(self) -> str:
        with self.lock:
            return "".join(f"# HELP {n} {self.help[n]}\n# TYPE {n} counter\n{n} {v}\n" for n, v in self.values.items())


LAUNCHER = Counters()  # one launcher per process
MAX_CONNECTIONS = 16  # open at once (Prometheus scrapes one at a time)
CONNECTION_SECONDS = 10.0  # a connection is closed this long after it was accepted


class MetricsRelay(FrontLoop):
    """The relay on ``host:port`` of Triton's metrics page at ``source``, serving from construction (OSError if
    it cannot bind): at most ``max_connections`` at once (beyond, closed unanswered), each closed
    ``connection_seconds`` after it was accepted, one request each."""

    def __init__(self, host: str, port: int, source: str, generator_model: str,
                 max_connections: int = MAX_CONNECTIONS, connection_seconds: float = CONNECTION_SECONDS):  # fmt: skip
        super().__init__("metrics-relay", host, port)
        self.source, self.hidden = source, f'model="{generator_model}"'
        self.max_connections, self.connection_seconds, self.open = max_connections, connection_seconds, 0
        self.start()

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self.open >= self.max_connections:
            writer.close()
            return
        self.open += 1
        try:
            async with asyncio.timeout(self.connection_seconds):
                await self._answer(reader, writer)
        except (asyncio.TimeoutError, asyncio.IncompleteReadError, ValueError, OSError):
            pass  # too slow, gone, or not HTTP: closed unanswered
        finally:
            self.open -= 1
            if writer.transport.get_write_buffer_size():  # a client that does not read: cut
                writer.transport.abort()
            writer.close()

    async def _answer(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")  # ValueError past 64 KiB
        if not head.startswith(b"GET "):
            status, body = "501 Not Implemented", b"only GET\n"
        else:
            try:
                status, body = "200 OK", await asyncio.to_thread(self.page)
            except OSError as e:  # tritonserver is starting, restarting or gone
                status, body = "503 Service Unavailable", f"metrics unavailable: {e}\n".encode()
        writer.write(f"HTTP/1.1 {status}\r\nContent-Type: text/plain; version=0.0.4; charset=utf-8\r\n"
                     f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode() + body)  # fmt: skip
        await writer.drain()

    def page(self) -> bytes:
        with urllib.request.urlopen(self.source, timeout=5) as r:
            page = r.read().replace(self.hidden.encode(), f'model="{GENERATOR}"'.encode())
        return page + LAUNCHER.text().encode()
