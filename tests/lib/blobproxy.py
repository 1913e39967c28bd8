"""A faulty link in front of a real registry: a small HTTP proxy (a fake link, not a fake registry) that
passes every request on to the registry and its answer back, except that, as told, it cuts a blob's
body after N bytes (the connection closed midway, as a dropped link does) or flips one byte of it (a
registry serving wrong bytes). Every request it saw is kept (method, path, Range header, status, body
bytes sent), so a test can tell what a client asked for.

    with BlobProxy(registry_url, ip="127.0.0.1") as proxy:
        proxy.cut_after = 1000   # the next blob GET ends after 1000 bytes of its body
        ... client pointed at proxy.url ...
"""

from __future__ import annotations

import http.client
import http.server
import socket
import ssl
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit


@dataclass
class Seen:
    method: str
    path: str
    range: str | None
    status: int = 0
    sent: int = 0


@dataclass
class BlobProxy:
    upstream: str  # the registry's URL (http:// or https://)
    ip: str = "127.0.0.1"
    ca: Path | None = None  # the registry's CA, when upstream is https
    #: the next blob GET's body ends after this many bytes (then None: one cut)
    cut_after: int | None = None
    #: every blob GET's body has its byte at this offset flipped
    flip_at: int | None = None
    #: after its cut, the proxy goes away (connections refused): the link stays down
    down_after_cut: bool = False
    seen: list[Seen] = field(default_factory=list)
    _server: Any = None
    _thread: Any = None

    @property
    def url(self) -> str:
        return f"http://{self.ip}:{self._server.server_address[1]}"

    def __enter__(self) -> BlobProxy:
        proxy = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: Any) -> None:  # (quiet)
                pass

            def do_HEAD(self) -> None:
                proxy._pass(self, "HEAD")

            def do_GET(self) -> None:
                proxy._pass(self, "GET")

        self._server = http.server.ThreadingHTTPServer((self.ip, 0), Handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.shutdown()
        self._server.server_close()

    def blob_gets(self) -> list[Seen]:
        return [s for s in self.seen if s.method == "GET" and "/blobs/sha256:" in s.path]

    def _connection(self) -> http.client.HTTPConnection:
        parts = urlsplit(self.upstream)
        assert parts.hostname is not None
        if parts.scheme == "https":
            ctx = ssl.create_default_context(cafile=str(self.ca) if self.ca else None)
            return http.client.HTTPSConnection(parts.hostname, parts.port, context=ctx, timeout=30)
        return http.client.HTTPConnection(parts.hostname, parts.port, timeout=30)

    def _pass(self, h: http.server.BaseHTTPRequestHandler, method: str) -> None:
        seen = Seen(method, h.path, h.headers.get("Range"))
        self.seen.append(seen)
        headers = {k: v for k, v in h.headers.items() if k.lower() not in ("host", "connection")}
        conn = self._connection()
        conn.request(method, h.path, headers=headers)
        resp = conn.getresponse()
        body = resp.read() if method == "GET" else b""
        seen.status = resp.status
        blob = method == "GET" and "/blobs/sha256:" in h.path and resp.status in (200, 206)
        if blob and self.flip_at is not None and self.flip_at < len(body):
            body = body[:self.flip_at] + bytes([body[self.flip_at] ^ 0xFF]) + body[self.flip_at + 1:]
        cut = self.cut_after if blob else None
        if cut is not None:
            self.cut_after = None
        h.send_response(resp.status)
        for k, v in resp.getheaders():
            if k.lower() not in ("connection", "transfer-encoding", "content-length"):
                h.send_header(k, v)
        h.send_header("Content-Length", str(int(resp.getheader("Content-Length") or len(body))
                                             if method == "HEAD" else len(body)))
        h.end_headers()
        out = body if cut is None else body[:cut]
        h.wfile.write(out)
        h.wfile.flush()
        seen.sent = len(out)
        conn.close()
        if cut is not None:
            h.close_connection = True
            h.connection.shutdown(socket.SHUT_RDWR)
            if self.down_after_cut:
                self._server.socket.close()  # (new connections refused; serve_forever ends at its shutdown)
