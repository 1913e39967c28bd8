"""Per-host launch bundles: render, split into parts, hash, sign; verify a bundle folder.

A bundle is a folder (never one big tar) for one host's rank of a fleet:

    manifest.json            format, bundle id, host, fleet, lane, rank, world size, lock hash, image
                             (input address, ImageID, DiffIDs), every file (path, size, sha256, mode,
                             and its parts), the model files the host must hold (absolute path, size, sha256)
    manifest.json.minisig    minisign signature over manifest.json; its trusted comment carries
                             id, host, fleet, lane and rank
                             (`minisign -Vm manifest.json -p KEY.pub` checks it)
    start.sh stop.sh rank.env config.json   the rank's launch files (builder.launch)
    install.py               the assembled installer (run only a verified copy; see builder/installer.py)
    image.tar                the image as a `docker load` archive (--with-image)
    models/<model>/<file>    model files (--with-models)
    parts/<path>.partNNNN    files larger than --part-size, in parts, each hashed in the manifest

The bundle id is the sha256 of the canonical manifest without the id. No timestamps go anywhere and
modes are fixed, so the same lock, inventory and image give the same bytes (Ed25519 signatures are
deterministic too). Every file is streamed (4 MiB buffers): memory stays flat whatever the sizes.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import mmap
import os
import re
import secrets
import shutil
import subprocess
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from builder import __version__
from builder import installer as inst
from builder.canon import ChunkReader, canonical_json, file_lock, fsync_dir, pretty_json
from builder.errors import BuilderError, ConfigError, VerifyError
from builder.hosts import Fleet, Host, check_against_pins, find_fleet, find_host
from builder.launch import ModelMount, render_launch
from builder.lock import Lock, LockedModel, load_lock, spec_hash
from builder.pins import HfModel, Pins, load_pins
from builder.placement import host_files

DEFAULT_PART_SIZE = 256 * 1024 * 1024
READ_SIZE = 4 * 1024 * 1024
SIGNING_KEY_ENV = "BUILDER_SIGNING_KEY"


# --------------------------------------------------------------------------- options and results


@dataclass
class BundleOptions:
    out: Path | None = None
    key: Path | None = None
    with_image: bool = False
    with_models: bool = False
    part_size: int = DEFAULT_PART_SIZE


@dataclass
class BundleResult:
    fleet: str
    host: str
    rank: int
    path: Path
    bundle_id: str
    files: int
    size: int
    unchanged: bool
    parts: int = 0


@dataclass
class Context:
    root: Path
    pins: Pins
    lock: Lock
    store: Path
    hosts_dir: Path


def parse_size(text: str) -> int:
    """'256MiB', '256M', '1G', '4k', '1048576' -> bytes (binary units). ConfigError when malformed."""
    m = re.fullmatch(r"\s*(\d+)\s*([kKmMgGtT]?)(i?[bB])?\s*", text or "")
    if not m:
        raise ConfigError(f"--part-size: not a size: {text!r} (e.g. 256MiB, 1G, 65536)")
    n = int(m.group(1)) * 1024 ** " KMGT".index((m.group(2) or " ").upper())
    if n < 1:
        raise ConfigError("--part-size: must be at least 1 byte")
    return n


def default_key_dir() -> Path:
    base = os.environ.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
    return Path(base) / "builder"


def signing_key_path(opt: Path | None) -> Path:
    """--key, else $BUILDER_SIGNING_KEY (a path), else the keygen default; ConfigError when none exists."""
    if opt is not None:
        return opt
    env = os.environ.get(SIGNING_KEY_ENV)
    if env:
        return Path(env)
    p = default_key_dir() / "builder.key"
    if p.exists():
        return p
    raise ConfigError(
        f"no signing key: pass --key PATH or set {SIGNING_KEY_ENV} (make one with `builder keygen`)"
    )


def keygen(out_dir: Path | None, force: bool = False) -> tuple[Path, Path, str]:
    """Write builder.key (0600) and builder.pub in out_dir; return (secret path, public path, key id)."""
    from builder import sign

    d = out_dir if out_dir is not None else default_key_dir()
    d.mkdir(parents=True, exist_ok=True)
    sk, pk = d / "builder.key", d / "builder.pub"
    pub = sign.generate_keypair(sk, pk, force=force)
    return sk, pk, pub.key_id_hex


def load_context(pins_path: Path, lock_path: Path, store: Path) -> Context:
    root = pins_path.resolve().parent
    return Context(
        root=root, pins=load_pins(pins_path), lock=load_lock(lock_path), store=store, hosts_dir=root / "hosts"
    )


# --------------------------------------------------------------------------- models for a rank


def rank_models(ctx: Context, fleet: Fleet, host: Host, lane_name: str) -> list[dict[str, Any]]:
    """The model files this rank needs (builder.placement): {model, file, path (absolute on the host),
    size, sha256}, sorted by path."""
    return [
        {"model": f.model, "file": f.file, "path": f.path, "size": f.size, "sha256": f.sha256}
        for f in host_files(ctx.pins, ctx.lock, lane_name, host)
    ]


def model_source(ctx: Context, name: str, spec: HfModel, lm: LockedModel, rel: str) -> Path:
    """Where a locked model file is here: the pin's local folder (snapshot or HF cache), or the HF cache."""
    cands: list[Path] = []
    if spec.local:
        base = Path(spec.local) if Path(spec.local).is_absolute() else ctx.root / spec.local
        from builder.hf import repo_folder_name

        cands += [base / rel, base / "snapshots" / lm.commit / rel,
                  base / repo_folder_name(spec.repo) / "snapshots" / lm.commit / rel]
    hub = os.environ.get("HF_HUB_CACHE")
    if not hub:
        hf_home = os.environ.get("HF_HOME") or str(Path.home() / ".cache" / "huggingface")
        hub = str(Path(hf_home) / "hub")
    cands.append(Path(hub) / f"models--{spec.repo.replace('/', '--')}" / "snapshots" / lm.commit / rel)
    for c in cands:
        if c.is_file():
            return c
    raise ConfigError(
        f"models.{name}: {rel} not found locally (looked in {', '.join(str(c) for c in cands)}); "
        "fetch it or bundle without --with-models"
    )


