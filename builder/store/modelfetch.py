"""`builder fetch`: the locked files hosts get into the model store, each verified, each byte fetched once.

What hosts get (builder.store.placement): the lanes' model files, and their runtime inputs, each file of a
kit (``[kits]``) and each plain file a lane mounts (``[files]``), all by sha256 in one store.

For every selected locked file: an object already in the store with the locked size is kept (its
view linked); else a local copy (a model's `local` folder, a kit's `local` folder, a plain file's
project path or ``file://`` URL) is imported after hashing (a hard link on the same file system); else
a model file the Hugging Face cache holds at the locked commit is imported the same way; else a kit's
file is written from its git source's tree at the locked commit (the mirror `builder lock` keeps;
offline too); else, unless offline, a model file is downloaded by huggingface_hub itself
(``hf_hub_download`` at the locked commit: hf_xet where the Hub stores the file with Xet and hf_xet is
installed, `HF_ENDPOINT`, `HF_TOKEN`) into the HF cache it computes (builder.lock.hf.hub_cache, what `hf
cache ls` reads), then hashed and hard-linked into the store; a plain file is downloaded from its URL,
hashed while it arrives. Each model's branch or tag is then recorded in the HF cache
(``refs/<revision>``, its locked commit) where that cache holds the commit's snapshot, so that
huggingface_hub offline finds it by branch as it would after its own download.

A connection cut mid-file is resumed by huggingface_hub from the byte it reached (an HTTP Range
request; it gives up after five tries that bring nothing). A file whose bytes are not the locked ones
is removed (from the HF cache too: huggingface_hub would otherwise hand the same bytes back) and named.
The token goes to huggingface_hub and from it only to the Hub (never to a CDN it is redirected to); it
is never written or printed.
"""

from __future__ import annotations

import os
import secrets
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from builder.errors import BuilderError, ConfigError, ResolveError, VerifyError
from builder.inputs.loader import did_you_mean
from builder.inputs.pins import Pins
from builder.lock import hf, kits
from builder.lock import plainfiles as plain
from builder.lock.lockfile import Lock
from builder.store.hub import NoProgress, Progress, download, offline_mode
from builder.store.modelstore import ModelStore, Wanted
from builder.store.placement import PlacedFile, file_name


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
    """The store's entry for a placed file (builder.store.placement): a model's, a kit's or a plain file's."""
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
            names = [*pins.lanes, *pins.models, *pins.kits, *pins.files]
            raise ConfigError(f"fetch: {n!r} is not a lane, model, kit or file of the pins{did_you_mean(n, names)}")
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


def own_copy(pins: Pins, root: Path, w: Wanted) -> Path | None:
    """A local file the pins name for this one (a model's `local` folder, a kit's `local` folder, a
    plain file's project path or file:// URL), if any. (The HF cache: hf_cached.)"""
    if w.kind == "kits":
        return kits.local_file(pins.kits[w.model], root, w.path)
    if w.kind == "files":
        url = pins.files[w.model].url
        if plain.is_remote(url):
            return None
        p = plain.local_path(url, root, where=f"files.{w.model}.url")
        return p if p.is_file() else None
    spec = pins.models[w.model]
    if not spec.local:
        return None
    base = Path(spec.local) if Path(spec.local).is_absolute() else root / spec.local
    cands = [base / w.path, base / "snapshots" / w.commit / w.path,
             base / hf.repo_folder_name(spec.repo) / "snapshots" / w.commit / w.path]
    return next((c for c in cands if c.is_file()), None)


def hf_cached(pins: Pins, w: Wanted) -> Path | None:
    """The HF cache's copy of a model file at its locked commit (builder.lock.hf.hub_cache), if any."""
    if w.kind != "models":
        return None
    return hf.cached_file(pins.models[w.model].repo, w.commit, w.path)


