"""The ssh send path: the bundle streamed over the host's one connection to the installer's
``receive`` (this machine's trusted copy, kept on the host under its sha256), only the files and
bytes the host says it lacks, each sent with sendfile."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import tempfile
import threading
from pathlib import Path
from typing import Any

from builder.bundle import hostpkg
from builder.errors import BuilderError, ConfigError, UnreachableError, VerifyError
from builder.foundation import sign
from builder.foundation.ssh import with_parent
from builder.inputs.hosts import Host
from builder.installer.manifest import MANIFEST, SIGNATURE
from builder.installer.receive import RECEIVE_MAGIC, widen_pipe
from builder.ship.job import MiB, ShipOptions, ShipResult
from builder.ship.remote import BAD_INSTALLER, Remote, bad_installer, installer_answer, installer_command

#: bytes per sendfile call (a progress step)
SEND_CHUNK = 8 * MiB


def key_line(key: bytes) -> str:
    return sign.parse_public_key(key).base64


def ship_over_ssh(
    remote: Remote, host: Host, bdir: Path, manifest: dict[str, Any], key: bytes, opts: ShipOptions
) -> ShipResult:
    """One remote command over the host's one connection: ``installer receive`` (this machine's
    trusted installer, kept on the host under its sha256 and checked against it before it runs),
    with the bundle streamed on its stdin (only the files and bytes the host says it lacks); it
    hashes every byte as it arrives and installs, or says the bundle is already there.

    The stream starts with the installer itself (install.pyz, about 120 KiB): the command keeps it
    as the host's copy when that is missing or differs, and skips it otherwise (installer_command),
    so a first ship costs no second command and no round trip more than a later one."""
    script = hostpkg.zipapp()
    hroot = host.paths.bundles
    args = ["receive", "--root", hroot, "--host", host.name]
    if opts.stage:
        args.append("--stage")
    if opts.rehash:
        args.append("--rehash")
    if opts.insecure:
        args.append("--insecure")
    else:
        args += ["--trusted-key-base64", key_line(key)]
    return _receive(remote, host, bdir, manifest, script, installer_command(hroot, script, args), opts)


def _receive(
    remote: Remote, host: Host, bdir: Path, manifest: dict[str, Any], script: bytes, command: str,
    opts: ShipOptions,
) -> ShipResult:
    """Run the receive command with the installer and the bundle streamed to it."""
    res = ShipResult(host=host.name, fleet=manifest["fleet"], bundle_id=manifest["bundle_id"], result="")
    total = sum(f["size"] for f in manifest["files"])
    mbytes = (bdir / MANIFEST).read_bytes()
    sbytes = (bdir / SIGNATURE).read_bytes() if not opts.insecure else b""
    limit = opts.timeout + 120 + total / opts.min_rate + 3 * total / opts.hash_rate
    remote.connect()
    argv = remote.argv(command)
    errf = tempfile.TemporaryFile()
    try:
        proc = subprocess.Popen(with_parent(argv), stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=errf)
    except FileNotFoundError:
        raise ConfigError(f"{argv[0]}: not found (needed to reach {host.name})") from None
    fired: list[bool] = []

    def stalled() -> None:
        fired.append(True)
        proc.kill()

    timer = threading.Timer(limit, stalled)
    timer.daemon = True
    timer.start()
    assert proc.stdin is not None and proc.stdout is not None
    widen_pipe(proc.stdin.fileno())
    try:
        head = script + RECEIVE_MAGIC + f"{len(mbytes)} {len(sbytes)}\n".encode() + mbytes + sbytes
        broken = not _send(proc, head, bdir, manifest, opts, res)
        with contextlib.suppress(OSError):
            proc.stdin.close()
        tail = proc.stdout.read()
        rc = proc.wait()
    finally:
        timer.cancel()
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    errf.seek(0)
    err = errf.read(1 << 20)
    if fired:
        raise UnreachableError(
            f"{host.name}: no answer within {limit:.0f} s (receive) over {remote.kind} to {host.ssh}"
        )
    if rc == BAD_INSTALLER and not res.sent:
        raise BuilderError(bad_installer(host, err))
    if broken and rc == 0:
        rc = 1
    _take_answer(res, installer_answer(remote, rc, tail, err, "receive"))
    return res


def _send(proc: subprocess.Popen[bytes], head: bytes, bdir: Path, manifest: dict[str, Any], opts: ShipOptions,
          res: ShipResult) -> bool:
    """Write the installer, the manifest and its signature, read which files (from which offset) the host
    wants, and stream those; False when the host stopped reading (its error is then on its stderr)."""
    assert proc.stdin is not None and proc.stdout is not None
    files = {f["path"]: f for f in manifest["files"]}
    try:
        proc.stdin.write(head)
        proc.stdin.flush()
        line = proc.stdout.readline()
        want = json.loads(line).get("want") if line.strip() else None
        if isinstance(want, list):
            sent = {p for p, _ in want}
            res.skipped = sorted(set(files) - sent)
            if opts.on_plan is not None:
                opts.on_plan([(p, files[p]["size"] - int(o)) for p, o in want])
            for path, offset in want:
                entry = files[path]
                _stream(proc.stdin.fileno(), bdir, entry, int(offset), opts)
                res.sent.append(path)
                res.bytes_sent += entry["size"] - int(offset)
        proc.stdin.close()
    except (BrokenPipeError, ConnectionResetError, ValueError):
        return False
    return True


def _take_answer(res: ShipResult, out: dict[str, Any]) -> None:
    """The installer's answer into the result: what it did, what differed, and what it pulled."""
    res.result = str(out.get("result", "installed"))
    res.differed = [str(x) for x in out.get("differed") or []]
    pulled = out.get("pulled")
    if not isinstance(pulled, dict):
        pulled = {}
    res.bytes_pulled = int(pulled.get("bytes") or 0)
    res.pull_seconds = float(pulled.get("seconds") or 0.0)


def _stream(fd: int, bdir: Path, entry: dict[str, Any], offset: int, opts: ShipOptions) -> None:
    """Write a manifest file's bytes from offset to fd (its parts one after another), by sendfile:
    the bytes go from the page cache to the pipe without passing through Python."""
    pieces = entry.get("parts") or [entry]
    at = 0
    for piece in pieces:
        start, end = at, at + piece["size"]
        at = end
        if end <= offset:
            continue
        skip = max(0, offset - start)
        with open(bdir / piece["path"], "rb") as f:
            pos, left = skip, piece["size"] - skip
            while left > 0:
                n = os.sendfile(fd, f.fileno(), pos, min(left, SEND_CHUNK))
                if n == 0:
                    raise VerifyError(f"{bdir / piece['path']}: shorter than the manifest says")
                pos += n
                left -= n
                if opts.on_bytes is not None:
                    opts.on_bytes(entry["path"], n)