# --------------------------------------------------------------------------- streaming writer


@dataclass
class _Written:
    path: str
    size: int
    sha256: str
    mode: str
    parts: list[dict[str, Any]] = field(default_factory=list)

    def entry(self) -> dict[str, Any]:
        e: dict[str, Any] = {"path": self.path, "size": self.size, "sha256": self.sha256, "mode": self.mode}
        if self.parts:
            e["parts"] = self.parts
        return e


def _readinto_fn(src: IO[bytes]) -> Callable[[memoryview], int]:
    """``src.readinto`` when the stream has one (files, pipes, BytesIO, BufferedReader), else read+copy."""
    fn = getattr(src, "readinto", None)
    if fn is not None:
        return fn  # type: ignore[no-any-return]

    def read_copy(view: memoryview) -> int:
        data = src.read(len(view))
        view[: len(data)] = data
        return len(data)

    return read_copy


_ALIGN = 4096
_O_DIRECT = getattr(os, "O_DIRECT", 0)


def _open_part(path: Path) -> tuple[int, bool]:
    """(fd, direct): a new part file, opened with O_DIRECT where the file system takes it.

    Measured here (4 GiB into 16 parts, warm source): buffered writes 5.5 s and 4 s of kernel CPU
    (page-cache copies, dirty-page throttling, writeback), O_DIRECT 2.2 s and 0.5 s. The bytes are
    the same either way; fsync still follows (device cache, metadata).
    """
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_CLOEXEC", 0)
    if _O_DIRECT:
        try:
            return os.open(path, flags | _O_DIRECT, 0o644), True
        except OSError:
            pass  # tmpfs and some others refuse O_DIRECT
    return os.open(path, flags, 0o644), False


def _buffered(fd: int) -> None:
    import fcntl

    fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~_O_DIRECT)


def _write_all(fd: int, view: memoryview, offset: int, direct: bool) -> bool:
    """Write view at the file's current offset; returns whether the fd is still O_DIRECT.

    O_DIRECT needs an aligned buffer (the mmap buffers are), offset and length: a short or unaligned
    chunk (a part's tail, a pipe's short read) switches the file to buffered writes for the rest.
    """
    if direct and (offset % _ALIGN or len(view) % _ALIGN):
        _buffered(fd)
        direct = False
    while view:
        try:
            n = os.write(fd, view)
        except OSError:
            if not direct:
                raise
            _buffered(fd)  # the file system refused this direct write: buffered from here on
            direct = False
            continue
        view = view[n:]
    return direct


