"""`builder fetch`: the locked files hosts get into the model store, each verified, each byte fetched once.

What hosts get (builder.placement): the lanes' model files, and their runtime inputs, each file of a
kit (``[kits]``) and each plain file a lane mounts (``[files]``), all by sha256 in one store.

For every selected locked file: an object already in the store with the locked size is kept (its
view linked); else a local copy (a model's `local` folder or the Hugging Face cache, a kit's `local`
folder, a plain file's project path or ``file://`` URL) is imported after hashing (a hard link on the
same file system); else a kit's file is written from its git source's tree at the locked commit (the
mirror `builder lock` keeps; offline too); else, unless offline, a model file is downloaded from the
Hub at the locked commit (`HF_ENDPOINT`, `HF_TOKEN`) and a plain file from its URL, hashed while it
arrives. A Hub download that is cut resumes from its partial file with an HTTP Range request (the
partial bytes are hashed again first, so no byte is trusted unread); a file whose bytes are not the
locked ones is removed and named. The token is sent only as the Authorization header and never printed.
"""

from __future__ import annotations

import hashlib
import os
import secrets
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from builder import fetch as plain
from builder import kits
from builder.errors import BuilderError, ConfigError, ResolveError, VerifyError
from builder.lockfile import Lock
from builder.models.store import ModelStore, Wanted
from builder.pins import Pins
from builder.placement import PlacedFile, file_name

CHUNK = 4 * 1024 * 1024
TIMEOUT = 60.0

#: progress callback: (the file just finished, or None mid-download; bytes to add to the total done)
OnBytes = Callable[[Wanted | None, int], None]


@dataclass
class FetchReport:
    present: list[Wanted] = field(default_factory=list)
    imported: list[Wanted] = field(default_factory=list)
    downloaded: list[Wanted] = field(default_factory=list)
    missing: list[Wanted] = field(default_factory=list)
    failed: list[tuple[Wanted, str]] = field(default_factory=list)
    #: store objects whose bytes had changed (found by --verify), removed and fetched again
    repaired: list[tuple[Wanted, str]] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        def names(ws: list[Wanted]) -> list[str]:
            return [f"{w.model}/{w.path}" for w in ws]

        return {
            "present": names(self.present),
            "imported": names(self.imported),
            "downloaded": names(self.downloaded),
            "missing": names(self.missing),
            "failed": {f"{w.model}/{w.path}": why for w, why in self.failed},
            "repaired": {f"{w.model}/{w.path}": why for w, why in self.repaired},
        }


def wanted_for(lock: Lock, f: PlacedFile) -> Wanted:
    """The store's entry for a placed file (builder.placement): a model's, a kit's or a plain file's."""
    if f.role == "kit":
        return Wanted(model=f.model, commit=lock.kits[f.model].version, path=f.file, size=f.size,
                      sha256=f.sha256, kind="kits")
    if f.role == "file":
        return Wanted(model=f.model, commit=f.sha256, path=f.file, size=f.size, sha256=f.sha256, kind="files")
    return Wanted(model=f.model, commit=lock.models[f.model].commit, path=f.file, size=f.size, sha256=f.sha256)


def _kit_files(lock: Lock, name: str) -> list[Wanted]:
    lk = lock.kits.get(name)
    if lk is None:
        raise ConfigError(f"kits.{name}: not in the lock (run `builder lock {name}`)")
    return [Wanted(model=name, commit=lk.version, path=f.path, size=f.size, sha256=f.sha256, kind="kits")
            for f in [lk.manifest, *lk.files]]


def _plain_file(pins: Pins, lock: Lock, name: str) -> list[Wanted]:
    lf = lock.files.get(name)
    if lf is None or lf.size is None:
        raise ConfigError(f"files.{name}: not in the lock (run `builder lock {name}`)")
    return [Wanted(model=name, commit=lf.sha256, path=file_name(pins.files[name].url), size=lf.size,
                   sha256=lf.sha256, kind="files")]


