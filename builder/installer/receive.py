"""``receive``: a bundle streamed by ``builder ship`` on stdin, each byte hashed once as it arrives
into the file it ends up in, then installed (the protocol is below)."""

# ruff: noqa: UP031
from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import hashlib
import json
import os
import shutil
import stat
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from builder.core.atomic import atomic_write, clean_stale_tmp, fsync_dir, fsync_file, tmp_stem
from builder.core.digest import READ_SIZE
from builder.core.fastmode import fast_mode_drift

from . import kept
from .blobs import check_room, from_registry, pull_models
from .engine import Load, docker_root, image_present, pull_image
from .errors import EXIT_CONFIG, InstallError, say
from .files import WRITEBACK_STEP, Writeback, write_all
from .install import Admission, check_image_source, host_key, host_record, registry_ca, vouching
from .manifest import HEX64, MANIFEST, MAX_MANIFEST, SIGNATURE, release_files
from .record import model_ok, release_ok, release_ok_file
from .release import mark_staged, stage_release, switch_in
from .root import Root
from .verify import check_signed

RECEIVE_MAGIC = b"builder-receive 1\n"
RECEIPTS = ".received.json"


def _read_exact(inp: Any, n: int, what: str) -> bytes:
    out = bytearray()
    while len(out) < n:
        chunk = inp.read(n - len(out))
        if not chunk:
            raise InstallError("%s: the stream ended early (%d of %d bytes)" % (what, len(out), n))
        out += chunk
    return bytes(out)


def read_header(inp: Any) -> tuple[bytes, bytes]:
    """(manifest bytes, signature bytes) from the start of a receive stream."""
    if _read_exact(inp, len(RECEIVE_MAGIC), "receive") != RECEIVE_MAGIC:
        raise InstallError("receive: not a builder receive stream", EXIT_CONFIG)
    line = inp.readline(64)
    try:
        nm, ns = (int(x) for x in line.split())
    except ValueError:
        raise InstallError("receive: malformed header", EXIT_CONFIG) from None
    if not (0 < nm <= MAX_MANIFEST and 0 <= ns <= 64 * 1024):
        raise InstallError("receive: manifest or signature too large", EXIT_CONFIG)
    return _read_exact(inp, nm, MANIFEST), _read_exact(inp, ns, SIGNATURE)


