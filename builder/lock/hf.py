"""Hugging Face models: resolve repo + revision to a commit and the path, size, sha256 of each file.

Two ways, one result (`LockedModel`):

- the Hub (online, no ``local``): ``HfApi.model_info(files_metadata=True)`` gives the commit and,
  for LFS files, size and sha256 without downloading them; small (non-LFS) files are
  downloaded into the builder's HF cache and hashed. HF_ENDPOINT and HF_TOKEN are honoured;
  the token never appears in a message or in the lock.
- files on disk (``local`` set, or offline): a plain snapshot folder (needs a 40-hex revision
  in the pin), an HF cache repo folder ``models--org--name`` (``refs/<revision>`` and
  ``snapshots/<commit>/``), a hub cache folder holding it, or the standard HF cache (``hub_cache``:
  the folder huggingface_hub itself uses). Every selected file is hashed for real, several at a time.

A snapshot on disk can hold fewer files than the repo (a partial download); pin
``expect_files`` (e.g. the shard count) to catch that.
"""

from __future__ import annotations

import fnmatch
import os
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from builder.errors import ConfigError, ResolveError
from builder.foundation.canon import atomic_write
from builder.foundation.hashing import HashProgress, sha256_file
from builder.foundation.hashing import hash_folder_files as hash_files
from builder.inputs.pins import HfModel
from builder.lock.lockfile import LockedModel, LockedModelFile

HEX40 = re.compile(r"^[0-9a-f]{40}$")
SKIP_DIRS = {".git", ".cache", ".huggingface"}
TIMEOUT = 30.0


def scrub(text: str, token: str | None = None) -> str:
    """Remove the HF token (and anything that looks like one) from text."""
    tok = token if token is not None else os.environ.get("HF_TOKEN")
    if tok:
        text = text.replace(tok, "***")
    text = re.sub(r"\bhf_[A-Za-z0-9]{20,}\b", "***", text)
    return re.sub(r"(?i)(authorization:?\s*bearer\s+)\S+", r"\1***", text)


def _first_line(e: BaseException, token: str | None) -> str:
    msg = str(e).strip().splitlines()
    line = msg[0] if msg else type(e).__name__
    return scrub(f"{type(e).__name__}: {line}", token)[:300]


def repo_folder_name(repo: str) -> str:
    return "models--" + repo.replace("/", "--")


def hub_cache() -> Path:
    """The HF cache, as huggingface_hub itself computes it (``huggingface_hub.constants.HF_HUB_CACHE``:
    HF_HUB_CACHE, else HF_HOME/hub, else $XDG_CACHE_HOME/huggingface/hub, else
    ~/.cache/huggingface/hub; read once, when huggingface_hub is first imported). The one place builder
    asks: `builder lock --offline` looks here, `builder fetch` imports from and downloads into it."""
    # imported at first use, not with this module: huggingface_hub reads its environment once, when its
    # constants are imported, and the command's environment is the one that counts
    from huggingface_hub import constants

    return Path(constants.HF_HUB_CACHE).expanduser()


def hub_cache_dirs() -> list[Path]:
    """The HF caches an offline lock looks in: the standard one (hub_cache)."""
    return [hub_cache()]


def cached_file(repo: str, commit: str, path: str, cache: Path | None = None) -> Path | None:
    """The HF cache's copy of a repo's file at a commit (``snapshots/<commit>/<path>``, a link to its
    blob), if it is there and names a file: huggingface_hub's own answer (``try_to_load_from_cache``)."""
    from huggingface_hub import try_to_load_from_cache  # (at first use: see hub_cache)

    got = try_to_load_from_cache(repo, path, cache_dir=str(cache or hub_cache()), revision=commit)
    return Path(got) if isinstance(got, str) else None


def record_ref(repo: str, revision: str, commit: str, cache: Path | None = None) -> Path | None:
    """Write the HF cache's ``refs/<revision>`` (the commit, 40 hex and no newline), as huggingface_hub
    does when it resolves a branch or tag online, so that huggingface_hub offline (``HF_HUB_OFFLINE``,
    ``revision="main"``) and `builder lock --offline` of a model pinned by branch find the snapshot
    builder fetched. Only where the cache holds that snapshot, the revision is not the commit itself and
    the ref names another commit; returns the ref written, else None.

    Hand-written: huggingface_hub has no public call that records a ref (its own writer is private,
    ``file_download._cache_commit_hash_for_specific_revision``); the layout is its documented cache's."""
    if revision == commit or not HEX40.match(commit):
        return None
    parts = revision.split("/")
    if any(p in ("", ".", "..") for p in parts):
        return None  # (not a name huggingface_hub could have written under refs/)
    folder = (cache or hub_cache()) / repo_folder_name(repo)
    if not (folder / "snapshots" / commit).is_dir():
        return None
    ref = folder.joinpath("refs", *parts)
    try:
        if ref.read_text() == commit:
            return None
    except OSError:
        pass
    ref.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(ref, commit.encode("ascii"))
    return ref


