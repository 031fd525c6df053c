"""The metrics relay is open to anyone who reaches its port: its connections are bounded in number and in
time (issue 30: 72 slow connections stayed open 100 s and the launcher's threads went from 2 to 70)."""

from __future__ import annotations

import socket
import threading
import time
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from serving.fronts.metrics_relay import MetricsRelay


class Page(BaseHTTPRequestHandler):
    def do_GET(self):
        body = b'nv_inference_count{model="generator-secret"} 1\n'
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


def handlers() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if "process_request_thread" in t.name]


def test_idle_connections_are_bounded_in_number_and_time():
    source = ThreadingHTTPServer(("127.0.0.1", 0), Page)
    threading.Thread(target=source.serve_forever, daemon=True).start()
    relay = MetricsRelay("127.0.0.1", 0, f"http://127.0.0.1:{source.server_address[1]}/metrics",
                         "generator-secret", max_connections=4, connection_seconds=1.0)  # fmt: skip
    port = relay.server.sockets[0].getsockname()[1]
    try:
        idle = [socket.create_connection(("127.0.0.1", port)) for _ in range(10)]  # send nothing
        for s in idle:
            s.settimeout(30)
        # every one is closed without an answer: 6 at once (past the 4 taken), the 4 once their second is over
        assert [s.recv(100) for s in idle] == [b""] * 10
        # no thread per connection left behind (the server's handler threads, named after their target)
        deadline = time.monotonic() + 5
        while handlers() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not handlers()
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as r:
            page = r.read().decode()
        assert 'model="generator"' in page and "secret" not in page  # it still relays, name hidden
        for s in idle:
            s.close()
    finally:
        relay.close()
        source.shutdown()


def test_a_front_that_cannot_bind_leaves_no_loop_thread():
    from serving.fronts.metrics_relay import FrontLoop

    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    try:

        class Front(FrontLoop):
            async def _accept(self, reader, writer):
                writer.close()

        front = Front("front-that-cannot-bind", "127.0.0.1", taken.getsockname()[1])
        try:
            front.start()
        except OSError:
            pass
        else:
            front.close()
            raise AssertionError("bound a port that is taken")
        assert not front.thread.is_alive() and not front.loop.is_running()
    finally:
        taken.close()