class _Incoming:
    """One manifest file the host needs: where it is written, how much of it is already there."""

    def __init__(self, entry: dict[str, Any], dest: str) -> None:
        self.entry = entry
        self.dest = dest
        self.offset = 0
        self.whole = hashlib.sha256()
        self.part = hashlib.sha256()
        self.part_index = 0
        self.in_part = 0
        #: (offset, whole-file hash) at the end of the last part that checked out
        self.mark: tuple[int, Any] = (0, self.whole.copy())
        self.failed = False

    @property
    def path(self) -> str:
        return str(self.entry["path"])

    def pieces(self) -> list[dict[str, Any]]:
        return self.entry.get("parts") or [self.entry]

    def _feed(self, view: memoryview) -> None:
        """Hash the bytes at self.offset on (split at part ends); InstallError on a damaged part
        (and nothing more is hashed after it)."""
        if self.failed:
            return
        pieces = self.pieces()
        parted = len(pieces) > 1
        while view:
            p = pieces[self.part_index]
            take = min(len(view), p["size"] - self.in_part)
            chunk = view[:take]
            (self.part if parted else self.whole).update(chunk)  # one hash per byte
            self.in_part += take
            self.offset += take
            view = view[take:]
            if self.in_part == p["size"] and len(pieces) > 1:
                if self.part.hexdigest() != p["sha256"]:
                    self.failed = True
                    raise InstallError("%s: sha256 mismatch (damaged part)" % p["path"])
                self.mark = (self.offset, self.whole.copy())
                self.part_index = min(self.part_index + 1, len(pieces) - 1)
                self.part, self.in_part = hashlib.sha256(), 0

    def _back_to_mark(self) -> None:
        """Forget what follows the last part that checked out (a damaged part is received again)."""
        self.offset, whole = self.mark
        self.whole = whole.copy()
        self.failed = False
        self.part, self.in_part = hashlib.sha256(), 0
        at, self.part_index = 0, 0
        for i, p in enumerate(self.pieces()):
            if at >= self.offset:
                self.part_index = i
                break
            at += p["size"]

    def resume(self) -> None:
        """Hash what an earlier, cut receive left in dest: the offset to ask for from there."""
        try:
            have = os.stat(self.dest).st_size
        except FileNotFoundError:
            return
        if have > self.entry["size"]:
            os.truncate(self.dest, 0)
            return
        buf = bytearray(READ_SIZE)
        view = memoryview(buf)
        with open(self.dest, "rb", buffering=0) as f:
            try:
                while self.offset < have:
                    n = f.readinto(view[: min(READ_SIZE, have - self.offset)])
                    if not n:
                        break
                    self._feed(view[:n])
            except InstallError:
                self._back_to_mark()
        os.truncate(self.dest, self.offset)

    @property
    def big(self) -> bool:
        """A file whose receipt is worth its fsync: a resume would otherwise hash it all again (a
        smaller one is hashed again in no time, and fsynced with the others once all are in)."""
        return int(self.entry["size"]) >= WRITEBACK_STEP

    def receive(self, inp: Any, on_bytes: Callable[[int], None] | None = None) -> None:
        """Read the rest of the file from inp into dest, hashing as it arrives; check it whole; a
        big file is fsynced (its writeback started as it arrives, see Writeback).

        The hashing runs on a thread of its own, a chunk behind the reads and writes (hashlib
        releases the GIL), so receiving is bounded by the slower of the two, not their sum. Three
        buffers: one is read into while the others wait for their hash."""
        os.makedirs(os.path.dirname(self.dest), exist_ok=True)
        size = self.entry["size"]
        fd = os.open(self.dest, os.O_WRONLY | os.O_CREAT, 0o644)
        hasher = ThreadPoolExecutor(max_workers=1, thread_name_prefix="receive-sha256")
        bufs = [bytearray(READ_SIZE) for _ in range(3)]
        pending: list[Any] = [None, None, None]
        wb = Writeback(fd, self.offset)
        try:
            os.ftruncate(fd, self.offset)
            os.lseek(fd, self.offset, os.SEEK_SET)
            got, i = self.offset, 0
            try:
                while got < size:
                    if pending[i] is not None:
                        pending[i].result()  # its hash is done (a damaged part raises here)
                    view = memoryview(bufs[i])
                    n = _fill(inp, view[: min(READ_SIZE, size - got)])
                    if not n:
                        raise InstallError(
                            "%s: the stream ended at byte %d of %d (ship again to resume)" % (self.path, got, size)
                        )
                    write_all(fd, view[:n], wb)
                    pending[i] = hasher.submit(self._feed, view[:n])
                    got += n
                    i = (i + 1) % 3
                    if on_bytes is not None:
                        on_bytes(n)
                for f in pending:
                    if f is not None:
                        f.result()
            except InstallError:
                for f in pending:
                    if f is not None:
                        with contextlib.suppress(InstallError):
                            f.result()
                if self.failed:  # a damaged part: keep what checked out, drop the rest
                    self._back_to_mark()
                    os.ftruncate(fd, self.offset)
                raise
            if len(self.pieces()) == 1 and self.whole.hexdigest() != self.entry["sha256"]:
                os.unlink(self.dest)
                raise InstallError(
                    "%s: sha256 mismatch (the bytes received are not the signed ones; removed)" % self.path
                )
            if self.big:
                os.fsync(fd)
        finally:
            hasher.shutdown(wait=True)
            os.close(fd)


def _fill(inp: Any, view: memoryview) -> int:
    """Read into all of view (a pipe gives at most its buffer per read), or until the stream ends:
    one hash and one write per buffer, not per pipe read."""
    n = 0
    while n < len(view):
        k = inp.readinto(view[n:])
        if not k:
            break
        n += k
    return n


#: Linux's F_SETPIPE_SZ: a larger pipe for the stream (fewer, larger reads)
F_SETPIPE_SZ = 1031
PIPE_SIZE = 1 << 20


