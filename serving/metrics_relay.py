"""The metrics port, as Prometheus and dashboards see it, in front of Triton's own (which listens on a
private loopback port): the same page, with the generator's run-secret model name shown as ``generator``.

The generator's name is a secret of the run (:meth:`serving.auth.Keys.generator_model`): a client that
can address Triton's sequence batcher can take its slots, and Triton offers no way to keep a model from
clients but not knowing its name. Triton's metrics page would name it; this relay does not.
"""

from __future__ import annotations

import threading
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from serving.auth import GENERATOR


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


class MetricsRelay(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, host: str, port: int, source: str, generator_model: str):
        """Serve ``host:port``; ``source``: Triton's metrics page URL."""
        self.source, self.hidden = source, f'model="{generator_model}"'
        super().__init__((host, port), _Handler)
        self.thread = threading.Thread(target=self.serve_forever, name="metrics-relay", daemon=True)
        self.thread.start()

    def page(self) -> bytes:
        with urllib.request.urlopen(self.source, timeout=5) as r:
            page = r.read().replace(self.hidden.encode(), f'model="{GENERATOR}"'.encode())
        return page + LAUNCHER.text().encode()

    def close(self) -> None:
        self.shutdown()
        self.server_close()


class _Handler(BaseHTTPRequestHandler):
    timeout = 10  # a client that sends nothing for this long is dropped

    def do_GET(self):  # noqa: N802 (http.server's name)
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
