"""Move a bundle to its host and install it: over SSH (resumable), or to a folder for sneakernet.

Over SSH (builder.ssh: the system ``ssh`` with the fleet's ssh_config when it names one,
``BatchMode=yes``, a connect timeout and keep-alives, and one connection per host for the whole ship,
however many files are sent; host keys are checked as ssh_config says, never switched off):

1. the bundle is verified here (signature against the fleet's key, every hash);
2. ``python3 - status`` on the host (the installer, sent over stdin from this machine's trusted copy)
   says whether the bundle is already installed: then nothing is sent;
3. ``python3 - inventory`` hashes what ``<paths.bundles>/incoming/<bundle_id>/`` already holds; files and
   parts whose size and sha256 match are skipped, extras are removed, the rest is sent with
   ``cat > tmp && mv`` (a cut transfer never leaves a short file under the real name);
4. ``python3 - install`` verifies again on the host, loads, stages, switches and records.

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
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from builder import installer as inst
from builder.bundle import public_key_for, read_public_key, signing_key_path, verify_with_key
from builder.errors import BuilderError, ConfigError, UnreachableError, VerifyError
from builder.hosts import Fleet, Host, find_host
from builder.ssh import Connection, ControlSockets, ssh_config_file

MiB = 1024 * 1024


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
    if opts.insecure:  # nothing is checked against a key, so none is needed (or asked for)
        key = b""
        try:
            manifest, _, _ = inst.verify_bundle(str(bdir), None, insecure=True)
        except inst.InstallError as e:
            raise VerifyError(str(e)) from None
    else:
        key = trusted_key_bytes(root, fleet, bdir, opts)
        manifest = verify_with_key(bdir, key)
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


def _ship_over_ssh(
    remote: Remote, fleet: Fleet, host: Host, bdir: Path, manifest: dict[str, Any], key: bytes, opts: ShipOptions
) -> ShipResult:
    bid = manifest["bundle_id"]
    hroot = host.paths.bundles
    script = inst.assemble()
    res = ShipResult(host=host.name, fleet=fleet.fleet.name, bundle_id=bid, result="")
    st = remote.run_installer(script, ["status", "--root", hroot], timeout=opts.timeout, what="status")
    if opts.stage and st.get("staged") == bid:
        res.result = "unchanged"
        return res
    if (
        not opts.stage
        and st.get("current") == bid
        and isinstance(st.get("applied"), dict)
        and st["applied"].get("bundle_id") == bid
    ):
        res.result = "unchanged"
        return res
    incoming = f"{hroot}/incoming/{bid}"
    tmpdir = f"{hroot}/incoming/.tmp-{bid[:16]}"
    files = _file_order(manifest)
    total = sum(s for _, s, _ in files)
    have = remote.run_installer(
        script, ["inventory", incoming], timeout=opts.timeout + total / opts.hash_rate, what="inventory"
    )
    expected = {p for p, _, _ in files} | {inst.MANIFEST, inst.SIGNATURE}
    extras = sorted(p for p in have if p not in expected)
    if extras:
        cmd = f"cd {shlex.quote(incoming)} && rm -f -- " + " ".join(shlex.quote(p) for p in extras)
        p = remote.run(cmd, timeout=opts.timeout, what="remove extra files")
        if p.returncode != 0:
            raise BuilderError(
                f"{host.name}: cannot remove extra files in {incoming}: {_last_line(p.stderr)}"
            )
        res.removed = extras
    prep = remote.run(
        f"rm -rf {shlex.quote(tmpdir)} && mkdir -p {shlex.quote(tmpdir)} {shlex.quote(incoming)}",
        timeout=opts.timeout,
        what="prepare",
    )
    if prep.returncode != 0:
        raise BuilderError(f"{host.name}: cannot create {incoming}: {_last_line(prep.stderr)}")
    sends = files + _meta_files(bdir)
    for rel, size, digest in sends:
        got = have.get(rel)
        if isinstance(got, list) and len(got) == 2 and got[0] == size and got[1] == digest:
            res.skipped.append(rel)
            continue
        _send(remote, bdir / rel, f"{tmpdir}/{rel}", f"{incoming}/{rel}", size, opts)
        res.sent.append(rel)
        res.bytes_sent += size
    remote.run(f"rm -rf {shlex.quote(tmpdir)}", timeout=opts.timeout, what="clean up")
    args = ["install", incoming, "--root", hroot, "--host", host.name, "--remove-source"]
    if opts.stage:
        args.append("--stage")
    if opts.insecure:
        args.append("--insecure")
    else:
        args += ["--trusted-key-base64", _key_line(key)]
    out = remote.run_installer(script, args, timeout=opts.timeout + 120 + 3 * total / opts.hash_rate, what="install")
    res.result = str(out.get("result", "installed"))
    return res


def _send(remote: Remote, src: Path, tmp: str, dest: str, size: int, opts: ShipOptions) -> None:
    d_tmp, d_dest = os.path.dirname(tmp), os.path.dirname(dest)
    cmd = (
        f"umask 022 && mkdir -p {shlex.quote(d_tmp)} {shlex.quote(d_dest)} && cat > {shlex.quote(tmp)} && "
        f"mv -f {shlex.quote(tmp)} {shlex.quote(dest)}"
    )
    with open(src, "rb") as f:
        p = remote.run(cmd, timeout=opts.timeout + size / opts.min_rate, stdin=f, what=f"send {src.name}")
    if p.returncode != 0:
        raise BuilderError(f"{remote.host.name}: sending {src.name} failed: {_last_line(p.stderr)}")


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