def local_copy(pins: Pins, root: Path, w: Wanted) -> Path | None:
    """A local file said to be this one: the pins' own copy (own_copy), else the HF cache's."""
    return own_copy(pins, root, w) or hf_cached(pins, w)


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


def in_store(pins: Pins, root: Path, store: ModelStore, w: Wanted, lock: Lock | None = None,
             on_bytes: Callable[[int], None] | None = None) -> Path:
    """The store's object for a locked file, importing a local copy first when the store lacks it
    (what `builder fetch --offline` would do for it: a kit's file from its git mirror too, given the
    lock); its bytes checked (ModelStore.checked). ConfigError naming the file when neither the
    store nor a local copy has it. ``on_bytes``: progress, told the bytes as they are hashed."""
    if not store.has(w):
        src = local_copy(pins, root, w)
        if src is not None:
            store.import_file(src, w, on_bytes)
        elif lock is None or not from_tree(pins, lock, root, store, w, offline=True):
            raise ConfigError(
                f"{w.where}: not in the model store ({store.root}) and no local copy; run "
                f"`builder fetch {w.model}`, or bundle without --with-models"
            )
    return store.checked(w, on_bytes)


def download_url(store: ModelStore, url: str, root: Path, w: Wanted) -> None:
    """A plain file from its URL into the store, verified as it arrives (builder.lock.plainfiles.download)."""
    tmp = store.root / "tmp" / f"{w.sha256}.{os.getpid()}.{secrets.token_hex(4)}"
    try:
        n = plain.download(url, tmp, w.sha256, root=root, size=w.size)
    except VerifyError as e:
        raise VerifyError(f"{w.where}: {e}") from None
    except ResolveError as e:
        raise ResolveError(f"{w.where}: {e}") from None
    store.commit_object(tmp, w, w.sha256, n)


def fetch(
    pins: Pins, lock: Lock, root: Path, store_dir: Path, names: list[str], *, offline: bool = False,
    jobs: int = 4, verify: bool = False, progress: Progress | None = None,
) -> FetchReport:
    store = ModelStore(store_dir)
    wanted = select(pins, lock, names)
    fetcher = _Fetcher(pins, lock, root, store, offline=offline, verify=verify, bar=progress or NoProgress())
    with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
        list(pool.map(fetcher.one, wanted))
    record_refs(pins, lock, wanted, fetcher.report)
    return fetcher.report


