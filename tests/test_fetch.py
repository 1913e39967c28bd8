"""builder.lock.plainfiles: plain files on disk, file:// and over HTTP on loopback, hashed for real."""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Iterator
from functools import partial
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from builder.errors import ConfigError, ResolveError, VerifyError
from builder.inputs.pins import PlainFile
from builder.lock import plainfiles as fetch

DATA = b"chat template {{ x }}\n" * 100
SHA = hashlib.sha256(DATA).hexdigest()
H = "0" * 64


class Quiet(SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args: object) -> None:
        pass


@pytest.fixture
def server(tmp_path: Path) -> Iterator[str]:
    served = tmp_path / "served"
    served.mkdir()
    (served / "t.jinja").write_bytes(DATA)
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), partial(Quiet, directory=str(served)))
    t = threading.Thread(target=httpd.serve_forever, daemon=True)
    t.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    httpd.server_close()


def test_project_path_and_file_url(tmp_path: Path) -> None:
    (tmp_path / "files").mkdir()
    (tmp_path / "files" / "t.jinja").write_bytes(DATA)
    for url in ("files/t.jinja", f"file://{tmp_path}/files/t.jinja"):
        got = fetch.resolve_file(
            "t", PlainFile(url=url, sha256=SHA), root=tmp_path, offline=True, spec_hash=H
        )
        assert got.sha256 == SHA and got.size == len(DATA) and got.verified and got.url == url


def test_mismatch_names_the_file_and_both_hashes(tmp_path: Path) -> None:
    (tmp_path / "t").write_bytes(DATA + b"x")
    with pytest.raises(ResolveError) as ei:
        fetch.resolve_file("t", PlainFile(url="t", sha256=SHA), root=tmp_path, offline=False, spec_hash=H)
    got = hashlib.sha256(DATA + b"x").hexdigest()
    assert str(ei.value) == f"files.t: sha256 mismatch for t: pinned {SHA}, got {got}"
    with pytest.raises(ResolveError, match="size mismatch"):
        fetch.resolve_file(
            "t", PlainFile(url="t", sha256=got, size=1), root=tmp_path, offline=False, spec_hash=H
        )


def test_missing_and_escaping_paths(tmp_path: Path) -> None:
    with pytest.raises(ResolveError, match=r"files\.t: no such file: nope"):
        fetch.resolve_file("t", PlainFile(url="nope", sha256=SHA), root=tmp_path, offline=False, spec_hash=H)
    with pytest.raises(ConfigError, match=r"files\.t\.url: must be a path inside the project"):
        fetch.resolve_file("t", PlainFile(url="../x", sha256=SHA), root=tmp_path, offline=False, spec_hash=H)
    with pytest.raises(ConfigError, match="unsupported URL scheme: ftp"):
        fetch.resolve_file(
            "t", PlainFile(url="ftp://h/x", sha256=SHA), root=tmp_path, offline=False, spec_hash=H
        )


def test_remote_online_and_offline(server: str, tmp_path: Path) -> None:
    spec = PlainFile(url=f"{server}/t.jinja", sha256=SHA)
    got = fetch.resolve_file("t", spec, root=tmp_path, offline=False, spec_hash=H)
    assert got.verified and got.size == len(DATA)
    with pytest.raises(ResolveError) as ei:
        fetch.resolve_file("t", spec, root=tmp_path, offline=True, spec_hash=H)
    assert str(ei.value) == f"files.t: not reachable offline ({server}/t.jinja)"
    with pytest.raises(ResolveError, match=r"files\.t: cannot download .*/missing: HTTP 404"):
        fetch.resolve_file(
            "t", PlainFile(url=f"{server}/missing", sha256=SHA), root=tmp_path, offline=False, spec_hash=H
        )
    with pytest.raises(ResolveError, match=r"files\.t: sha256 mismatch"):
        fetch.resolve_file(
            "t",
            PlainFile(url=f"{server}/t.jinja", sha256="1" * 64),
            root=tmp_path,
            offline=False,
            spec_hash=H,
        )


def test_download_is_atomic_and_verified(server: str, tmp_path: Path) -> None:
    dest = tmp_path / "out" / "t.jinja"
    assert fetch.download(f"{server}/t.jinja", dest, SHA) == len(DATA)
    assert dest.read_bytes() == DATA
    dest.write_bytes(b"old")
    with pytest.raises(VerifyError, match="sha256 mismatch"):
        fetch.download(f"{server}/t.jinja", dest, "1" * 64)
    assert dest.read_bytes() == b"old"  # untouched
    assert [p.name for p in dest.parent.iterdir()] == ["t.jinja"]  # no temporary left
    with pytest.raises(ResolveError, match="HTTP 404"):
        fetch.download(f"{server}/missing", tmp_path / "m", SHA)
    assert not (tmp_path / "m").exists()
    local = tmp_path / "src.bin"
    local.write_bytes(DATA)
    fetch.download(f"file://{local}", tmp_path / "copy", SHA)
    fetch.download("src.bin", tmp_path / "copy2", SHA, root=tmp_path)
    assert (tmp_path / "copy").read_bytes() == (tmp_path / "copy2").read_bytes() == DATA


@pytest.mark.parametrize(
    ("text", "shown"),
    [
        ("https://user:s3cr3t@git.example.invalid/org/e.git", "https://git.example.invalid/org/e.git"),
        ("https://x:pa@ss@git.example.invalid/e.git?token=abc#frag", "https://git.example.invalid/e.git"),
        ("ssh://git@git.example.invalid/org/engine", "ssh://git.example.invalid/org/engine"),
        ("fatal: unable to access 'https://u:p@127.0.0.1:9/r.git/': refused",
         "fatal: unable to access 'https://127.0.0.1:9/r.git/': refused"),
        ("git@github.example.invalid:org/e.git", "git@github.example.invalid:org/e.git"),
        ("engine-src/demo-engine.bundle", "engine-src/demo-engine.bundle"),
    ],
)
def test_scrub_url_drops_credentials_and_queries(text: str, shown: str) -> None:
    assert fetch.scrub_url(text) == shown
