"""Move a bundle to its host and install it: over SSH (resumable), or to a folder for sneakernet.

Over SSH (builder.ssh: the system ``ssh`` with the fleet's ssh_config when it names one,
``BatchMode=yes``, a connect timeout and keep-alives, and one connection per host for the whole ship,
however many files are sent; host keys are checked as ssh_config says, never switched off):

1. the bundle's signature, manifest and file sizes are checked here (its bytes were hashed when
   they were written; the host hashes every byte it receives);
2. one remote command writes the installer (this machine's trusted copy, sent on stdin) to
   ``<paths.bundles>/incoming/installer-<sha256>.py`` and runs its ``status``: a bundle already
   installed (or staged, for ``--stage``) is not sent;
3. one more, ``installer receive``, gets the signed manifest first, answers which files it lacks and
   from which byte (what a cut ship left is not sent again), then reads exactly those bytes from
   the same stdin (sent with sendfile, no per-file command), hashes each as it arrives into the
   file it ends up in (a model file beside its place, the image archive and launch files in
   ``incoming/``), refuses a wrong byte naming the file, and installs: load, place, stage (the
   release links the launch files received), switch, record.

Every ssh call has a timeout (base + size / minimum rate). A host that cannot be reached (ssh exit
255, or no answer in time) gives UnreachableError (exit 3, one line naming the host); a rerun resumes.

``--to DIR`` copies the bundle to ``DIR/<fleet>/<host>/`` instead (resumable the same way), then
verifies the copy. Install it on the host with a trusted installer (see builder/installer.py).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shlex
import shutil
import subprocess
import tempfile
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from builder import installer as inst
from builder.bundle import public_key_for, read_public_key, signing_key_path, verify_with_key
from builder.errors import BuilderError, ConfigError, UnreachableError, VerifyError
from builder.hosts import Fleet, Host, find_host, ssh_config_file
from builder.ssh import Connection, ControlSockets

MiB = 1024 * 1024
#: bytes per sendfile call (a progress step)
SEND_CHUNK = 8 * MiB


@dataclass
class ShipOptions:
    bundle: Path | None = None
    to: Path | None = None
    key: Path | None = (
        None  # the public key the host trusts (default: fleet.trusted_key, else --signing-key's)
    )
    signing_key: Path | None = None
    timeout: float = 60.0  # base seconds of every remote call
    connect_timeout: int = 10
    min_rate: float = 1 * MiB  # bytes/s below which a transfer counts as stalled
    hash_rate: float = 50 * MiB  # bytes/s the host is assumed to hash at least
    insecure: bool = False
    #: install up to the switch only (``install --stage``: ``staged`` and state/staged.json; for
    #: ``builder deploy``, which switches every host once every host is staged and audited)
    stage: bool = False
    #: the run's control sockets, when the ship is one step of a larger run (``builder deploy``)
    sockets: ControlSockets | None = None
    #: progress: what will be sent, once the host has said what it lacks ([(file, bytes)]) ...
    on_plan: Callable[[list[tuple[str, int]]], None] | None = None
    #: ... and then (the bundle file being sent, bytes just sent)
    on_bytes: Callable[[str, int], None] | None = None


@dataclass
class ShipResult:
    host: str
    fleet: str
    bundle_id: str
    result: str  # installed | staged | unchanged | copied
    sent: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    removed: list[str] = field(default_factory=list)
    dest: str = ""
    bytes_sent: int = 0


# --------------------------------------------------------------------------- the remote end


class Remote:
    """Runs shell commands on a host: over ssh, with `docker exec`, or locally (connection = local).

    Over ssh every command of one ship goes through one connection (builder.ssh), opened by the
    first command and closed by `close`: one key exchange per host, however many files are sent."""

    def __init__(
        self,
        fleet_file: Path,
        fleet: Fleet,
        host: Host,
        connect_timeout: int = 10,
        sockets: ControlSockets | None = None,
    ) -> None:
        """`fleet_file`: the inventory file `fleet` was read from (a relative ssh_config is taken
        from its folder, as the audit takes it). `sockets`: a run's control sockets shared with other
        commands of that run (``builder deploy``: its steps and audits use one connection per host);
        by default the Remote's own, removed by `close`."""
        self.host = host
        self.sockets = sockets
        self.kind = host.connection
        self.ssh_config = ssh_config_file(fleet_file, fleet.fleet.ssh_config)
        self.connect_timeout = connect_timeout
        self._ssh: Connection | None = None
        self._open = False

    def _connection(self) -> Connection:
        if self._ssh is None:
            sockets = self.sockets or ControlSockets.for_run(persist=0)
            self._ssh = Connection.to(self.host.ssh, self.ssh_config, sockets, self.connect_timeout)
        return self._ssh

    def argv(self, command: str) -> list[str]:
        if self.kind == "local":
            return ["sh", "-c", command]
        if self.kind == "docker":
            return ["docker", "exec", "-i", self.host.ssh, "sh", "-c", command]
        return self._connection().argv(command)  # (ssh ... -- HOST COMMAND)

    def connect(self) -> None:
        """Open the host's ssh connection, if not yet open; UnreachableError when it cannot be."""
        if self.kind != "ssh" or self._open:
            return
        why = self._connection().open()
        if why is not None:
            raise UnreachableError(f"{self.host.name}: unreachable over ssh ({self.host.ssh}): {why}")
        self._open = True

    def close(self) -> None:
        """Close the host's connection (idempotent)."""
        if self._ssh is not None:
            self._ssh.close()
            if self.sockets is None:  # (shared sockets are their run's to remove)
                self._ssh.sockets.cleanup()
            self._ssh, self._open = None, False

    def __enter__(self) -> Remote:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def run(
        self, command: str, *, timeout: float, stdin: bytes | IO[bytes] | None = None, what: str = ""
    ) -> subprocess.CompletedProcess[bytes]:
        self.connect()
        argv = self.argv(command)
        kw: dict[str, Any] = (
            {"input": stdin}
            if isinstance(stdin, bytes)
            else {"stdin": stdin if stdin is not None else subprocess.DEVNULL}
        )
        try:
            proc = subprocess.run(argv, capture_output=True, timeout=timeout, check=False, **kw)
        except subprocess.TimeoutExpired:
            raise UnreachableError(
                f"{self.host.name}: no answer within {timeout:.0f} s"
                f"{' (' + what + ')' if what else ''} over {self.kind} to {self.host.ssh}"
            ) from None
        except FileNotFoundError:
            raise ConfigError(f"{argv[0]}: not found (needed to reach {self.host.name})") from None
        if self.kind == "ssh" and proc.returncode == 255:
            last = _last_line(proc.stderr) or "connection failed"
            raise UnreachableError(f"{self.host.name}: unreachable over ssh ({self.host.ssh}): {last}")
        return proc

    def run_installer(self, script: bytes, args: list[str], *, timeout: float, what: str) -> dict[str, Any]:
        """Run the installer on the host (script on stdin); its JSON answer, or the error it printed."""
        cmd = "python3 - " + " ".join(shlex.quote(a) for a in args)
        proc = self.run(cmd, timeout=timeout, stdin=script, what=what)
        if proc.returncode != 0:
            msg = _error_line(proc.stderr) or f"exit status {proc.returncode}"
            if proc.returncode == 127 or "python3: not found" in msg or "command not found" in msg:
                raise BuilderError(f"{self.host.name}: python3 not found on the host")
            cls = ConfigError if proc.returncode == inst.EXIT_CONFIG else BuilderError
            raise cls(f"{self.host.name}: {what}: {msg}")
        try:
            out = json.loads(proc.stdout.decode("utf-8").strip().splitlines()[-1])
        except (ValueError, IndexError, UnicodeDecodeError):
            raise BuilderError(f"{self.host.name}: {what}: unreadable answer from the installer") from None
        if not isinstance(out, dict):
            raise BuilderError(f"{self.host.name}: {what}: unexpected answer from the installer")
        return out