def _sync_close(fd: int) -> None:
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_stream(src: IO[bytes], rel: str, dest: Path, part_size: int, mode: str) -> _Written:
    """Copy a stream into dest/rel, or into dest/parts/rel.partNNNN when it is larger than part_size.

    Hashes each part and the whole file on the way; every file written is fsynced (with its final
    mode) before this returns, so the caller only has to sync the directories.
    """
    whole = hashlib.sha256()
    total = 0
    parts: list[dict[str, Any]] = []
    part_dir = dest / "parts" / Path(rel).parent
    part_dir.mkdir(parents=True, exist_ok=True)

    def part_name(i: int) -> str:
        return f"parts/{rel}.part{i:04d}"

    # Performance (issue 6, bench/bundle.py). Every byte is hashed twice (its part's sha256 and the
    # whole file's). This thread only reads and writes (O_DIRECT where it can, see _open_part); the
    # two hashes run on two more threads (hashlib and os.write release the GIL), so a write waiting
    # on the disk does not hold up the hashing, and the hashes use both cores. Three page-aligned
    # buffers are reused, read with readinto and written from a memoryview: no allocation or copy per
    # chunk (a fresh 4 MiB bytes per read cost page faults and zeroing). A buffer is read into again
    # only once both hashes of its last chunk are done (three chunks in flight at most: memory stays
    # flat). A finished part is fsynced and closed on a fourth thread, overlapping the next part.
    from concurrent.futures import Future, ThreadPoolExecutor

    readinto = _readinto_fn(src)
    nbuf = 3
    bufs = [mmap.mmap(-1, READ_SIZE) for _ in range(nbuf)]  # page-aligned, as O_DIRECT needs
    views = [memoryview(b) for b in bufs]
    busy: list[list[Future[Any]]] = [[] for _ in range(nbuf)]
    which = 0
    syncs: list[Future[None]] = []
    digests: list[Future[str]] = []
    whole_ex = ThreadPoolExecutor(max_workers=1, thread_name_prefix="bundle-sha256-file")
    part_ex = ThreadPoolExecutor(max_workers=1, thread_name_prefix="bundle-sha256-part")
    syncer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="bundle-fsync")
    idx = 0
    fd = -1
    cur_hash = hashlib.sha256()
    in_part = 0
    direct = False

    def finish_part() -> None:
        nonlocal fd, idx, in_part
        os.fchmod(fd, 0o644)
        parts.append({"path": part_name(idx), "size": in_part, "sha256": ""})
        digests.append(part_ex.submit(cur_hash.hexdigest))  # after this part's updates (one worker, in order)
        syncs.append(syncer.submit(_sync_close, fd))
        fd = -1
        idx += 1
        in_part = 0

    try:
        while True:
            for f in busy[which]:
                f.result()  # both hashes of this buffer's last chunk are done: it may be reused
            busy[which] = []
            want = min(READ_SIZE, part_size - in_part)
            view = views[which][:want]
            n = readinto(view)
            if not n:
                break
            chunk = view[:n]
            if fd < 0:
                fd, direct = _open_part(dest / part_name(idx))
                cur_hash, in_part = hashlib.sha256(), 0
            busy[which] = [whole_ex.submit(whole.update, chunk), part_ex.submit(cur_hash.update, chunk)]
            direct = _write_all(fd, chunk, in_part, direct)
            in_part += n
            total += n
            which = (which + 1) % nbuf
            if in_part >= part_size:
                finish_part()
        if fd >= 0:
            finish_part()
        for b in busy:
            for f in b:
                f.result()
        for p, d in zip(parts, digests, strict=True):
            p["sha256"] = d.result()
        for s in syncs:
            s.result()  # an fsync error surfaces here
    finally:
        whole_ex.shutdown(wait=True)
        part_ex.shutdown(wait=True)
        syncer.shutdown(wait=True)
        if fd >= 0:
            os.close(fd)
    target = dest / rel
    target.parent.mkdir(parents=True, exist_ok=True)
    if len(parts) <= 1:
        if parts:
            os.chmod(dest / parts[0]["path"], int(mode, 8))
            os.replace(dest / parts[0]["path"], target)
        else:
            _sync_close(os.open(target, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644))
        os.chmod(target, int(mode, 8))
        _prune_empty(dest / "parts")
        return _Written(rel, total, whole.hexdigest(), mode)
    return _Written(rel, total, whole.hexdigest(), mode, parts)


def write_bytes(data: bytes, rel: str, dest: Path, part_size: int, mode: str) -> _Written:
    import io

    return write_stream(io.BytesIO(data), rel, dest, part_size, mode)