def select(pins: Pins, lock: Lock, names: list[str]) -> list[Wanted]:
    """The locked files of the named lanes (their models and runtime inputs), models, kits or plain
    files (none named: those of every locked lane)."""
    chosen: dict[str, list[str]] = {"models": [], "kits": [], "files": []}
    if not names:
        names = sorted(n for n in pins.lanes if n in lock.lanes)
    for n in names:
        if n in pins.lanes:
            chosen["models"] += pins.lanes[n].models
            for i in pins.lanes[n].inputs():
                chosen["kits" if i in pins.kits else "files"].append(i)
        elif n in pins.models:
            chosen["models"].append(n)
        elif n in pins.kits:
            chosen["kits"].append(n)
        elif n in pins.files:
            chosen["files"].append(n)
        else:
            raise ConfigError(f"fetch: {n!r} is not a lane, model, kit or file of the pins")
    out: list[Wanted] = []
    for m in dict.fromkeys(chosen["models"]):
        lm = lock.models.get(m)
        if lm is None:
            raise ConfigError(f"models.{m}: not in the lock (run `builder lock {m}`)")
        out += [Wanted(model=m, commit=lm.commit, path=f.path, size=f.size, sha256=f.sha256) for f in lm.files]
    for k in dict.fromkeys(chosen["kits"]):
        out += _kit_files(lock, k)
    for n in dict.fromkeys(chosen["files"]):
        out += _plain_file(pins, lock, n)
    return out


def local_copy(pins: Pins, root: Path, w: Wanted) -> Path | None:
    """A local file said to be this one (a model's `local` folder or the HF cache, a kit's `local`
    folder, a plain file's project path or file:// URL), if any."""
    from builder.hf import repo_folder_name

    if w.kind == "kits":
        return kits.local_file(pins.kits[w.model], root, w.path)
    if w.kind == "files":
        url = pins.files[w.model].url
        if plain.is_remote(url):
            return None
        p = plain.local_path(url, root, where=f"files.{w.model}.url")
        return p if p.is_file() else None
    spec = pins.models[w.model]
    cands: list[Path] = []
    if spec.local:
        base = Path(spec.local) if Path(spec.local).is_absolute() else root / spec.local
        cands += [base / w.path, base / "snapshots" / w.commit / w.path,
                  base / repo_folder_name(spec.repo) / "snapshots" / w.commit / w.path]
    hub = os.environ.get("HF_HUB_CACHE") or str(
        Path(os.environ.get("HF_HOME") or Path.home() / ".cache" / "huggingface") / "hub"
    )
    cands.append(Path(hub) / repo_folder_name(spec.repo) / "snapshots" / w.commit / w.path)
    return next((c for c in cands if c.is_file()), None)


def from_tree(pins: Pins, lock: Lock, root: Path, store: ModelStore, w: Wanted, *, offline: bool) -> bool:
    """A file of a kit from a git source: written from the source's tree at the kit's locked commit
    into the store (verified). False for any other file (it has no tree)."""
    spec = pins.kits.get(w.model) if w.kind == "kits" else None
    if spec is None or spec.source is None:
        return False
    lk = lock.kits.get(w.model)
    if lk is None or lk.commit is None:
        raise ConfigError(f"{w.where}: the lock has no commit for this kit (run `builder lock {w.model}`)")
    tmp = store.root / "tmp" / f"{w.sha256}.{os.getpid()}.{secrets.token_hex(4)}"
    digest, size = kits.export_file(w.model, spec, pins.sources[spec.source], lk.commit, w.path, tmp, root=root,
                                    cache=store.root.parent / "git", offline=offline)
    store.commit_object(tmp, w, digest, size)
    return True


def in_store(pins: Pins, root: Path, store: ModelStore, w: Wanted, lock: Lock | None = None) -> Path:
    """The store's object for a locked file, importing a local copy first when the store lacks it
    (what `builder fetch --offline` would do for it: a kit's file from its git mirror too, given the
    lock); its bytes checked (ModelStore.checked). ConfigError naming the file when neither the
    store nor a local copy has it."""
    if not store.has(w):
        src = local_copy(pins, root, w)
        if src is not None:
            store.import_file(src, w)
        elif lock is None or not from_tree(pins, lock, root, store, w, offline=True):
            raise ConfigError(
                f"{w.where}: not in the model store ({store.root}) and no local copy; run "
                f"`builder fetch {w.model}`, or bundle without --with-models"
            )
    return store.checked(w)


def download_url(store: ModelStore, url: str, root: Path, w: Wanted) -> None:
    """A plain file from its URL into the store, verified as it arrives (builder.fetch.download)."""
    tmp = store.root / "tmp" / f"{w.sha256}.{os.getpid()}.{secrets.token_hex(4)}"
    try:
        n = plain.download(url, tmp, w.sha256, root=root, size=w.size)
    except VerifyError as e:
        raise VerifyError(f"{w.where}: {e}") from None
    except ResolveError as e:
        raise ResolveError(f"{w.where}: {e}") from None
    store.commit_object(tmp, w, w.sha256, n)