def _last_line(data: bytes) -> str:
    lines = [ln.strip() for ln in data.decode("utf-8", "replace").splitlines() if ln.strip()]
    return lines[-1] if lines else ""


def _error_line(data: bytes) -> str:
    lines = [ln.strip() for ln in data.decode("utf-8", "replace").splitlines() if ln.strip()]
    for ln in reversed(lines):
        if ln.startswith("error: "):
            return ln[len("error: ") :]
    return lines[-1] if lines else ""


# --------------------------------------------------------------------------- keys and the bundle


def trusted_key_bytes(root: Path, fleet: Fleet, bundle_dir: Path, opts: ShipOptions) -> bytes:
    """The public key the host is told to trust: --key, else fleet.trusted_key, else the signing key's."""
    from builder import sign

    if opts.key is not None or fleet.fleet.trusted_key:
        return read_public_key(public_key_for(bundle_dir, opts.key, root))
    sk = sign.load_secret_key(signing_key_path(opts.signing_key))
    return sign.public_key_text(sk.public_key).encode("ascii")


def _key_line(key: bytes) -> str:
    from builder import sign

    return sign.parse_public_key(key).base64


def _load_bundle(
    root: Path, fleet: Fleet, host: Host, opts: ShipOptions
) -> tuple[Path, dict[str, Any], bytes]:
    bdir = opts.bundle or root / "out" / "bundles" / fleet.fleet.name / host.name
    if not (bdir / inst.MANIFEST).is_file():
        raise ConfigError(f"{bdir}: no bundle there (run `builder bundle {host.name}`)")
    # Over ssh the host hashes every byte it receives against the signed manifest (and refuses a
    # wrong one, naming the file), so here the signature and sizes suffice; a copy to a folder is
    # checked in full here, as nothing else will check it before it is carried away.
    hashes = opts.to is not None
    if opts.insecure:  # nothing is checked against a key, so none is needed (or asked for)
        key = b""
        try:
            manifest, _, _ = inst.verify_bundle(str(bdir), None, insecure=True, hashes=hashes)
        except inst.InstallError as e:
            raise VerifyError(str(e)) from None
    else:
        key = trusted_key_bytes(root, fleet, bdir, opts)
        manifest = verify_with_key(bdir, key, hashes=hashes)
    if manifest["host"] != host.name or manifest["fleet"] != fleet.fleet.name:
        raise ConfigError(
            f"{bdir}: the bundle is for {manifest['fleet']}/{manifest['host']}, not "
            f"{fleet.fleet.name}/{host.name}"
        )
    return bdir, manifest, key