def _prune_empty(d: Path) -> None:
    if not d.is_dir():
        return
    for dirpath, _dirs, _files in sorted(os.walk(d, topdown=False), key=lambda t: -len(t[0])):
        with contextlib.suppress(OSError):
            os.rmdir(dirpath)


# --------------------------------------------------------------------------- the image archive


@contextlib.contextmanager
def image_archive(
    image_id: str, work: Path, *, tag: str | None = None, mtime: int = 0
) -> Iterator[IO[bytes]]:
    """A `docker load` archive of the image, streamed, byte-identical for the same image.

    builder.layers re-exports the saved image canonically (sorted entries, fixed mtime, the config and
    layers untouched, every DiffID checked; spooled through ``work``). Without it (no docker SDK),
    `docker save IMAGE_ID` is used, whose bytes on the classic store are a function of the image too.
    """
    try:
        from builder import dockerio, layers
    except ImportError:
        with _docker_save(image_id) as stream:
            yield stream
        return
    if not dockerio.image_exists(image_id):
        raise ConfigError(
            f"--with-image: image {image_id} is not in the local Docker Engine (run `builder image`)"
        )
    record = layers.read_image(dockerio.save(image_id), work)
    if record.image_id != image_id:
        raise VerifyError(f"--with-image: the engine saved {record.image_id} for {image_id}")
    chunks = layers.archive_chunks(record, repo_tags=[tag] if tag else [], mtime=mtime)
    yield io.BufferedReader(ChunkReader(iter(chunks)), buffer_size=READ_SIZE)  # type: ignore[arg-type]