class _Fetcher:
    """One fetch: each wanted file from the first place that has it (the store, the project's own copy,
    the HF cache, the tree, a URL, the Hub), noted in the report (from several threads)."""

    def __init__(self, pins: Pins, lock: Lock, root: Path, store: ModelStore, *, offline: bool, verify: bool,
                 bar: Progress) -> None:
        self.pins, self.lock, self.root, self.store = pins, lock, root, store
        self.offline, self.verify, self.bar = offline, verify, bar
        self.report = FetchReport()
        self._report_lock = threading.Lock()

    def note(self, kind: list[Any], item: Any) -> None:
        with self._report_lock:
            kind.append(item)

    def hashed(self, w: Wanted, verb: str, run: Callable[[Callable[[int], None]], Any]) -> Any:
        self.bar.start(w, verb)
        try:
            return run(self.bar.advance)
        finally:
            self.bar.finish(w)

    def one(self, w: Wanted) -> None:
        try:
            if self._settled_by_the_store(w) or self._imported(w):
                return
            self._brought(w)
        except (BuilderError, VerifyError) as e:
            self.note(self.report.failed, (w, str(e)))

    def _settled_by_the_store(self, w: Wanted) -> bool:
        """True when the store's copy settles w: it is there (and, verifying, checks out), or it was
        wrong, is removed, and offline nothing may replace it. False: still to fetch."""
        store = self.store
        if not store.has(w):
            return False
        why = self.hashed(w, "verify", lambda adv: store.verify(w, adv)) if self.verify else None
        if why is None:
            store.link_view(w)
            self.note(self.report.present, w)
            return True
        store.remove(w)
        if self.offline:
            self.note(self.report.failed, (w, f"{w.where}: {why}; removed"))
            return True
        self.note(self.report.repaired, (w, f"{w.where}: {why}; removed, fetching again"))
        return False

    def _imported(self, w: Wanted) -> bool:
        """True when w is settled from a copy on this machine: the project's own, else the HF cache (a
        wrong copy there is removed; offline, that fails w)."""
        pins, store = self.pins, self.store
        src = own_copy(pins, self.root, w)
        if src is not None:
            self.hashed(w, "hash", lambda adv: store.import_file(src, w, adv))
            self.note(self.report.imported, w)
            return True
        cached = hf_cached(pins, w)
        if cached is None:
            return False
        try:
            self.hashed(w, "hash", lambda adv: store.import_file(cached, w, adv))
            self.note(self.report.imported, w)
            return True
        except VerifyError as e:
            # huggingface_hub never hashes its cache: a wrong copy there goes, or it comes back
            hf.forget_cached(pins.models[w.model].repo, w.commit, w.path)
            why = f"{e}; removed from the HF cache"
            if self.offline:
                self.note(self.report.failed, (w, why))
                return True
            self.note(self.report.repaired, (w, f"{why}, fetching again"))
            return False

    def _brought(self, w: Wanted) -> None:
        """w from the tree, else (not offline) its URL or the Hub; else noted missing or failed."""
        pins, report, bar = self.pins, self.report, self.bar
        if from_tree(pins, self.lock, self.root, self.store, w, offline=self.offline):
            bar.advance(w.size)
            self.note(report.imported, w)
        elif w.kind == "kits":  # a local kit's folder is the only place its files come from
            self.note(report.failed, (w, f"{w.where}: not in the store, and not in the kit's folder "
                                         f"{kits.folder(pins.kits[w.model], self.root)}"))
        elif self.offline:
            self.note(report.missing, w)
        elif w.kind == "files":
            bar.start(w, "get")
            try:
                download_url(self.store, pins.files[w.model].url, self.root, w)
                bar.advance(w.size)
            finally:
                bar.finish(w)
            self.note(report.downloaded, w)
        elif offline_mode():
            self.note(report.failed, (w, f"{w.where}: not in the store or the HF cache, and HF_HUB_OFFLINE is "
                                         "set (huggingface_hub downloads nothing)"))
        else:
            download(self.store, pins.models[w.model].repo, w, bar)
            self.note(report.downloaded, w)


def record_refs(pins: Pins, lock: Lock, wanted: list[Wanted], report: FetchReport) -> None:
    """Each fetched model's branch or tag in the HF cache (``refs/<revision>``: its locked commit), as
    huggingface_hub records it when it resolves one online: `hf_hub_download` is always asked for the
    locked commit, which records no ref, and without one huggingface_hub offline and `builder lock
    --offline` cannot find a model pinned ``@main`` (builder.lock.hf.record_ref)."""
    for m in dict.fromkeys(w.model for w in wanted if w.kind == "models"):
        lm = lock.models[m]
        try:
            hf.record_ref(pins.models[m].repo, lm.revision, lm.commit)
        except OSError as e:
            first = next(w for w in wanted if w.kind == "models" and w.model == m)
            report.failed.append((first, f"models.{m}: cannot record refs/{lm.revision} in the HF cache "
                                         f"{hf.hub_cache()}: {e.strerror or e}"))


def bytes_to_bring(pins: Pins, lock: Lock, root: Path, store_dir: Path, names: list[str], *,
                   verify: bool = False) -> int:
    """The bytes a fetch will receive or hash (what its progress counts): every file the store lacks,
    and with ``verify`` the store's own too (each is hashed again). Nothing is read."""
    store = ModelStore(store_dir)
    return sum(w.size for w in select(pins, lock, names) if verify or not store.has(w))