def _file_order(manifest: dict[str, Any]) -> list[tuple[str, int, str]]:
    """Every physical file, manifest and signature last (a folder with them is complete)."""
    phys = inst.physical_files(manifest)
    return [(p, s, h) for p, (s, h) in sorted(phys.items())]


def _meta_files(bdir: Path) -> list[tuple[str, int, str]]:
    """(path, size, sha256) of the manifest and (when there is one) the signature in bdir."""
    out = []
    for name in (inst.MANIFEST, inst.SIGNATURE):
        if (bdir / name).exists():
            digest, size = inst.hash_file(str(bdir / name))
            out.append((name, size, digest))
    return out


# --------------------------------------------------------------------------- ship over ssh


def ship(root: Path, host_ref: str, opts: ShipOptions) -> ShipResult:
    """Ship HOST's bundle (project root = the folder of pins.toml; inventories in root/hosts)."""
    fleet_file, fleet, host = find_host(root / "hosts", host_ref)
    bdir, manifest, key = _load_bundle(root, fleet, host, opts)
    if opts.to is not None:
        return ship_to_dir(
            bdir, manifest, opts.to / fleet.fleet.name / host.name, key if not opts.insecure else None
        )
    with Remote(fleet_file, fleet, host, opts.connect_timeout, sockets=opts.sockets) as remote:
        return _ship_over_ssh(remote, fleet, host, bdir, manifest, key, opts)


