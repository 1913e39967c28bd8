"""Blob uploads in chunks and registry credentials, against the REAL registry (Debian's docker-registry,
the CNCF distribution 2.8, on loopback; tests/lib/registrylib.py), through a small TCP proxy of this test
that drops the link the way a network does: refusing connections for a while, or cutting one midway
through a chunk. Credentials through the docker client's own config: a credential helper is a
``docker-credential-<name>`` program on PATH (the helper protocol: ``get`` reads the registry on
stdin and prints ``{"ServerURL", "Username", "Secret"}``), here a small script in a temp folder."""

from __future__ import annotations

import hashlib
import http.server
import io
import json
import os
import socket
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from builder.errors import BuilderError, ResolveError
from builder.foundation import distribution
from builder.image import registry
from tests.lib import registrylib

pytestmark = [pytest.mark.registry]

MiB = 1 << 20


@pytest.fixture(autouse=True)
def _needs_the_registry(monkeypatch: pytest.MonkeyPatch) -> None:
    if not registrylib.registry_available():
        pytest.skip("docker-registry is not installed")
    monkeypatch.setattr(distribution, "CHUNK", 4 * MiB)  # a 10 MiB blob: three chunks
    monkeypatch.setattr(distribution, "RETRY_WAIT", 0.05)


class Link:
    """A TCP proxy on 127.0.0.1 in front of the registry: every connection forwarded both ways, its
    request head recorded (urllib sends one request per connection). ``down(k)``: the next k
    connections are closed before a byte is forwarded (the link is down); ``cut_at(n, then_down=k)``:
    once n more bytes went from client to registry, the connection is cut there, midway through what it
    carried (and the next k connections are refused)."""

    def __init__(self, upstream: str) -> None:
        host, port = upstream.rsplit(":", 1)
        self.upstream = (host, int(port))
        self.heads: list[str] = []
        self.sent = 0  # bytes forwarded client -> registry
        self._down = 0
        self._cut: int | None = None
        self._then_down = 0
        self._lock = threading.Lock()
        self._srv = socket.create_server(("127.0.0.1", 0))
        self.addr = f"127.0.0.1:{self._srv.getsockname()[1]}"
        threading.Thread(target=self._serve, daemon=True).start()

    def down(self, k: int) -> None:
        self._down = k

    def cut_at(self, n: int, then_down: int = 0) -> None:
        self._cut = self.sent + n
        self._then_down = then_down

    def close(self) -> None:
        self._srv.close()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self._srv.accept()
            except OSError:
                return
            with self._lock:
                refuse = self._down > 0
                self._down -= 1 if refuse else 0
            if refuse:
                conn.close()
                continue
            threading.Thread(target=self._pipe, args=(conn,), daemon=True).start()

    def _pipe(self, conn: socket.socket) -> None:
        up = socket.create_connection(self.upstream)
        head = bytearray()

        def back() -> None:  # registry -> client
            try:
                while data := up.recv(65536):
                    conn.sendall(data)
            except OSError:
                pass
            finally:
                conn.close()

        threading.Thread(target=back, daemon=True).start()
        try:
            while data := conn.recv(65536):
                if len(head) < 4096:
                    head += data[: 4096 - len(head)]
                with self._lock:
                    left = None if self._cut is None else self._cut - self.sent
                    if left is not None and left < len(data):
                        self._cut, self._down = None, self._then_down
                        self.sent += max(left, 0)
                        up.sendall(data[: max(left, 0)])
                        raise ConnectionAbortedError("cut")
                    self.sent += len(data)
                up.sendall(data)
        except OSError:
            pass
        finally:
            self.heads.append(head.split(b"\r\n\r\n", 1)[0].decode("latin-1"))
            for s in (conn, up):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
                s.close()

    def requests(self) -> list[str]:
        """``METHOD what Content-Range`` of each request seen, in order (``what``: ``uploads`` for an
        upload's URL, ``blob`` for a blob's, else the path)."""
        out = []
        for h in self.heads:
            lines = h.split("\r\n")
            method, path = (lines[0].split(" ") + ["", ""])[:2]
            what = "uploads" if "/blobs/uploads/" in path else "blob" if "/blobs/sha256:" in path else path
            rng = next((ln.split(":", 1)[1].strip() for ln in lines[1:] if ln.lower().startswith("content-range:")),
                       "")
            out.append(f"{method} {what} {rng}".strip())
        return out


