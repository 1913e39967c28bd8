"""`builder ship` over its stream (installer ``receive``) to a local host: each byte sent once, hashed
as it arrives, a cut ship resumed from the byte it reached, a wrong byte refused naming its file.

The host is `connection = "local"` (the ship's remote commands run in a local shell), so these run
without the test fleet; tests/test_ship.py does the same over ssh to the fleet.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from builder.bundle import hostpkg
from builder.foundation import sign
from builder.installer.manifest import MANIFEST, SIGNATURE
from builder.installer.receive import RECEIVE_MAGIC
from builder.store.placement import kept_installer
from tests.lib import bundlelib as bl

pytestmark = pytest.mark.docker


@pytest.fixture
def lproj(tmp_path: Path, request: pytest.FixtureRequest) -> bl.Project:
    if not shutil.which("docker"):
        pytest.skip("no docker CLI")
    return bl.make_project(
        tmp_path, hosts=bl.local_hosts(tmp_path / "host", connection="local"), docker_image=True,
        marker=request.node.nodeid,
    )


def _bundle(p: bl.Project, *extra: str) -> Path:
    r = p.cli("bundle", "spark-b", "--with-image", "--with-models", "--part-size", "64KiB", "--key", str(p.key),
              *extra)
    assert r.returncode == 0, r.stderr
    return p.out("spark-b")


def _ship(p: bl.Project) -> subprocess.CompletedProcess[str]:
    return p.cli("ship", "spark-b", "--signing-key", str(p.key), "--json")


def _rmi(image_id: str) -> None:
    subprocess.run(["docker", "image", "rm", "-f", image_id], capture_output=True)


def _root(p: bl.Project) -> Path:
    return p.root.parent / "host" / "builder"


def _cut_receive(p: bl.Project, bdir: Path, keep: int) -> tuple[list[Any], subprocess.CompletedProcess[bytes]]:
    """Run the host's `receive` and cut its stream after `keep` bytes of data: what a lost link leaves."""
    prog = p.root.parent / hostpkg.NAME
    prog.write_bytes(hostpkg.zipapp())
    mbytes, sbytes = (bdir / MANIFEST).read_bytes(), (bdir / SIGNATURE).read_bytes()
    key = sign.parse_public_key(p.pub.read_bytes()).base64
    proc = subprocess.Popen(
        [sys.executable, "-I", str(prog), "receive", "--root", str(_root(p)), "--trusted-key-base64", key],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )
    assert proc.stdin is not None and proc.stdout is not None
    proc.stdin.write(RECEIVE_MAGIC + f"{len(mbytes)} {len(sbytes)}\n".encode() + mbytes + sbytes)
    proc.stdin.flush()
    want = json.loads(proc.stdout.readline())["want"]
    files = {f["path"]: f for f in bl.manifest(bdir)["files"]}
    stream = b""
    for path, offset in want:
        e = files[path]
        data = b"".join((bdir / pt["path"]).read_bytes() for pt in e.get("parts") or [e])
        stream += data[offset:]
    proc.stdin.write(stream[:keep])
    proc.stdin.close()
    assert proc.stderr is not None
    out, err = proc.stdout.read(), proc.stderr.read()
    proc.wait(timeout=120)
    return want, subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def test_ship_streams_once_and_installs(lproj: bl.Project) -> None:
    p = lproj
    bdir = _bundle(p)
    _rmi(p.image_id)
    r = _ship(p)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    m = bl.manifest(bdir)
    assert out["result"] == "installed" and out["bundle_id"] == m["bundle_id"]
    assert out["bytes_sent"] == sum(f["size"] for f in m["files"]) and out["skipped"] == []
    root = _root(p)
    assert os.readlink(root / "current") == f"releases/{m['bundle_id']}"
    rec = json.loads((root / "state" / "applied.json").read_text())
    for mm in rec["models"]:
        assert Path(mm["path"]).stat().st_size == mm["size"]
    assert not (root / "incoming" / m["bundle_id"]).exists()  # the stream's files went into the release
    # a second ship sends nothing
    r = _ship(p)
    assert r.returncode == 0 and json.loads(r.stdout)["result"] == "unchanged", r.stderr
    _rmi(p.image_id)


def test_a_cut_ship_resumes_without_resending(lproj: bl.Project) -> None:
    p = lproj
    bdir = _bundle(p)
    _rmi(p.image_id)
    files = {f["path"]: f for f in bl.manifest(bdir)["files"]}
    keep = 150_000  # into the image archive's third part
    want, cut = _cut_receive(p, bdir, keep)
    # the archive first (docker load reads it while the rest arrives), the model files last
    assert want[0][0] == "image.tar" and want[-1][0].startswith("models/"), want
    assert cut.returncode == 1 and b"the stream ended at byte" in cut.stderr and b"Traceback" not in cut.stderr
    assert not (_root(p) / "current").exists()
    needed = sum(files[w]["size"] - off for w, off in want)
    r = _ship(p)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["result"] == "installed"
    assert out["bytes_sent"] == needed - keep, (out, needed, keep)
    _rmi(p.image_id)


def test_a_wrong_byte_is_refused_naming_the_file(lproj: bl.Project) -> None:
    p = lproj
    bdir = _bundle(p)
    _rmi(p.image_id)
    part = bdir / "parts" / "image.tar.part0001"
    data = part.read_bytes()
    part.write_bytes(data[:100] + bytes([data[100] ^ 1]) + data[101:])
    r = _ship(p)
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    assert r.stderr.strip().count("\n") == 0, r.stderr
    assert "parts/image.tar.part0001: sha256 mismatch (damaged part)" in r.stderr
    assert not (_root(p) / "current").exists()
    part.write_bytes(data)
    (bdir / "start.sh").write_bytes((bdir / "start.sh").read_bytes().replace(b"docker", b"dockex", 1))
    r = _ship(p)
    assert r.returncode == 1 and "start.sh: sha256 mismatch" in r.stderr, r.stderr
    assert not (_root(p) / "current").exists()
    _rmi(p.image_id)


def test_a_host_copy_of_the_installer_that_differs_is_replaced(lproj: bl.Project) -> None:
    """The installer travels at the head of ship's one command: a host whose kept copy is damaged
    gets the operator's copy in the same command, checked against its sha256 before it runs."""
    p = lproj
    _bundle(p)
    _rmi(p.image_id)
    script = hostpkg.zipapp()
    prog = Path(kept_installer(str(_root(p)), hashlib.sha256(script).hexdigest()))
    assert prog.name == f"install-{hashlib.sha256(script).hexdigest()[:16]}.pyz"
    prog.parent.mkdir(parents=True)
    prog.write_bytes(script.replace(b"def receive(", b"def receive_(", 1))
    r = _ship(p)
    assert r.returncode == 0 and json.loads(r.stdout)["result"] == "installed", r.stderr
    assert prog.read_bytes() == script
    _rmi(p.image_id)