def _installer_answer(remote: Remote, proc_rc: int, stdout: bytes, stderr: bytes, what: str) -> dict[str, Any]:
    """The installer's JSON answer (its last stdout line), or the error it printed, as run_installer reads it."""
    name = remote.host.name
    if remote.kind == "ssh" and proc_rc == 255:
        last = _last_line(stderr) or "connection failed"
        raise UnreachableError(f"{name}: unreachable over ssh ({remote.host.ssh}): {last}")
    if proc_rc != 0:
        msg = _error_line(stderr) or f"exit status {proc_rc}"
        if proc_rc == 127 or "python3: not found" in msg or "command not found" in msg:
            raise BuilderError(f"{name}: python3 not found on the host")
        cls = ConfigError if proc_rc == inst.EXIT_CONFIG else BuilderError
        raise cls(f"{name}: {what}: {msg}")
    try:
        out = json.loads(stdout.decode("utf-8").strip().splitlines()[-1])
    except (ValueError, IndexError, UnicodeDecodeError):
        raise BuilderError(f"{name}: {what}: unreadable answer from the installer") from None
    if not isinstance(out, dict):
        raise BuilderError(f"{name}: {what}: unexpected answer from the installer")
    return out


#: the exit status of ship's receive command when the host lacks this installer (it is sent, then
#: the receive runs again)
NO_INSTALLER = 199


def _ship_over_ssh(
    remote: Remote, fleet: Fleet, host: Host, bdir: Path, manifest: dict[str, Any], key: bytes, opts: ShipOptions
) -> ShipResult:
    """One remote command over the host's one connection: ``installer receive`` (this machine's
    trusted installer, kept on the host under its sha256 and checked against it before it runs),
    with the bundle streamed on its stdin (only the files and bytes the host says it lacks); it
    hashes every byte as it arrives and installs, or says the bundle is already there. A host
    without this installer gets it first (a second command)."""
    script = inst.assemble()
    digest = hashlib.sha256(script).hexdigest()
    hroot = host.paths.bundles
    prog = f"{hroot}/incoming/installer-{digest[:16]}.py"
    q = shlex.quote
    args = ["receive", "--root", hroot, "--host", host.name]
    if opts.stage:
        args.append("--stage")
    if opts.insecure:
        args.append("--insecure")
    else:
        args += ["--trusted-key-base64", _key_line(key)]
    receive = (
        f'test "$(sha256sum < {q(prog)} 2>/dev/null | cut -c1-64)" = {digest} || exit {NO_INSTALLER}; '
        f"exec python3 {q(prog)} " + " ".join(q(a) for a in args)
    )
    res = _receive(remote, host, bdir, manifest, receive, opts)
    if res is not None:
        return res
    put = (
        f"umask 022 && mkdir -p {q(hroot + '/incoming')} && cat > {q(prog + '.tmp')} && "
        f"mv -f {q(prog + '.tmp')} {q(prog)}"
    )
    p = remote.run(put, timeout=opts.timeout, stdin=script, what="send the installer")
    if p.returncode != 0:
        raise BuilderError(f"{host.name}: cannot write {prog}: {_last_line(p.stderr)}")
    res = _receive(remote, host, bdir, manifest, receive, opts)
    if res is None:
        raise BuilderError(f"{host.name}: {prog} does not match the installer just sent")
    return res