def widen_pipe(fd: int) -> None:
    """Ask for a 1 MiB pipe buffer where fd is a pipe (Linux; elsewhere, or when refused, nothing)."""
    with contextlib.suppress(OSError, ValueError):
        if stat.S_ISFIFO(os.fstat(fd).st_mode):
            fcntl.fcntl(fd, F_SETPIPE_SZ, PIPE_SIZE)


def _receipts(path: str) -> dict[str, Any]:
    try:
        with open(path, "rb") as f:
            obj = json.loads(f.read(MAX_MANIFEST).decode("utf-8"))
    except (OSError, ValueError):
        return {}
    return obj if isinstance(obj, dict) else {}


def _received_whole(receipts: dict[str, Any], inc: _Incoming) -> bool:
    """Does an earlier receive's receipt still vouch for dest (fast mode's rule)?"""
    try:
        st = os.stat(inc.dest)
    except OSError:
        return False
    e = inc.entry
    return fast_mode_drift(receipts.get(inc.dest), e["sha256"], e["size"], st.st_size, st.st_mtime_ns,
                           st.st_ino) is None


@dataclasses.dataclass
class _Survey:
    """What the host holds of a bundle, found before anything is asked for: the records that vouch for
    placed files, the model files to place, whether its release is there whole, what differs on the
    host (a repair names it), the image's layers the engine holds, and (an archive to load) the
    engine's root, still being asked."""

    vouch: list[dict[str, Any] | None]
    placing: list[dict[str, Any]]
    release_there: bool
    differed: list[str]
    have_layers: Any
    root_q: Future[Any] | None


def _survey(r: Root, manifest: dict[str, Any], mbytes: bytes, old: dict[str, Any] | None,
            admit: Admission) -> _Survey:
    bid = manifest["bundle_id"]
    img = manifest["image"]
    # the engine's answers (each a docker CLI start and an API call) while the files are checked
    asked = ThreadPoolExecutor(max_workers=2, thread_name_prefix="docker")
    layers_q = asked.submit(image_present, img["image_id"])
    root_q = asked.submit(docker_root) if img["archive"] is not None else None
    asked.shutdown(wait=False)
    vouch = vouching(r, old, admit)
    placing = [m for m in manifest["models"] if model_ok(m, vouch) is not None]
    release_there = os.path.isdir(r.release(bid)) and release_ok(r.release(bid), manifest, mbytes)
    # what differs on the host from the manifest (a repair names it): model files to place again, and
    # the launch files of a release already there whose bytes changed
    differed = [m["path"] for m in placing if os.path.lexists(m["path"])]
    if os.path.isdir(r.release(bid)) and not release_there:
        differed += [fe["path"] for fe in release_files(manifest)
                     if not release_ok_file(os.path.join(r.release(bid), fe["path"]), fe)]
    return _Survey(vouch=vouch, placing=placing, release_there=release_there, differed=differed,
                   have_layers=layers_q.result(), root_q=root_q)


def _reply(out: Any, obj: dict[str, Any]) -> None:
    out.write((json.dumps(obj, sort_keys=True) + "\n").encode("utf-8"))
    out.flush()


def _unchanged(r: Root, manifest: dict[str, Any], mbytes: bytes, old: dict[str, Any] | None,
               current: str | None, survey: _Survey, admit: Admission, out: Any) -> dict[str, Any] | None:
    """The result when the host holds the bundle whole, staged (with admit.stage) or installed and
    current: nothing is wanted (the reply says so). None otherwise."""
    bid = manifest["bundle_id"]
    ready = survey.have_layers is not None and survey.release_there and not survey.placing
    if admit.stage and ready and r.link("staged") == bid and r.read_record(r.staged_record):
        _reply(out, {"want": []})
        say("bundle %s is already staged; nothing to do" % bid[:16])
        return {"result": "unchanged", "bundle_id": bid, "release": r.release(bid), "received": []}
    if ready and current == bid and old and old.get("bundle_id") == bid:
        _reply(out, {"want": []})
        say("bundle %s is already installed; nothing to do" % bid[:16])
        if admit.stage:
            mark_staged(r, manifest, mbytes, old.get("previous_bundle_id"))
        return {"result": "unchanged", "bundle_id": bid, "release": r.release(bid), "received": []}
    return None