def forget_cached(repo: str, commit: str, path: str, cache: Path | None = None) -> list[Path]:
    """Remove the HF cache's copy of a file whose bytes are not the locked ones: its snapshot entry and
    the blob it names (only inside the repo's own folder). Returns what was removed."""
    folder = (cache or hub_cache()) / repo_folder_name(repo)
    pointer = folder / "snapshots" / commit / path
    removed: list[Path] = []
    blob, blobs = Path(os.path.realpath(pointer)), Path(os.path.realpath(folder / "blobs"))
    for p in (pointer, blob):
        inside = p == pointer or blobs in p.parents
        if inside and (p.is_symlink() or p.exists()):
            try:
                p.unlink()
                removed.append(p)
            except FileNotFoundError:
                pass
    return removed


# ---------------------------------------------------------------------------------------
# files on disk


def list_files(folder: Path) -> list[str]:
    """Relative posix paths of every file under folder (symlinks followed as files)."""
    out: list[str] = []
    for dirpath, dirnames, filenames in os.walk(folder):
        dirnames[:] = sorted(d for d in dirnames if d not in SKIP_DIRS)
        for fn in filenames:
            out.append((Path(dirpath) / fn).relative_to(folder).as_posix())
    return sorted(out)


def select_files(paths: Iterable[str], include: list[str], exclude: list[str]) -> list[str]:
    """The repo files a model pin selects: include globs (all when empty) minus exclude globs."""
    out = []
    for p in paths:
        if include and not any(fnmatch.fnmatch(p, g) for g in include):
            continue
        if any(fnmatch.fnmatch(p, g) for g in exclude):
            continue
        out.append(p)
    return sorted(out)


def find_snapshot(spec: HfModel, folder: Path, *, where: str) -> tuple[Path, str] | None:
    """(snapshot folder, commit) for spec inside an HF cache repo folder or hub cache folder."""
    candidates = [folder, folder / repo_folder_name(spec.repo)]
    for repo_dir in candidates:
        snaps = repo_dir / "snapshots"
        if not snaps.is_dir():
            continue
        commit: str | None = None
        if HEX40.match(spec.revision) and (snaps / spec.revision).is_dir():
            commit = spec.revision
        else:
            ref = repo_dir / "refs" / spec.revision
            if ref.is_file():
                commit = ref.read_text().strip()
        if commit is None:
            return None
        if not HEX40.match(commit) or not (snaps / commit).is_dir():
            raise ResolveError(f"{where}: HF cache {repo_dir} points {spec.revision} at {commit[:40]!r}, "
                               "but that snapshot is missing")
        return snaps / commit, commit
    return None


def lock_from_folder(name: str, spec: HfModel, folder: Path, commit: str, spec_hash: str,
                     previous: LockedModel | None = None, progress: HashProgress | None = None) -> LockedModel:
    where = f"models.{name}"
    paths = select_files(list_files(folder), spec.include, spec.exclude)
    if previous is not None and previous.repo == spec.repo and previous.commit == commit:
        # a commit's file list never changes: a selected file the lock had and the folder lacks vanished
        selected_before = select_files([f.path for f in previous.files], spec.include, spec.exclude)
        gone = sorted(set(selected_before) - set(paths))
        if gone:
            more = f" (and {len(gone) - 1} more)" if len(gone) > 1 else ""
            raise ResolveError(f"{where}: file vanished: {gone[0]}{more} (locked at {commit[:12]}, "
                               f"missing from {folder})")
    _check_count(where, spec, len(paths))
    hashed = hash_files(folder, paths, where=where, progress=progress)
    files = [LockedModelFile(path=p, size=s, sha256=d) for p, d, s in hashed]
    return _locked(spec, commit, "local", files, spec_hash)


def _check_count(where: str, spec: HfModel, n: int) -> None:
    if n == 0:
        raise ResolveError(f"{where}: no files of {spec.repo}@{spec.revision} match include={spec.include} "
                           f"exclude={spec.exclude}")
    if spec.expect_files is not None and n != spec.expect_files:
        raise ResolveError(f"{where}: expected {spec.expect_files} files, found {n} "
                           f"(include={spec.include}, exclude={spec.exclude})")


def _locked(spec: HfModel, commit: str, source: str, files: list[LockedModelFile],
            spec_hash: str) -> LockedModel:
    files = sorted(files, key=lambda f: f.path)
    return LockedModel(spec_hash=spec_hash, repo=spec.repo, revision=spec.revision, commit=commit,
                       source=source, files=files, total_size=sum(f.size for f in files))  # type: ignore[arg-type]