def _receive(
    remote: Remote, host: Host, bdir: Path, manifest: dict[str, Any], command: str, opts: ShipOptions
) -> ShipResult | None:
    """Run the receive command with the bundle streamed to it; None when the host lacks the installer."""
    res = ShipResult(host=host.name, fleet=manifest["fleet"], bundle_id=manifest["bundle_id"], result="")
    files = {f["path"]: f for f in manifest["files"]}
    total = sum(f["size"] for f in manifest["files"])
    mbytes = (bdir / inst.MANIFEST).read_bytes()
    sbytes = (bdir / inst.SIGNATURE).read_bytes() if not opts.insecure else b""
    limit = opts.timeout + 120 + total / opts.min_rate + 3 * total / opts.hash_rate
    remote.connect()
    argv = remote.argv(command)
    errf = tempfile.TemporaryFile()
    try:
        proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=errf)
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
    inst.widen_pipe(proc.stdin.fileno())
    broken = False
    try:
        try:
            proc.stdin.write(inst.RECEIVE_MAGIC + f"{len(mbytes)} {len(sbytes)}\n".encode() + mbytes + sbytes)
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
            broken = True  # the host stopped reading: its error is on its stderr
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
    if rc == NO_INSTALLER and not res.sent:
        return None
    if broken and rc == 0:
        rc = 1
    out = _installer_answer(remote, rc, tail, err, "receive")
    res.result = str(out.get("result", "installed"))
    return res


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


# --------------------------------------------------------------------------- sneakernet


def _copy_checked(src: Path, tmp: Path, dest: Path, size: int, digest: str, mode: int) -> None:
    tmp.parent.mkdir(parents=True, exist_ok=True)
    dest.parent.mkdir(parents=True, exist_ok=True)
    h = hashlib.sha256()
    n = 0
    with open(src, "rb") as fi, open(tmp, "wb") as fo:
        while chunk := fi.read(inst.READ_SIZE):
            h.update(chunk)
            n += len(chunk)
            fo.write(chunk)
        fo.flush()
        os.fsync(fo.fileno())
    if n != size or (digest and h.hexdigest() != digest):
        tmp.unlink()
        raise VerifyError(f"{src}: changed while it was copied")
    os.chmod(tmp, mode)
    os.replace(tmp, dest)


def ship_to_dir(bdir: Path, manifest: dict[str, Any], dest: Path, key: bytes | None) -> ShipResult:
    """Copy a verified bundle to dest, skipping files already there with the right hash; verify the copy."""
    res = ShipResult(
        host=manifest["host"],
        fleet=manifest["fleet"],
        bundle_id=manifest["bundle_id"],
        result="copied",
        dest=str(dest),
    )
    dest.mkdir(parents=True, exist_ok=True)
    tmp_root = dest.parent / f".tmp-{dest.name}"
    shutil.rmtree(tmp_root, ignore_errors=True)
    files = _file_order(manifest)
    expected = {p for p, _, _ in files} | {inst.MANIFEST, inst.SIGNATURE}
    present, refused = inst.scan_tree(str(dest))
    for r in refused:  # links and odd files: remove what we can name
        with contextlib.suppress(OSError):
            (dest / r.rsplit(" (", 1)[0]).unlink()
    for rel in sorted(set(present) - expected):
        (dest / rel).unlink()
        res.removed.append(rel)
    sends = files + _meta_files(bdir)
    if not (bdir / inst.SIGNATURE).exists():  # an unsigned bundle: no stale signature in the copy
        (dest / inst.SIGNATURE).unlink(missing_ok=True)
    modes = {f["path"]: inst.MODES[f["mode"]] for f in manifest["files"] if not f.get("parts")}
    for rel, size, digest in sends:
        target = dest / rel
        mode = modes.get(rel, 0o644)
        if (
            target.is_file()
            and not target.is_symlink()
            and target.stat().st_size == size
            and inst.hash_file(str(target))[0] == digest
        ):
            os.chmod(target, mode)
            res.skipped.append(rel)
            continue
        _copy_checked(bdir / rel, tmp_root / rel, target, size, digest, mode)
        res.sent.append(rel)
        res.bytes_sent += size
    shutil.rmtree(tmp_root, ignore_errors=True)
    if key is not None:
        verify_with_key(dest, key)
    else:
        try:
            inst.verify_bundle(str(dest), None, insecure=True)
        except inst.InstallError as e:
            raise VerifyError(str(e)) from None
    return res