def _wanted(manifest: dict[str, Any], inc_dir: str, survey: _Survey,
            load: bool) -> tuple[_Incoming | None, list[_Incoming], list[_Incoming]]:
    """The files to receive, in the order they are asked for: the image archive first (``load``), so
    that docker load runs while the rest arrives; the release's files (unless there whole); the model
    files last. Returns (the archive's, all of them, the model files' in survey.placing's order)."""
    bid = manifest["bundle_id"]
    img = manifest["image"]
    files = {f["path"]: f for f in manifest["files"]}
    archive = _Incoming(files[img["archive"]], os.path.join(inc_dir, img["archive"])) if load else None
    wanted: list[_Incoming] = [archive] if archive is not None else []
    if not survey.release_there:
        wanted += [_Incoming(fe, os.path.join(inc_dir, fe["path"])) for fe in release_files(manifest)]
    models: list[_Incoming] = []
    for m in survey.placing:
        if from_registry(m):  # (pulled from the fleet registry after the stream)
            continue
        if m["bundled"] is None:
            raise InstallError(
                "model file %s: %s (the bundle does not carry it; copy it there or bundle "
                "with --with-models)" % (m["path"], model_ok(m, survey.vouch))
            )
        # named by the bundle, not the process: a cut receive of this bundle resumes into it
        d, mine = os.path.dirname(m["path"]), tmp_stem(m["path"]) + "recv-" + bid[:16]
        clean_stale_tmp(m["path"], keep=mine)  # what a receive of another bundle left for this file
        models.append(_Incoming(files[m["bundled"]], os.path.join(d, mine)))
    return archive, wanted + models, models


def _registry_ca(r: Root, inc_dir: str, manifest: dict[str, Any]) -> str | None:
    """The bundle's CA file of the fleet registry: as received, else in its release, already there."""
    ca = registry_ca(inc_dir, manifest)
    if ca is not None and not os.path.isfile(ca):
        ca = registry_ca(r.release(manifest["bundle_id"]), manifest)
    return ca


def _drop_other_receives(r: Root, bid: str) -> None:
    """Another bundle's unfinished receive: its disk back."""
    for n in os.listdir(r.incoming) if os.path.isdir(r.incoming) else []:
        if HEX64.match(n) and n != bid:
            shutil.rmtree(os.path.join(r.incoming, n), ignore_errors=True)


def _still_wanted(wanted: list[_Incoming], receipts: dict[str, Any]) -> list[_Incoming]:
    """The files an earlier receive's receipt does not vouch for, each resumed from what is there."""
    todo = []
    for w in wanted:
        if _received_whole(receipts, w):
            continue
        w.resume()
        todo.append(w)
    return todo


def _take_stream(inp: Any, todo: list[_Incoming], archive: _Incoming | None, img: dict[str, Any],
                 receipts: dict[str, Any], receipts_path: str) -> tuple[int, Load | None]:
    """Receive every file of todo from inp, in order; a big one's receipt kept as it is in; the image
    archive's docker load started once its every byte is in. Returns (bytes received, the load, running)."""
    got = 0
    loading: Load | None = None
    try:
        if archive is not None and archive not in todo:  # received whole by an earlier, cut ship
            loading = Load(img, archive.entry["size"], archive.dest)
        for w in todo:
            start = w.offset
            w.receive(inp)
            got += w.entry["size"] - start
            if w.big:  # (fsynced: its receipt may vouch for it)
                st = os.stat(w.dest)
                receipts[w.dest] = {"size": st.st_size, "sha256": w.entry["sha256"],
                                    "mtime": st.st_mtime_ns, "inode": st.st_ino}
                atomic_write(receipts_path, json.dumps(receipts, sort_keys=True).encode("utf-8"))
            if w is archive:  # its every byte is in and checked: docker load reads it while the rest arrives
                loading = Load(img, w.entry["size"], w.dest)
        # every wanted byte is in and checked: the small files on disk, then load, place, stage, switch
        for w in todo:
            if not w.big:
                fsync_file(w.dest)
    except BaseException:
        if loading is not None:
            with contextlib.suppress(InstallError):
                loading.finish()
        raise
    return got, loading