def download(store: ModelStore, repo: str, w: Wanted, on_bytes: OnBytes | None = None) -> None:
    """GET the file at the locked commit into its partial file, resuming what is there; verify; commit."""
    from huggingface_hub import get_session, hf_hub_url
    from huggingface_hub.utils import build_hf_headers

    from builder.hf import scrub

    token = os.environ.get("HF_TOKEN") or None
    url = hf_hub_url(repo, w.path, revision=w.commit, endpoint=os.environ.get("HF_ENDPOINT") or None)
    part = store.partial_path(w.sha256)
    part.parent.mkdir(parents=True, exist_ok=True)
    h = hashlib.sha256()
    have = 0
    if part.exists():
        with open(part, "rb") as f:
            while chunk := f.read(CHUNK):
                h.update(chunk)
                have += len(chunk)
        if have > w.size:
            part.unlink()
            h, have = hashlib.sha256(), 0
    headers = build_hf_headers(token=token)
    if have:
        headers["Range"] = f"bytes={have}-"
    try:
        with get_session().stream("GET", url, headers=headers, follow_redirects=True, timeout=TIMEOUT) as r:
            if r.status_code == 200 and have:  # the server ignored the Range: start again
                h, have = hashlib.sha256(), 0
                mode = "wb"
            elif r.status_code in (200, 206):
                mode = "ab" if have else "wb"
            elif r.status_code == 416 and have == w.size:
                mode = ""
            else:
                raise ResolveError(f"{w.where}: {repo}@{w.commit[:12]}: HTTP {r.status_code} from the Hub")
            if mode:
                with open(part, mode) as f:
                    for chunk in r.iter_bytes():  # as it arrives: a cut keeps what came
                        f.write(chunk)
                        h.update(chunk)
                        have += len(chunk)
                        if on_bytes:
                            on_bytes(None, len(chunk))
                        if have > w.size:
                            break
                    f.flush()
                    os.fsync(f.fileno())
    except BuilderError:
        raise
    except OSError as e:
        raise BuilderError(f"{w.where}: cannot write {part}: {e.strerror or e}") from None
    except Exception as e:  # the HTTP client's errors: one scrubbed line
        line = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise ResolveError(f"{w.where}: {repo}@{w.commit[:12]}: {scrub(line, token)}") from None
    if have < w.size:
        raise ResolveError(
            f"{w.where}: the download stopped at {have} of {w.size} bytes (run fetch again to resume)"
        )
    store.commit_object(part, w, h.hexdigest(), have)


def fetch(
    pins: Pins, lock: Lock, root: Path, store_dir: Path, names: list[str], *, offline: bool = False,
    jobs: int = 4, verify: bool = False, on_bytes: OnBytes | None = None,
) -> FetchReport:
    store = ModelStore(store_dir)
    wanted = select(pins, lock, names)
    report = FetchReport()

    def one(w: Wanted) -> None:
        try:
            if store.has(w):
                why = store.verify(w) if verify else None
                if why is None:
                    store.link_view(w)
                    report.present.append(w)
                    if on_bytes:
                        on_bytes(w, w.size)
                    return
                store.remove(w)
                if offline:
                    report.failed.append((w, f"{w.where}: {why}; removed"))
                    return
                report.repaired.append((w, f"{w.where}: {why}; removed, fetching again"))
            src = local_copy(pins, root, w)
            if src is not None:
                store.import_file(src, w)
                report.imported.append(w)
                if on_bytes:
                    on_bytes(w, w.size)
            elif from_tree(pins, lock, root, store, w, offline=offline):
                report.imported.append(w)
                if on_bytes:
                    on_bytes(w, w.size)
            elif w.kind == "kits":  # a local kit's folder is the only place its files come from
                report.failed.append((w, f"{w.where}: not in the store, and not in the kit's folder "
                                         f"{kits.folder(pins.kits[w.model], root)}"))
            elif offline:
                report.missing.append(w)
                return
            elif w.kind == "files":
                download_url(store, pins.files[w.model].url, root, w)
                report.downloaded.append(w)
                if on_bytes:
                    on_bytes(w, w.size)
            else:
                download(store, pins.models[w.model].repo, w, on_bytes)
                report.downloaded.append(w)
                if on_bytes:
                    on_bytes(w, 0)
        except (BuilderError, VerifyError) as e:
            report.failed.append((w, str(e)))

    with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
        list(pool.map(one, wanted))
    return report


def total_bytes(pins: Pins, lock: Lock, names: list[str]) -> int:
    return sum(w.size for w in select(pins, lock, names))