@pytest.fixture
def reg(tmp_path: Path) -> Iterator[registrylib.Registry]:
    with registrylib.start_registry(tmp_path / "registry", auth=True) as r:
        yield r


@pytest.fixture
def link(reg: registrylib.Registry) -> Iterator[Link]:
    lk = Link(reg.addr)
    yield lk
    lk.close()


@pytest.fixture
def creds(reg: registrylib.Registry, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BUILDER_REGISTRY_USER", str(reg.username))
    monkeypatch.setenv("BUILDER_REGISTRY_PASSWORD", str(reg.password))


def blob(n: int = 10 * MiB) -> tuple[bytes, str]:
    data = os.urandom(MiB) * (n // MiB) + os.urandom(n % MiB)
    return data, "sha256:" + hashlib.sha256(data).hexdigest()


def send(addr: str, data: bytes, digest: str, told: list[int] | None = None) -> int:
    """Upload ``data``; the bytes the client says it put on the wire."""
    client = registry.client_for(registry.parse_target(f"http://{addr}", "test"), "builder/blob")
    return client.upload(digest, len(data), lambda: io.BytesIO(data), (told.append if told is not None else None))


def stored(reg: registrylib.Registry, digest: str) -> bytes:
    r = reg.request("GET", f"/v2/builder/blob/blobs/{digest}")
    assert r.status == 200, r.status
    return r.body


def test_a_blob_goes_in_chunks_with_content_range(reg: registrylib.Registry, link: Link, creds: None) -> None:
    data, digest = blob()
    told: list[int] = []
    send(link.addr, data, digest, told)
    assert stored(reg, digest) == data
    patches = [r for r in link.requests() if r.startswith("PATCH")]
    assert [p.split(" ")[-1] for p in patches] == ["0-4194303", "4194304-8388607", "8388608-10485759"]
    assert link.requests()[-1].startswith("PUT") and sum(told) == len(data)
    assert link.sent < len(data) + 64 * 1024  # every byte once (and the requests' heads)


def test_a_link_down_between_chunks_goes_on_from_the_byte_the_registry_holds(
        reg: registrylib.Registry, link: Link, creds: None) -> None:
    data, digest = blob()
    real_send = distribution.RegistryClient.send
    calls = [0]

    def send_counting(self: distribution.RegistryClient, *a: object, **kw: object) -> object:
        calls[0] += 1
        if calls[0] == 4:  # the third chunk (after the 401, POST and two PATCHes): the link goes down
            link.down(3)
        return real_send(self, *a, **kw)  # type: ignore[arg-type]

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(distribution.RegistryClient, "send", send_counting)
        send(link.addr, data, digest)
    assert stored(reg, digest) == data
    got = link.requests()
    # the upload's state asked (GET), then on from the byte it held: not one byte sent twice
    assert "GET uploads" in got, got
    assert [r.split(" ")[-1] for r in got if r.startswith("PATCH")] == ["0-4194303", "4194304-8388607",
                                                                         "8388608-10485759"]
    assert link.sent < len(data) + 64 * 1024


def test_a_chunk_cut_midway_is_sent_again_and_the_blob_lands_whole(
        reg: registrylib.Registry, link: Link, creds: None) -> None:
    """distribution keeps the bytes of a chunk cut midway, and then refuses the upload its last answer
    described (it holds more than that answer said: BLOB_UPLOAD_INVALID, the upload cancelled): the
    state asked, the refusal seen, the blob starts again in a new upload and lands whole."""
    data, digest = blob()
    link.cut_at(6 * MiB)  # midway through the second chunk
    told: list[int] = []
    wire = send(link.addr, data, digest, told)
    assert stored(reg, digest) == data
    # what went to the connection is reported: the first chunk twice, and the cut one's bytes, handed
    # to the connection (the socket's buffers took more than the link carried) and sent again
    assert len(data) + 6 * MiB <= wire <= len(data) + 8 * MiB, wire
    got = link.requests()
    asked = got.index("GET uploads")
    assert got[asked - 1] == "PATCH uploads 4194304-8388607", got  # the chunk cut midway
    assert "POST uploads" in got[asked:], got  # a new upload
    assert [r for r in got[asked:] if r.startswith("PATCH")] == [
        "PATCH uploads 0-4194303", "PATCH uploads 4194304-8388607", "PATCH uploads 8388608-10485759"]
    assert sum(told) == len(data)  # the progress came back to what the registry held, then on


class FakeSpecRegistry:
    """A FAKE registry (the blob upload part of the OCI distribution spec only): a PATCH keeps every
    byte it read, a cut one too, and GET on an upload answers 204 with ``Range: 0-<last>``, as the
    spec describes and distribution 2.8 does not (it cancels an upload a cut chunk left longer than its
    last answer said). It stands in for a registry that keeps what a cut chunk carried, which the
    one this suite runs is not; ``received``: the bytes of blobs it read."""

    def __init__(self) -> None:
        self.uploads: dict[str, bytearray] = {}
        self.blobs: dict[str, bytes] = {}
        self.received = 0
        fake = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *a: object) -> None:
                pass

            def answer(self, code: int, headers: dict[str, str] | None = None) -> None:
                self.send_response(code)
                for k, v in {"Content-Length": "0", **(headers or {})}.items():
                    self.send_header(k, v)
                self.end_headers()

            def state(self, uid: str) -> dict[str, str]:
                n = len(fake.uploads[uid])
                return {"Location": f"/v2/builder/blob/blobs/uploads/{uid}", "Range": f"0-{max(n - 1, 0)}"}

            def do_HEAD(self) -> None:
                self.answer(200 if self.path.rsplit("/", 1)[-1] in fake.blobs else 404)

            def do_POST(self) -> None:
                uid = f"u{len(fake.uploads)}"
                fake.uploads[uid] = bytearray()
                self.answer(202, self.state(uid))

            def do_GET(self) -> None:
                uid = self.path.split("?")[0].rsplit("/", 1)[-1]
                self.answer(204, self.state(uid)) if uid in fake.uploads else self.answer(404)

            def do_PATCH(self) -> None:
                uid = self.path.rsplit("/", 1)[-1]
                buf = fake.uploads[uid]
                if int(self.headers["Content-Range"].split("-")[0]) != len(buf):
                    self.answer(416, self.state(uid))
                    return
                left = int(self.headers["Content-Length"])
                while left:
                    block = self.rfile.read(min(65536, left))
                    if not block:  # the link was cut: what came is kept
                        return
                    buf += block
                    fake.received += len(block)
                    left -= len(block)
                self.answer(202, self.state(uid))

            def do_PUT(self) -> None:
                uid, _, query = self.path.rsplit("/", 1)[-1].partition("?")
                digest = query.removeprefix("digest=")
                data = bytes(fake.uploads.pop(uid))
                if "sha256:" + hashlib.sha256(data).hexdigest() != digest:
                    self.answer(400)
                    return
                fake.blobs[digest] = data
                self.answer(201, {"Location": f"/v2/builder/blob/blobs/{digest}"})

        self._srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.addr = f"127.0.0.1:{self._srv.server_address[1]}"
        threading.Thread(target=self._srv.serve_forever, daemon=True).start()

    def close(self) -> None:
        self._srv.shutdown()
        self._srv.server_close()


def test_a_chunk_cut_midway_goes_on_within_it_where_the_registry_keeps_its_bytes() -> None:
    """Where the registry keeps what a cut chunk carried and says so (GET: ``Range``), the blob goes on
    from that byte, inside the chunk: about the blob plus less than one chunk is sent, and reported."""
    fake = FakeSpecRegistry()
    link = Link(fake.addr)
    try:
        data, digest = blob()
        link.cut_at(6 * MiB)  # midway through the second chunk
        told: list[int] = []
        wire = send(link.addr, data, digest, told)
        assert fake.blobs[digest] == data
        got = link.requests()
        asked = got.index("GET uploads")
        assert got[asked - 1] == "PATCH uploads 4194304-8388607", got  # the chunk cut midway
        resumed = [r for r in got[asked:] if r.startswith("PATCH")]
        kept = int(resumed[0].split(" ")[-1].split("-")[0])
        assert 4 * MiB < kept < 8 * MiB, got  # on from inside the cut chunk, in the same upload
        assert "POST uploads" not in got[asked:], got
        assert fake.received < len(data) + 4 * MiB  # the blob and less than one chunk more
        assert fake.received <= wire < len(data) + 4 * MiB, (fake.received, wire)  # reported as sent
        assert sum(told) == len(data)
    finally:
        link.close()
        fake.close()


def test_a_link_that_stays_down_fails_in_one_line(reg: registrylib.Registry, link: Link, creds: None) -> None:
    data, digest = blob(5 * MiB)
    link.cut_at(MiB, then_down=1000)
    with pytest.raises(BuilderError) as ei:
        send(link.addr, data, digest)
    msg = str(ei.value)
    assert "\n" not in msg and msg.startswith(f"registry {link.addr}: uploading {digest[:19]}: no progress after")
    assert str(reg.password) not in msg


# --------------------------------------------------------------------------- credentials


@pytest.mark.parametrize("how", ["credHelpers", "credsStore"])
def test_credentials_from_a_credential_helper(reg: registrylib.Registry, tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch, how: str) -> None:
    folder = registrylib.credential_helper(tmp_path / "helpers", "buildertest",
                                           {reg.addr: [str(reg.username), str(reg.password)]})
    cfg = tmp_path / "docker-config"
    cfg.mkdir()
    doc = {"credHelpers": {reg.addr: "buildertest"}} if how == "credHelpers" else {"credsStore": "buildertest"}
    (cfg / "config.json").write_text(json.dumps(doc))
    monkeypatch.setenv("DOCKER_CONFIG", str(cfg))
    monkeypatch.setenv("PATH", f"{folder}{os.pathsep}{os.environ['PATH']}")
    data, digest = blob(MiB)
    send(reg.addr, data, digest)
    assert stored(reg, digest) == data
    assert (folder / "asked").read_text().split() == [reg.addr]  # asked once, for this registry
    for p in tmp_path.rglob("*"):  # the secret was written nowhere (but in the helper's own book)
        if p.is_file() and p.name not in ("book.json", "htpasswd", "registry.log") and p.stat().st_size < 1 << 20:
            assert str(reg.password).encode() not in p.read_bytes(), p


def test_a_registry_that_asks_nothing_never_runs_the_helper(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with registrylib.start_registry(tmp_path / "open") as r:
        folder = registrylib.credential_helper(tmp_path / "helpers", "buildertest", {r.addr: ["u", "p"]})
        cfg = tmp_path / "docker-config"
        cfg.mkdir()
        (cfg / "config.json").write_text(json.dumps({"credsStore": "buildertest"}))
        monkeypatch.setenv("DOCKER_CONFIG", str(cfg))
        monkeypatch.setenv("PATH", f"{folder}{os.pathsep}{os.environ['PATH']}")
        data, digest = blob(MiB)
        send(r.addr, data, digest)
        assert not (folder / "asked").exists()


def test_a_helper_that_is_missing_or_knows_nothing(reg: registrylib.Registry, tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = tmp_path / "docker-config"
    cfg.mkdir()
    (cfg / "config.json").write_text(json.dumps({"credHelpers": {reg.addr: "nosuchhelper"}}))
    monkeypatch.setenv("DOCKER_CONFIG", str(cfg))
    data, digest = blob(MiB)
    with pytest.raises(ResolveError) as ei:
        send(reg.addr, data, digest)
    assert str(ei.value).startswith(f"registry {reg.addr}: the docker config's credential helper failed: ")
    assert "docker-credential-nosuchhelper" in str(ei.value) and "\n" not in str(ei.value)
    folder = registrylib.credential_helper(tmp_path / "helpers", "buildertest", {"other.example:5000": ["u", "p"]})
    (cfg / "config.json").write_text(json.dumps({"credHelpers": {reg.addr: "buildertest"}}))
    monkeypatch.setenv("PATH", f"{folder}{os.pathsep}{os.environ['PATH']}")
    with pytest.raises(ResolveError, match="wants credentials"):
        send(reg.addr, data, digest)
