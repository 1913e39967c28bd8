"""A FAKE Hugging Face Hub for tests: a small real HTTP server on 127.0.0.1.

It implements only what huggingface_hub (2.x) calls for `HfApi.model_info(files_metadata=True)`,
`hf_hub_download` and `hf download`:

- ``GET /api/agent-harnesses`` (public) -> the registry huggingface_hub reads once a day

- ``GET /api/models/{org}/{name}/revision/{rev}?blobs=True`` -> ``{"id", "sha", "siblings": [
  {"rfilename", "size", "blobId", "lfs": {"size", "sha256", "pointerSize"}}]}``
- ``GET /api/models/{org}/{name}/tree/{rev}?recursive=true`` -> the files (``hf download`` lists them)
- ``HEAD|GET /{org}/{name}/resolve/{rev}/{path}`` with ``X-Repo-Commit`` and ``ETag`` (the git blob
  id). A small (non-LFS) file is answered there: ``Content-Length`` and its bytes. An LFS file is
  answered as the Hub does: ``302 Found`` to a signed URL on its CDN (another origin: a second server
  on another port), with ``X-Linked-Etag`` (the file's sha256) and ``X-Linked-Size`` on the redirect.
- the CDN: ``HEAD|GET /lfs/{sha256}?X-Amz-Expires=…&X-Amz-Signature=…`` serves the bytes; as a signed
  URL does, it refuses (400) a request that also carries an ``Authorization`` header, and (403) one
  whose signature is not the one the redirect gave.

Both answer ``Range: bytes=N-`` with 206 and ``Content-Range`` (416 past the end), as the Hub's CDN
does. ``cut_after`` drops the connection after that many bytes of a file, to test resuming.

Unknown repos and revisions answer 404 with the ``X-Error-Code`` the real Hub sends. With
``token`` set, Hub requests without ``Authorization: Bearer <token>`` get 401. Every request's
method, path, Authorization and Range headers, and which server it reached (``hub`` or ``cdn``), are
recorded in ``requests``.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import socket
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, cast
from urllib.parse import parse_qs, unquote, urlsplit


@dataclass
class FakeRepo:
    files: dict[str, bytes]
    lfs: set[str]
    commit: str
    refs: dict[str, str] = field(default_factory=dict)


@dataclass
class Seen:
    method: str
    path: str
    authorization: str | None
    range: str | None = None
    server: str = "hub"


class FakeHub:
    def __init__(self, token: str | None = None) -> None:
        self.token = token
        self.repos: dict[str, FakeRepo] = {}
        self.requests: list[Seen] = []
        #: cut the next file responses after this many bytes (a dropped connection), then answer whole
        self.cut_after: int | None = None
        self.cuts = 0
        self._blob_ids: dict[tuple[str, str], str] = {}
        self._server: ThreadingHTTPServer | None = None
        self._cdn: ThreadingHTTPServer | None = None
        self._threads: list[threading.Thread] = []
        self._key = hashlib.sha256(str(id(self)).encode()).digest()  # the CDN's signing key
        self._lfs: dict[str, bytes] = {}  # what the CDN serves, by sha256

    # -- content ---------------------------------------------------------------------

    def add_repo(
        self, repo: str, files: dict[str, bytes], *, lfs: set[str] | None = None, revision: str = "main"
    ) -> str:
        """Add (or replace) a repo; return its commit sha (derived from the content)."""
        h = hashlib.sha1(repo.encode())
        for k in sorted(files):
            h.update(k.encode() + b"\0" + hashlib.sha256(files[k]).digest())
        commit = h.hexdigest()
        old = self.repos.get(repo)
        refs = dict(old.refs) if old else {}
        refs[revision] = commit
        self.repos[repo] = FakeRepo(files=dict(files), lfs=set(lfs or ()), commit=commit, refs=refs)
        return commit

    def _find(self, repo: str, rev: str) -> FakeRepo | None:
        r = self.repos.get(repo)
        if r is None:
            return None
        if rev == r.commit or r.refs.get(rev) == r.commit:
            return r
        return None

    # -- server ----------------------------------------------------------------------

    @property
    def url(self) -> str:
        assert self._server is not None
        host, port = cast("tuple[str, int]", self._server.server_address[:2])  # an AF_INET server's address
        return f"http://{host}:{port}"

    @property
    def cdn_url(self) -> str:
        assert self._cdn is not None
        host, port = cast("tuple[str, int]", self._cdn.server_address[:2])  # an AF_INET server's address
        return f"http://{host}:{port}"

    def start(self) -> FakeHub:
        hub = self

        def handler(serve: Any) -> type[BaseHTTPRequestHandler]:
            class Handler(BaseHTTPRequestHandler):
                protocol_version = "HTTP/1.1"

                def log_message(self, format: str, *args: Any) -> None:  # quiet
                    pass

                def do_GET(self) -> None:
                    serve(self, head=False)

                def do_HEAD(self) -> None:
                    serve(self, head=True)

            return Handler

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), handler(hub._handle))
        self._cdn = ThreadingHTTPServer(("127.0.0.1", 0), handler(hub._handle_cdn))
        for srv in (self._server, self._cdn):
            srv.daemon_threads = True
            t = threading.Thread(target=srv.serve_forever, daemon=True)
            t.start()
            self._threads.append(t)
        return self

    def stop(self) -> None:
        for srv in (self._server, self._cdn):
            if srv is not None:
                srv.shutdown()
                srv.server_close()
        self._server = self._cdn = None

    def __enter__(self) -> FakeHub:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- handling --------------------------------------------------------------------

    def _send(
        self, h: BaseHTTPRequestHandler, code: int, body: bytes, headers: dict[str, str], head: bool
    ) -> None:
        h.send_response(code)
        for k, v in headers.items():
            h.send_header(k, v)
        h.send_header("Content-Length", str(len(body)))
        h.end_headers()
        if head:
            return
        octets = headers.get("Content-Type") == "application/octet-stream"
        if self.cut_after is not None and octets and len(body) > self.cut_after:
            self.cuts += 1
            h.wfile.write(body[: self.cut_after])
            h.wfile.flush()
            h.close_connection = True
            h.connection.shutdown(socket.SHUT_RDWR)
            return
        h.wfile.write(body)

    def _error(
        self, h: BaseHTTPRequestHandler, code: int, error_code: str | None, msg: str, head: bool
    ) -> None:
        headers = {"Content-Type": "application/json"}
        if error_code:
            headers["X-Error-Code"] = error_code
            headers["X-Error-Message"] = msg
        self._send(h, code, json.dumps({"error": msg}).encode(), headers, head)

    def _handle(self, h: BaseHTTPRequestHandler, *, head: bool) -> None:
        path = unquote(urlsplit(h.path).path)
        auth = h.headers.get("Authorization")
        self.requests.append(Seen(h.command, path, auth, h.headers.get("Range")))
        if path == "/api/agent-harnesses":  # public: the registry huggingface_hub reads for its user agent
            body = json.dumps({"standardEnvVars": ["AI_AGENT", "AGENT"], "harnesses": {}}).encode()
            self._send(h, 200, body, {"Content-Type": "application/json"}, head)
            return
        if self.token is not None and auth != f"Bearer {self.token}":
            self._error(h, 401, None, "Invalid credentials in Authorization header", head)
            return
        parts = path.strip("/").split("/")
        if len(parts) >= 6 and parts[0] == "api" and parts[1] == "models" and parts[4] == "revision":
            repo, rev = f"{parts[2]}/{parts[3]}", "/".join(parts[5:])
            self._model_info(h, repo, rev, head)
        elif len(parts) >= 6 and parts[0] == "api" and parts[1] == "models" and parts[4] == "tree":
            repo, rev = f"{parts[2]}/{parts[3]}", "/".join(parts[5:])
            self._tree(h, repo, rev, head)
        elif len(parts) >= 5 and parts[2] == "resolve":
            repo, rev, rel = f"{parts[0]}/{parts[1]}", parts[3], "/".join(parts[4:])
            self._resolve(h, repo, rev, rel, head)
        else:
            self._error(h, 404, None, "not found", head)

    def _revision(self, h: BaseHTTPRequestHandler, repo: str, rev: str, head: bool) -> FakeRepo | None:
        """The repo's revision, or None once the Hub's 404 for a missing repo or revision is sent."""
        if repo not in self.repos:
            self._error(h, 404, "RepoNotFound", "Repository not found", head)
            return None
        r = self._find(repo, rev)
        if r is None:
            self._error(h, 404, "RevisionNotFound", f"Invalid rev id: {rev}", head)
        return r

    def _model_info(self, h: BaseHTTPRequestHandler, repo: str, rev: str, head: bool) -> None:
        r = self._revision(h, repo, rev, head)
        if r is None:
            return
        siblings = []
        for name in sorted(r.files):
            data = r.files[name]
            sib: dict[str, Any] = {
                "rfilename": name,
                "size": len(data),
                "blobId": self._blob_id(r, name),
            }
            if name in r.lfs:
                sib["lfs"] = {
                    "size": len(data),
                    "sha256": hashlib.sha256(data).hexdigest(),
                    "pointerSize": 134,
                }
            siblings.append(sib)
        body = json.dumps(
            {"id": repo, "modelId": repo, "sha": r.commit, "private": False, "siblings": siblings}
        ).encode()
        self._send(h, 200, body, {"Content-Type": "application/json"}, head)

    def _tree(self, h: BaseHTTPRequestHandler, repo: str, rev: str, head: bool) -> None:
        """``GET /api/models/{repo}/tree/{rev}?recursive=true``: every file (what `hf download` lists)."""
        r = self._find(repo, rev) if repo in self.repos else None
        if r is None:
            self._error(h, 404, "RevisionNotFound", f"Invalid rev id: {rev}", head)
            return
        items: list[dict[str, Any]] = []
        for name in sorted(r.files):
            data = r.files[name]
            item: dict[str, Any] = {"type": "file", "path": name, "size": len(data), "oid": self._blob_id(r, name)}
            if name in r.lfs:
                item["lfs"] = {"oid": hashlib.sha256(data).hexdigest(), "size": len(data), "pointerSize": 134}
            items.append(item)
        self._send(h, 200, json.dumps(items).encode(), {"Content-Type": "application/json"}, head)

    def _blob_id(self, r: FakeRepo, rel: str) -> str:
        """git's blob id of a file, as the Hub's ETag (computed once: the files can be GiBs)."""
        key = (r.commit, rel)
        if key not in self._blob_ids:
            data = r.files[rel]
            h = hashlib.sha1(b"blob %d\0" % len(data))
            h.update(data)
            self._blob_ids[key] = h.hexdigest()
        return self._blob_ids[key]

    def _resolve(self, h: BaseHTTPRequestHandler, repo: str, rev: str, rel: str, head: bool) -> None:
        r = self._revision(h, repo, rev, head)
        if r is None:
            return
        if rel not in r.files:
            self._error(h, 404, "EntryNotFound", f"Entry not found: {rel}", head)
            return
        data = r.files[rel]
        blob = self._blob_id(r, rel)
        headers = {"X-Repo-Commit": r.commit, "ETag": f'"{blob}"'}
        if rel in r.lfs:  # the Hub's answer for an LFS file: its metadata, and a signed URL on the CDN
            sha = hashlib.sha256(data).hexdigest()
            self._lfs[sha] = data
            signed = f"{self.cdn_url}/lfs/{sha}?X-Amz-Expires=3600&X-Amz-Signature={self._sign(sha)}"
            headers.update({"X-Linked-Etag": f'"{sha}"', "X-Linked-Size": str(len(data)), "Location": signed,
                            "Content-Type": "text/plain; charset=utf-8"})
            self._send(h, 302, b"Found. Redirecting", headers, head)
            return
        self._ranged(h, data, headers, head)

    def _sign(self, sha: str) -> str:
        return hmac.new(self._key, sha.encode(), hashlib.sha256).hexdigest()

    def _ranged(self, h: BaseHTTPRequestHandler, data: bytes, headers: dict[str, str], head: bool) -> None:
        """The bytes of a file, or of its tail from ``Range: bytes=N-`` (206; 416 past the end)."""
        headers = {**headers, "Content-Type": "application/octet-stream", "Accept-Ranges": "bytes"}
        rng = h.headers.get("Range", "")
        if rng.startswith("bytes=") and rng.endswith("-") and rng[6:-1].isdigit():
            start = int(rng[6:-1])
            if start >= len(data):
                self._send(h, 416, b"", {"Content-Range": f"bytes */{len(data)}"}, head)
                return
            headers["Content-Range"] = f"bytes {start}-{len(data) - 1}/{len(data)}"
            self._send(h, 206, data[start:], headers, head)
            return
        self._send(h, 200, data, headers, head)

    def _handle_cdn(self, h: BaseHTTPRequestHandler, *, head: bool) -> None:
        """The CDN behind the Hub's redirects: a signed URL is the credential, and the only one."""
        url = urlsplit(h.path)
        auth = h.headers.get("Authorization")
        self.requests.append(Seen(h.command, url.path, auth, h.headers.get("Range"), server="cdn"))
        parts = url.path.strip("/").split("/")
        sig = (parse_qs(url.query).get("X-Amz-Signature") or [""])[0]
        if auth is not None:
            self._error(h, 400, None, "Only one auth mechanism allowed", head)
        elif len(parts) != 2 or parts[0] != "lfs" or parts[1] not in self._lfs:
            self._error(h, 404, None, "NoSuchKey", head)
        elif not hmac.compare_digest(sig, self._sign(parts[1])):
            self._error(h, 403, None, "SignatureDoesNotMatch", head)
        else:
            self._ranged(h, self._lfs[parts[1]], {"ETag": f'"{parts[1]}"'}, head)