@contextlib.contextmanager
def _docker_save(image_id: str) -> Iterator[IO[bytes]]:
    exe = shutil.which("docker")
    if exe is None:
        raise ConfigError("--with-image: docker CLI not found")
    chk = subprocess.run(
        [exe, "image", "inspect", "--format", "{{.Id}}", image_id], capture_output=True, timeout=60
    )
    if chk.returncode != 0 or chk.stdout.decode().strip() != image_id:
        raise ConfigError(
            f"--with-image: image {image_id} is not in the local Docker Engine (run `builder image`)"
        )
    proc = subprocess.Popen([exe, "save", image_id], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stdout is not None
    try:
        yield proc.stdout
        proc.stdout.close()
        err = proc.stderr.read() if proc.stderr else b""
        if proc.wait(timeout=3600) != 0:
            raise BuilderError(
                f"docker save {image_id[:19]}: {err.decode('utf-8', 'replace').strip()[-200:]}"
            )
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


# --------------------------------------------------------------------------- making a bundle


def _lane_checks(ctx: Context, fleet_path: Path, fleet: Fleet) -> str:
    check_against_pins(fleet_path, fleet, set(ctx.pins.lanes), set(ctx.lock.lanes))
    name = fleet.fleet.lane
    lane = ctx.pins.lanes[name]
    if ctx.lock.lanes[name].spec_hash != spec_hash(lane):
        raise ConfigError(f"lanes.{name}: changed since the lock (run `builder lock {name}`)")
    if lane.serve.tensor_parallel != len(fleet.hosts):
        raise ConfigError(
            f"{fleet_path}: fleet {fleet.fleet.name} has {len(fleet.hosts)} hosts but lane {name} "
            f"has tensor_parallel = {lane.serve.tensor_parallel}"
        )
    return name


def make_bundle(ctx: Context, host_ref: str, opts: BundleOptions) -> BundleResult:
    fleet_path, fleet, host = find_host(ctx.hosts_dir, host_ref)
    out = opts.out if opts.out is not None else ctx.root / "out" / "bundles" / fleet.fleet.name / host.name
    return _make(ctx, fleet_path, fleet, host, out, opts)


def make_fleet_bundles(ctx: Context, fleet_name: str, opts: BundleOptions) -> list[BundleResult]:
    fleet_path, fleet = find_fleet(ctx.hosts_dir, fleet_name)
    base = opts.out if opts.out is not None else ctx.root / "out" / "bundles" / fleet.fleet.name
    _lane_checks(ctx, fleet_path, fleet)
    return [_make(ctx, fleet_path, fleet, h, base / h.name, opts) for h in fleet.by_rank()]


def _make(
    ctx: Context, fleet_path: Path, fleet: Fleet, host: Host, out: Path, opts: BundleOptions
) -> BundleResult:
    from builder import sign
    from builder.imagerecord import require_record
    from builder.plan import make_plan

    if opts.part_size < 1:
        raise ConfigError("--part-size: must be at least 1 byte")
    lane_name = _lane_checks(ctx, fleet_path, fleet)
    lane = ctx.pins.lanes[lane_name]
    plan = make_plan(ctx.pins, ctx.lock, lane.image, ctx.root)
    rec = require_record(ctx.store, lane.image, plan.address)
    models = rank_models(ctx, fleet, host, lane_name)
    secret = sign.load_secret_key(signing_key_path(opts.key))  # fail early (exit 2), before any write

    image = {
        "name": lane.image,
        "input_address": rec.input_address,
        "image_id": rec.image_id,
        "diff_ids": list(rec.diff_ids),
    }
    mounts = sorted({(m["model"], m["path"].rsplit("/" + m["file"], 1)[0]) for m in models})
    launch = render_launch(
        fleet,
        host,
        lane_name,
        lane,
        image,
        [{"model": m["model"], "path": m["path"], "size": m["size"], "sha256": m["sha256"]} for m in models],
        [ModelMount(model=a, path=b) for a, b in mounts],
    )

    parent = out.parent
    parent.mkdir(parents=True, exist_ok=True)
    with file_lock(parent / f".{out.name}.lock"):
        for stale in parent.glob(f".tmp-{out.name}-*"):
            shutil.rmtree(stale, ignore_errors=True)
        tmp = parent / f".tmp-{out.name}-{os.getpid()}-{secrets.token_hex(4)}"
        tmp.mkdir(mode=0o755)
        try:
            written: list[_Written] = []
            for rel, (data, mode) in sorted(launch.items()):
                written.append(write_bytes(data, rel, tmp, opts.part_size, mode))
            written.append(write_bytes(inst.assemble(), "install.py", tmp, opts.part_size, "0755"))
            archive = None
            if opts.with_image:
                work = tmp.parent / f"{tmp.name}-work"
                try:
                    with image_archive(
                        rec.image_id, work, tag=rec.tag, mtime=rec.source_date_epoch
                    ) as stream:
                        written.append(write_stream(stream, inst.IMAGE_ARCHIVE, tmp, opts.part_size, "0644"))
                finally:
                    shutil.rmtree(work, ignore_errors=True)
                archive = inst.IMAGE_ARCHIVE
            model_entries = []
            for m in models:
                bundled = None
                if opts.with_models:
                    spec, lm = ctx.pins.models[m["model"]], ctx.lock.models[m["model"]]
                    src = model_source(ctx, m["model"], spec, lm, m["file"])
                    bundled = f"models/{m['model']}/{m['file']}"
                    # Unbuffered: write_stream reads into its own buffers (one copy, no bytes objects).
                    # The same single read is both the lock check (the whole-file sha256 below) and
                    # the copy into parts: nothing reads the model file twice.
                    with open(src, "rb", buffering=0) as f:
                        with contextlib.suppress(AttributeError, OSError):
                            os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_SEQUENTIAL)
                        w = write_stream(f, bundled, tmp, opts.part_size, "0644")
                    if (w.size, w.sha256) != (m["size"], m["sha256"]):
                        raise VerifyError(
                            f"{src}: size or sha256 differ from the lock (models.{m['model']}: {m['file']})"
                        )
                    written.append(w)
                model_entries.append({**m, "bundled": bundled})
            body: dict[str, Any] = {
                "format": inst.FORMAT,
                "kind": inst.KIND,
                "builder": __version__,
                "fleet": fleet.fleet.name,
                "host": host.name,
                "lane": lane_name,
                "rank": host.rank,
                "role": host.role,
                "world_size": len(fleet.hosts),
                "lock_hash": ctx.lock.lock_hash(),
                "image": {**image, "archive": archive},
                "paths": {
                    "bundles": host.paths.bundles,
                    "models": host.paths.models,
                    "engram": host.paths.engram,
                },
                "files": sorted((w.entry() for w in written), key=lambda e: e["path"]),
                "models": model_entries,
            }
            bid = hashlib.sha256(canonical_json(body)).hexdigest()
            manifest = {**body, "bundle_id": bid}
            inst.check_manifest(manifest)  # the installer must accept what we write
            mbytes = pretty_json(manifest)
            (tmp / inst.MANIFEST).write_bytes(mbytes)
            os.chmod(tmp / inst.MANIFEST, 0o644)
            sig = sign.sign(mbytes, secret, inst.trusted_comment_for(manifest))
            (tmp / inst.SIGNATURE).write_text(sig, encoding="utf-8")
            os.chmod(tmp / inst.SIGNATURE, 0o644)
            # Durability before the rename: every file (write_stream already fsynced the data it
            # wrote, so this is cheap for those; it catches the manifest, the signature and the
            # modes set after), then every folder, deepest first, so each entry is on disk.
            for dirpath, _dirs, files in sorted(os.walk(tmp), key=lambda t: -len(t[0])):
                os.chmod(dirpath, 0o755)
                for fn in files:
                    with open(os.path.join(dirpath, fn), "rb") as fh:
                        os.fsync(fh.fileno())
                fsync_dir(dirpath)
            unchanged = False
            with contextlib.suppress(OSError):
                unchanged = (out / inst.MANIFEST).read_bytes() == mbytes
            _replace_dir(tmp, out)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    total = sum(w.size for w in written)
    return BundleResult(
        fleet=fleet.fleet.name,
        host=host.name,
        rank=host.rank,
        path=out,
        bundle_id=bid,
        files=len(written),
        size=total,
        unchanged=unchanged,
        parts=sum(len(w.parts) for w in written),
    )