def resolve_local(name: str, spec: HfModel, folder: Path, spec_hash: str,
                  previous: LockedModel | None = None, progress: HashProgress | None = None) -> LockedModel:
    """Lock from a folder on disk: an HF cache layout, or a plain snapshot folder."""
    where = f"models.{name}"
    if not folder.is_dir():
        raise ResolveError(f"{where}: local folder not found: {folder}")
    found = find_snapshot(spec, folder, where=where)
    if found is not None:
        snap, commit = found
        return lock_from_folder(name, spec, snap, commit, spec_hash, previous, progress)
    if (folder / "snapshots").is_dir() or (folder / repo_folder_name(spec.repo)).is_dir():
        raise ResolveError(f"{where}: revision {spec.revision} of {spec.repo} is not in the HF cache "
                           f"{folder}")
    if not HEX40.match(spec.revision):
        raise ConfigError(f"models.{name}.revision: a plain local folder needs a 40-hex commit revision "
                          f"(got {spec.revision!r})")
    return lock_from_folder(name, spec, folder, spec.revision, spec_hash, previous, progress)


# ---------------------------------------------------------------------------------------
# the Hub


def resolve_hub(name: str, spec: HfModel, *, cache: Path, spec_hash: str) -> LockedModel:
    # Imported here for start-up time: huggingface_hub is large, and only a lock that asks the Hub needs it.
    from huggingface_hub import HfApi, hf_hub_download

    where = f"models.{name}"
    token = os.environ.get("HF_TOKEN") or None
    endpoint = os.environ.get("HF_ENDPOINT") or None
    api = HfApi(endpoint=endpoint, token=token)
    try:
        info: Any = api.model_info(spec.repo, revision=spec.revision, files_metadata=True, timeout=TIMEOUT)
    except Exception as e:  # the library's errors vary by version; one scrubbed line is what we need
        raise ResolveError(f"{where}: {spec.repo}@{spec.revision}: {_first_line(e, token)}") from None
    commit = str(info.sha or "")
    if not HEX40.match(commit):
        raise ResolveError(f"{where}: the Hub gave no commit for {spec.repo}@{spec.revision}")
    if HEX40.match(spec.revision) and commit != spec.revision:
        raise ResolveError(f"{where}: the Hub answered commit {commit[:12]} for pinned {spec.revision[:12]}")
    siblings = {s.rfilename: s for s in (info.siblings or [])}
    paths = select_files(list(siblings), spec.include, spec.exclude)
    _check_count(where, spec, len(paths))
    files: list[LockedModelFile] = []
    for p in paths:
        s = siblings[p]
        if s.lfs is not None and s.lfs.sha256:
            files.append(LockedModelFile(path=p, size=int(s.lfs.size), sha256=str(s.lfs.sha256)))
            continue
        try:
            local = hf_hub_download(spec.repo, p, revision=commit, cache_dir=str(cache), token=token,
                                    endpoint=endpoint, etag_timeout=TIMEOUT)
        except Exception as e:
            raise ResolveError(f"{where}: cannot download {p} of {spec.repo}@{commit[:12]}: "
                               f"{_first_line(e, token)}") from None
        digest, size = sha256_file(local)
        if s.size is not None and int(s.size) != size:
            raise ResolveError(f"{where}: {p}: the Hub says {s.size} bytes, downloaded {size}")
        files.append(LockedModelFile(path=p, size=size, sha256=digest))
    return _locked(spec, commit, "hub", files, spec_hash)


def resolve(name: str, spec: HfModel, *, root: Path, cache: Path, offline: bool, spec_hash: str,
            previous: LockedModel | None = None, progress: HashProgress | None = None) -> LockedModel:
    """Resolve one model pin: from ``local`` if set, from the HF cache offline, else from the Hub.

    ``previous`` (the entry of the lock being replaced, if any) lets a local resolution notice
    a file that vanished from disk: the file list of one commit never changes.
    """
    if spec.local:
        folder = Path(spec.local).expanduser()
        return resolve_local(name, spec, folder if folder.is_absolute() else root / folder, spec_hash,
                             previous, progress)
    if offline:
        for hub in hub_cache_dirs():
            found = find_snapshot(spec, hub, where=f"models.{name}") if hub.is_dir() else None
            if found is not None:
                return lock_from_folder(name, spec, found[0], found[1], spec_hash, previous, progress)
        raise ResolveError(f"models.{name}: not in the cache and --offline was given "
                           f"({spec.repo}@{spec.revision})")
    return resolve_hub(name, spec, cache=cache, spec_hash=spec_hash)


__all__ = ["resolve", "resolve_local", "resolve_hub", "lock_from_folder", "find_snapshot", "hash_files",
           "list_files", "scrub", "hub_cache", "hub_cache_dirs", "cached_file", "record_ref", "forget_cached",
           "select_files", "repo_folder_name"]
