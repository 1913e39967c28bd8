"""`builder fetch`: the locked model files into the model store, each verified, each byte fetched once.

For every selected locked file: an object already in the store with the locked size is kept (its
view linked); else a local copy (the pin's `local` folder, or the Hugging Face cache) is imported
after hashing (a hard link on the same file system); else, unless offline, the file is downloaded
from the Hub at the locked commit (`HF_ENDPOINT`, `HF_TOKEN`), hashed while it arrives. A download
that is cut resumes from its partial file with an HTTP Range request (the partial bytes are hashed
again first, so no byte is trusted unread); a file whose bytes are not the locked ones is removed
and named. The token is sent only as the Authorization header and never printed.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from builder.errors import BuilderError, ConfigError, ResolveError, VerifyError
from builder.lockfile import Lock
from builder.models.store import ModelStore, Wanted
from builder.pins import Pins

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


def select(pins: Pins, lock: Lock, names: list[str]) -> list[Wanted]:
    """The locked files of the named lanes or models (none named: every locked model of every lane)."""
    models: list[str] = []
    if not names:
        names = sorted(n for n in pins.lanes if n in lock.lanes)
    for n in names:
        if n in pins.lanes:
            models += pins.lanes[n].models
        elif n in pins.models:
            models.append(n)
        else:
            raise ConfigError(f"fetch: {n!r} is neither a lane nor a model of the pins")
    out: list[Wanted] = []
    for m in dict.fromkeys(models):
        lm = lock.models.get(m)
        if lm is None:
            raise ConfigError(f"models.{m}: not in the lock (run `builder lock {m}`)")
        out += [Wanted(model=m, commit=lm.commit, path=f.path, size=f.size, sha256=f.sha256) for f in lm.files]
    return out


def local_copy(pins: Pins, root: Path, w: Wanted) -> Path | None:
    """A local file said to be this one (the pin's `local` folder, or the HF cache), if any."""
    from builder.hf import repo_folder_name

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


def in_store(pins: Pins, root: Path, store: ModelStore, w: Wanted) -> Path:
    """The store's object for a locked file, importing a local copy first when the store lacks it
    (what `builder fetch --offline` would do for it); its bytes checked (ModelStore.checked).
    ConfigError naming the model and file when neither the store nor a local copy has it."""
    if not store.has(w):
        src = local_copy(pins, root, w)
        if src is None:
            raise ConfigError(
                f"{w.where}: not in the model store ({store.root}) and no local copy; run "
                f"`builder fetch {w.model}`, or bundle without --with-models"
            )
        store.import_file(src, w)
    return store.checked(w)


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
            elif offline:
                report.missing.append(w)
                return
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
