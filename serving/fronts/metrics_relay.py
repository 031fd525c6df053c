"""The metrics port in front of Triton's own (on a private loopback port): the same page, with the generator's
run-secret name shown as ``generator``, and the launcher's own counters. Open to anyone, so bounded
(docs/operations.md, "What each port accepts"; docs/security.md)."""

from __future__ import annotations

import socket
import threading
import time
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from serving.security.auth import GENERATOR


class Counters:
    """The launcher's own counters, added to the relayed page (e.g. how often it restarted the gateway)."""

    def __init__(self):
        self.lock, self.values, self.help = threading.Lock(), {}, {}

    def add(self, name: str, help_text: str) -> None:
        with self.lock:
            self.values.setdefault(name, 0)
            self.help[name] = help_text

    def increment(self, name: str) -> None:
        with self.lock:
            self.values[name] = self.values.get(name, 0) + 1
            self.help.setdefault(name, name)

    def text(self) -> str:
        with self.lock:
            return "".join(f"# HELP {n} {self.help[n]}\n# TYPE {n} counter\n{n} {v}\n" for n, v in self.values.items())


LAUNCHER = Counters()  # one launcher per process
MAX_CONNECTIONS = 16  # open at once (Prometheus scrapes one at a time)
CONNECTION_SECONDS = 10.0  # a connection is cut this long after it was accepted


class MetricsRelay(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, host: str, port: int, source: str, generator_model: str,
                 max_connections: int = MAX_CONNECTIONS, connection_seconds: float = CONNECTION_SECONDS):  # fmt: skip
        """Serve ``host:port``; ``source``: Triton's metrics page URL."""
        self.source, self.hidden = source, f'model="{generator_model}"'
        self.max_connections, self.connection_seconds = max_connections, connection_seconds
        self.lock = threading.Lock()
        self.open: dict[socket.socket, float] = {}  # connection -> when it is cut (time.monotonic)
        self._stopped = threading.Event()
        super().__init__((host, port), _Handler)
        self.thread = threading.Thread(target=self.serve_forever, name="metrics-relay", daemon=True)
        self.thread.start()
        self.reaper = threading.Thread(target=self._reap, name="metrics-relay-reaper", daemon=True)
        self.reaper.start()

    def verify_request(self, request, client_address) -> bool:
        """Take a connection only while fewer than ``max_connections`` are open (else socketserver closes it)."""
        with self.lock:
            if len(self.open) >= self.max_connections:
                return False
            self.open[request] = time.monotonic() + self.connection_seconds
            return True

    def shutdown_request(self, request) -> None:
        with self.lock:
            self.open.pop(request, None)
        super().shutdown_request(request)

    def _reap(self) -> None:
        """Cut every connection past its time (a handler blocked reading or writing it then ends)."""
        while not self._stopped.wait(0.5):
            now = time.monotonic()
            with self.lock:
                late = [conn for conn, until in self.open.items() if until <= now]
            for conn in late:
                try:
                    conn.shutdown(socket.SHUT_RDWR)
                except OSError:  # already gone
                    pass

    def page(self) -> bytes:
        with urllib.request.urlopen(self.source, timeout=5) as r:
            page = r.read().replace(self.hidden.encode(), f'model="{GENERATOR}"'.encode())
        return page + LAUNCHER.text().encode()

    def close(self) -> None:
        self._stopped.set()
        self.shutdown()
        self.server_close()


class _Handler(BaseHTTPRequestHandler):
    timeout = 10  # a client that sends nothing for this long is dropped

    def do_GET(self):
        try:
            body, status = self.server.page(), 200
        except OSError as e:  # tritonserver is starting, restarting or gone
            body, status = f"metrics unavailable: {e}\n".encode(), 503
        self.send_response(status)
        self.send_header("Content-Type", "text/plain; version=0.0.4; charset=utf-8")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args) -> None:  # scrapes are not news
        pass