def _place_models(manifest: dict[str, Any], placing: list[dict[str, Any]], models: list[_Incoming],
                  pulled: list[tuple[str, str]], record: dict[str, Any] | None) -> None:
    """Each received model file (and each one pulled from the fleet registry) moved to its path (the file it
    replaces kept for the running release, whose apply record is ``record``: builder.installer.kept), then
    each folder they went into fsynced."""
    carried = [m for m in placing if not from_registry(m)]
    for i, m in enumerate(carried):
        w = models[i]  # (zip's strict= is newer than python 3.8)
        say("placing model file %s" % m["path"])
        os.chmod(w.dest, 0o644)
        kept.place(manifest, w.dest, m["path"], record)
    for tmp, dest in pulled:
        say("placing model file %s" % dest)
        kept.place(manifest, tmp, dest, record)
    for d in sorted({os.path.dirname(m["path"]) for m in placing}):
        fsync_dir(d)


def receive(
    root: str, inp: Any, out: Any, admit: Admission = Admission()  # noqa: B008  (frozen, so one shared default is safe)
) -> dict[str, Any]:
    """Receive a bundle streamed on inp (the protocol above) and install it; the wanted list goes to out."""
    r = Root(root)
    mbytes, sbytes = read_header(inp)
    with r.locked(admit.lock_timeout):
        r.clean_temps()
        key, new_key = host_key(r, admit.trusted_key, admit.insecure)
        manifest = check_signed(mbytes, sbytes, key, admit.insecure)
        bid = manifest["bundle_id"]
        old = host_record(r, manifest, admit.host)
        current = r.link("current")
        img = manifest["image"]
        survey = _survey(r, manifest, mbytes, old, admit)
        done = _unchanged(r, manifest, mbytes, old, current, survey, admit, out)
        if done is not None:
            return done
        check_image_source(img, survey.have_layers)
        inc_dir = os.path.join(r.incoming, bid)
        load = survey.have_layers is None and img["archive"] is not None
        archive, wanted, models = _wanted(manifest, inc_dir, survey, load)
        _drop_other_receives(r, bid)
        receipts_path = os.path.join(inc_dir, RECEIPTS)
        receipts = _receipts(receipts_path)
        todo = _still_wanted(wanted, receipts)
        needs = [(w.dest, w.entry["size"] - w.offset) for w in todo]
        pulling = [m for m in survey.placing if from_registry(m)]
        if archive is not None and survey.root_q is not None:
            needs.append((survey.root_q.result() or r.root, 2 * archive.entry["size"]))
        check_room(needs, pulling, admit.reserve, manifest["host"])
        _reply(out, {"want": [[w.path, w.offset] for w in todo]})
        got, loading = _take_stream(inp, todo, archive, img, receipts, receipts_path)
        try:
            pulled = pull_models(pulling, _registry_ca(r, inc_dir, manifest), manifest["host"])
        except BaseException:
            if loading is not None:
                with contextlib.suppress(InstallError):
                    loading.finish()
            raise
        if loading is not None:
            loading.finish()
        elif survey.have_layers is None:
            pull_image(manifest)
        _place_models(manifest, survey.placing, models, pulled.files, r.read_record())
        if not survey.release_there:
            stage_release(r, inc_dir, {**manifest, "files": [
                {k: v for k, v in f.items() if k != "parts"} for f in manifest["files"]]}, mbytes, sbytes,
                link=True)
        res = switch_in(r, manifest, mbytes, admit.stage, current, admit.trusted_key if new_key else None)
        shutil.rmtree(inc_dir, ignore_errors=True)
        res["received"] = [w.path for w in todo]
        res["bytes_received"] = got
        res["pulled"] = pulled.tally()
        res["differed"] = survey.differed
        return res