def _replace_dir(new: Path, out: Path) -> None:
    """Put the finished folder at out; an old one goes aside first and is removed after."""
    old = None
    if out.exists() or out.is_symlink():
        old = out.parent / f".tmp-{out.name}-old-{os.getpid()}-{secrets.token_hex(4)}"
        os.rename(out, old)
    os.rename(new, out)
    fsync_dir(out.parent)
    if old is not None:
        if old.is_dir() and not old.is_symlink():
            shutil.rmtree(old, ignore_errors=True)
        else:
            old.unlink()


# --------------------------------------------------------------------------- verifying


def crypto_sig_check(mbytes: bytes, sbytes: bytes, kbytes: bytes) -> str:
    from builder import sign

    return sign.verify(mbytes, sbytes, kbytes, source=inst.SIGNATURE)


def read_public_key(path: Path) -> bytes:
    try:
        data = path.read_bytes()[: 64 * 1024]
    except FileNotFoundError:
        raise ConfigError(f"{path}: public key file not found") from None
    except OSError as e:
        raise ConfigError(f"{path}: cannot read public key: {e.strerror}") from None
    from builder import sign

    sign.load_public_key(path)  # malformed -> ConfigError
    return data


def fleet_trusted_key(root: Path, fleet_name: str) -> Path | None:
    """The fleet's trusted_key (relative to the project root) when the inventory names one."""
    hosts_dir = root / "hosts"
    if not hosts_dir.is_dir():
        return None
    try:
        _, fleet = find_fleet(hosts_dir, fleet_name)
    except ConfigError:
        return None
    if not fleet.fleet.trusted_key:
        return None
    p = Path(fleet.fleet.trusted_key)
    return p if p.is_absolute() else root / p


def public_key_for(bundle_dir: Path, key: Path | None, root: Path | None) -> Path:
    """--key, else the fleet's trusted_key (from the inventory), else the keygen default public key."""
    if key is not None:
        return key
    if root is not None:
        with contextlib.suppress(Exception):
            import json

            fleet_name = json.loads((bundle_dir / inst.MANIFEST).read_bytes())["fleet"]
            p = fleet_trusted_key(root, str(fleet_name))
            if p is not None:
                return p
    p = default_key_dir() / "builder.pub"
    if p.exists():
        return p
    raise ConfigError(
        "no public key to verify with: pass --key PUB (or set fleet.trusted_key in the inventory)"
    )


def verify_dir(bundle_dir: Path, key_path: Path) -> dict[str, Any]:
    """Signature, then every hash. VerifyError (exit 1) naming what is wrong; returns the manifest."""
    return verify_with_key(bundle_dir, read_public_key(key_path))


def verify_with_key(bundle_dir: Path, kbytes: bytes) -> dict[str, Any]:
    """As verify_dir, with the public key's text."""
    try:
        manifest, _, _ = inst.verify_bundle(str(bundle_dir), kbytes, sig_check=crypto_sig_check)
    except inst.InstallError as e:
        if e.code == inst.EXIT_CONFIG:
            raise ConfigError(str(e)) from None
        raise VerifyError(str(e)) from None
    return manifest
