"""A TCP relay whose connections to its target come from another loopback address (127.0.0.2, ...): a second
client machine for a server that counts its clients by address, on one host (Linux answers all of 127/8)."""

from __future__ import annotations

import socket
import threading


class SourceRelay:
    """Listens on a free loopback port (``address``); each connection is piped to ``target`` from ``source``."""

    def __init__(self, target: tuple[str, int], source: str = "127.0.0.2"):
        self.target, self.source = target, source
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self.listener.getsockname()[1]}"
        self.sockets: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:  # closed
                return
            server = socket.create_connection(self.target, source_address=(self.source, 0))
            self.sockets += [client, server]
            for a, b in ((client, server), (server, client)):
                threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    @staticmethod
    def _pipe(src: socket.socket, dst: socket.socket) -> None:
        while True:
            try:
                data = src.recv(65536)
                if not data:
                    break
                dst.sendall(data)
            except OSError:
                break
        for s in (src, dst):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def close(self) -> None:
        self.listener.close()
        for s in self.sockets:
            s.close()
