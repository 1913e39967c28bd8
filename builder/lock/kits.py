"""Kernel kits: lock a kit's files against its MANIFEST, from a local folder or a git source's tree.

A kit (``[kits.NAME]``, builder.inputs.pins.Kit) is a folder: its MANIFEST (one line per file,
``sha256 bytes origin two-node path``; ``#`` comments and blank lines are skipped) and every file the
MANIFEST lists. `resolve` hashes each file and checks it against its line (size and sha256); a listed
file that is missing, one whose bytes differ, or a file of the folder that the MANIFEST does not list
(and no ``ignore`` glob covers) fails the lock of that kit, in one line naming them. ``expect_files``
(the MANIFEST's count) and ``manifest_sha256`` are checked when pinned. The lock records the MANIFEST
(path, size, sha256) and every file it lists (path, size, sha256).

- ``local``: a folder on this machine, such as a kit its own tools verified (``verify_kit.sh`` makes
  the RoPE tables and the bias, which no git tree holds).
- ``source`` + ``path``: the files of a ``[sources]`` git entry's tree at the commit the lock has for
  it, read from the mirror `builder.lock.gitsrc` keeps (``<cache>/git``). A line whose file is not in the
  tree (origin ``rope``, ``bias``: made by the kit's tools) fails that kit, naming the files and
  saying to point ``local`` at a verified kit folder.

`builder fetch` and `builder bundle` take a kit's bytes from here too: `local_file` (the folder's
copy) and `export_file` (a file of the tree at the locked commit, hashed as it is written).
"""

from __future__ import annotations

import fnmatch
import hashlib
import os
import re
import subprocess
from dataclasses import dataclass
from pathlib import Path

from builder.errors import ResolveError
from builder.foundation.hashing import HashProgress, copy_hashed, hash_folder_files
from builder.inputs.pins import GitSource, Kit
from builder.lock import gitsrc
from builder.lock.lockfile import LockedKit, LockedModelFile, LockedSource
from builder.lock.plainfiles import scrub_url

SHA256_RE = re.compile(r"[0-9a-f]{64}")
READ = 4 * 1024 * 1024


@dataclass(frozen=True)
class Line:
    """One MANIFEST line (its two-node column is the kit's own note: nothing here reads it)."""

    sha256: str
    size: int
    origin: str
    path: str


def _names(items: list[str], limit: int = 8) -> str:
    return ", ".join(items[:limit]) + (f" (+{len(items) - limit} more)" if len(items) > limit else "")


def _safe(path: str) -> bool:
    parts = path.split("/")
    return not (path.startswith("/") or any(p in ("", ".", "..") for p in parts) or "\\" in path
                or "\x00" in path)


def parse_manifest(data: bytes, where: str, manifest: str = "MANIFEST") -> list[Line]:
    """The MANIFEST's lines, in order. ResolveError naming the line when one is malformed, a path
    escapes the kit or is listed twice, or no file is listed."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise ResolveError(f"{where}: {manifest} is not UTF-8 text") from None
    out: list[Line] = []
    seen: dict[str, int] = {}
    for n, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        parts = line.split(None, 4)
        if len(parts) != 5 or not SHA256_RE.fullmatch(parts[0].lower()) or not parts[1].isdigit():
            raise ResolveError(f"{where}: {manifest} line {n}: want `sha256 bytes origin two-node path`, "
                               f"got {line[:80]!r}")
        path = parts[4]
        if not _safe(path):
            raise ResolveError(f"{where}: {manifest} line {n}: path {path!r} escapes the kit's folder")
        if path == manifest:
            raise ResolveError(f"{where}: {manifest} line {n}: the MANIFEST lists itself")
        if path in seen:
            raise ResolveError(f"{where}: {manifest} line {n}: {path} is listed twice (line {seen[path]} too)")
        seen[path] = n
        out.append(Line(sha256=parts[0].lower(), size=int(parts[1]), origin=parts[2], path=path))
    if not out:
        raise ResolveError(f"{where}: {manifest} lists no files")
    return out


def _check_manifest(where: str, spec: Kit, data: bytes) -> tuple[LockedModelFile, list[Line]]:
    digest = hashlib.sha256(data).hexdigest()
    if spec.manifest_sha256 is not None and digest != spec.manifest_sha256:
        raise ResolveError(f"{where}: {spec.manifest} has sha256 {digest}, pinned manifest_sha256 "
                           f"{spec.manifest_sha256}")
    lines = parse_manifest(data, where, spec.manifest)
    if spec.expect_files is not None and len(lines) != spec.expect_files:
        raise ResolveError(f"{where}: {spec.manifest} lists {len(lines)} files, expect_files = {spec.expect_files}")
    return LockedModelFile(path=spec.manifest, size=len(data), sha256=digest), lines


def _compare(where: str, spec: Kit, lines: list[Line], got: dict[str, tuple[str, int]], extra: list[str],
             at: str) -> None:
    """One ResolveError naming every file that is missing, differs or is not listed."""
    missing = [ln.path for ln in lines if ln.path not in got]
    differ = []
    for ln in lines:
        if ln.path not in got:
            continue
        digest, size = got[ln.path]
        if size != ln.size:
            differ.append(f"{ln.path} ({size} bytes, the MANIFEST says {ln.size})")
        elif digest != ln.sha256:
            differ.append(f"{ln.path} (sha256 {digest[:12]}, the MANIFEST says {ln.sha256[:12]})")
    if not (missing or differ or extra):
        return
    what = []
    if missing:
        what.append(f"missing {_names(missing)}")
    if differ:
        what.append(f"differ {_names(differ)}")
    if extra:
        what.append(f"not in the {spec.manifest} {_names(extra)} (an `ignore` glob leaves out files that are "
                    "not the kit's)")
    bad = len(missing) + len(differ) + len(extra)
    raise ResolveError(f"{where}: {bad} file(s) do not match its {spec.manifest} ({at}): {'; '.join(what)}")


def _locked(spec: Kit, spec_hash: str, manifest: LockedModelFile, lines: list[Line], *, origin: str,
            source: str | None = None, commit: str | None = None) -> LockedKit:
    files = sorted((LockedModelFile(path=ln.path, size=ln.size, sha256=ln.sha256) for ln in lines),
                   key=lambda f: f.path)
    return LockedKit(spec_hash=spec_hash, origin=origin, source=source, commit=commit,  # type: ignore[arg-type]
                     path=spec.path, manifest=manifest, files=files, total_size=sum(f.size for f in files))


def _ignored(spec: Kit, rel: str) -> bool:
    return any(fnmatch.fnmatch(rel, g) for g in spec.ignore)


# --------------------------------------------------------------------------- a local folder


def folder(spec: Kit, root: Path) -> Path:
    """A local kit's folder (``local``: absolute, or relative to the project)."""
    assert spec.local is not None
    p = Path(spec.local).expanduser()
    return p if p.is_absolute() else root / p


def _listing(base: Path) -> list[str]:
    out = []
    for d, dirs, names in os.walk(base):
        dirs.sort()
        for n in names:
            p = Path(d) / n
            if p.is_file():
                out.append(p.relative_to(base).as_posix())
    return sorted(out)


def resolve_local(name: str, spec: Kit, root: Path, spec_hash: str, progress: HashProgress | None = None) -> LockedKit:
    where = f"kits.{name}"
    base = folder(spec, root)
    if not base.is_dir():
        raise ResolveError(f"{where}: local folder not found: {base}")
    try:
        data = (base / spec.manifest).read_bytes()
    except FileNotFoundError:
        raise ResolveError(f"{where}: no {spec.manifest} in {base}") from None
    except OSError as e:
        raise ResolveError(f"{where}: cannot read {base / spec.manifest}: {e.strerror}") from None
    manifest, lines = _check_manifest(where, spec, data)
    present = _listing(base)
    listed = {ln.path for ln in lines}
    extra = [p for p in present if p not in listed and p != spec.manifest and not _ignored(spec, p)]
    here = set(present)
    todo = [ln.path for ln in lines if ln.path in here]
    got = {rel: (d, s) for rel, d, s in hash_folder_files(base, todo, where=where, progress=progress)}
    _compare(where, spec, lines, got, extra, str(base))
    return _locked(spec, spec_hash, manifest, lines, origin="local")


def local_file(spec: Kit, root: Path, rel: str) -> Path | None:
    """A local kit's copy of one of its files (None for a kit from a git source, or a file not there)."""
    if spec.local is None:
        return None
    p = folder(spec, root) / rel
    return p if p.is_file() else None


# --------------------------------------------------------------------------- a git source's tree


def mirror_for(source: str, spec: GitSource, *, root: Path, cache: Path, offline: bool) -> Path:
    """The source's mirror under ``cache`` (``<store>/git``): the one `builder lock` filled, else fetched
    now (offline: only from a local remote)."""
    url = gitsrc.source_url(spec.url, root)
    m = gitsrc.mirror_path(cache, url)
    if (m / "objects").is_dir():
        return m
    return gitsrc.ensure_mirror(url, cache, offline=offline, name=source, shown=scrub_url(spec.url))


def tree_path(spec: Kit, rel: str) -> str:
    return f"{spec.path}/{rel}" if spec.path else rel


def _tree(mirror: Path, commit: str, prefix: str) -> dict[str, tuple[str, str]]:
    """rel -> (mode, object id) of every entry under prefix in the commit's tree."""
    args = ["--git-dir", str(mirror), "ls-tree", "-r", "-z", "--full-tree", commit]
    if prefix:
        args += ["--", f"{prefix}/"]
    ls = gitsrc.git(args)
    out: dict[str, tuple[str, str]] = {}
    for rec in ls.stdout.split(b"\0"):
        if not rec:
            continue
        meta, _, raw = rec.partition(b"\t")
        mode, otype, oid = meta.decode().split()
        path = os.fsdecode(raw)
        if otype != "blob":
            continue
        rel = path[len(prefix) + 1:] if prefix else path
        if prefix and not path.startswith(prefix + "/"):
            continue
        out[rel] = (mode, oid)
    return out


def resolve_git(name: str, spec: Kit, mirror: Path, source: LockedSource, spec_hash: str) -> LockedKit:
    where = f"kits.{name}"
    src = spec.source
    at = f"{src} at {source.commit[:12]}" + (f", {spec.path}/" if spec.path else "")
    tree = _kit_tree(where, spec, mirror, source, at)
    (data,) = list(gitsrc.blobs(mirror, [tree[spec.manifest][1]]))
    manifest, lines = _check_manifest(where, spec, data)
    _require_in_tree(where, spec, lines, tree, at)
    listed = {ln.path for ln in lines}
    extra = sorted(p for p in tree if p not in listed and p != spec.manifest and not _ignored(spec, p))
    got = _hash_blobs(where, mirror, lines, tree, at)
    _compare(where, spec, lines, got, extra, at)
    return _locked(spec, spec_hash, manifest, lines, origin="git", source=src, commit=source.commit)


def _kit_tree(where: str, spec: Kit, mirror: Path, source: LockedSource, at: str) -> dict[str, tuple[str, str]]:
    """The kit's folder in the source's tree at its locked commit: path -> (mode, blob id), its manifest
    among them."""
    try:
        tree = _tree(mirror, source.commit, spec.path)
    except gitsrc.GitError as e:
        raise ResolveError(f"{where}: cannot read {at}: {e.reason}") from None
    if not tree:
        raise ResolveError(f"{where}: no folder {spec.path or '/'} in {spec.source} at {source.commit[:12]}")
    if spec.manifest not in tree:
        raise ResolveError(f"{where}: no {spec.manifest} in {at}")
    return tree


def _require_in_tree(where: str, spec: Kit, lines: list[Line], tree: dict[str, tuple[str, str]], at: str) -> None:
    """Every file the manifest lists is in the tree; those its own tools make are named as such."""
    absent = [ln for ln in lines if ln.path not in tree]
    if absent:
        made = sorted({ln.origin for ln in absent if ln.origin != "git"})
        why = f" (origin {', '.join(made)}: made by the kit's own tools, not kept in git)" if made else ""
        raise ResolveError(
            f"{where}: {len(absent)} of {len(lines)} files its {spec.manifest} lists are not in {at}: "
            f"{_names([ln.path for ln in absent], 16)}{why}; point `local` at a verified kit folder instead"
        )


def _hash_blobs(where: str, mirror: Path, lines: list[Line], tree: dict[str, tuple[str, str]],
                at: str) -> dict[str, tuple[str, int]]:
    """(sha256, size) of each listed file's blob; a link among them is refused."""
    got: dict[str, tuple[str, int]] = {}
    links = [ln.path for ln in lines if tree[ln.path][0] == "120000"]
    if links:
        raise ResolveError(f"{where}: {_names(links)} in {at}: a link, not a file")
    for ln, blob in zip(lines, gitsrc.blobs(mirror, [tree[ln.path][1] for ln in lines]), strict=True):
        got[ln.path] = (hashlib.sha256(blob).hexdigest(), len(blob))
    return got


def export_file(name: str, spec: Kit, source: GitSource, commit: str, rel: str, dest: Path, *, root: Path,
                cache: Path, offline: bool) -> tuple[str, int]:
    """Write the file ``rel`` of the kit (the source's tree at ``commit``) into dest, a new file;
    returns (sha256, size) of what was written."""
    assert spec.source is not None
    mirror = mirror_for(spec.source, source, root=root, cache=cache, offline=offline)
    obj = f"{commit}:{tree_path(spec, rel)}"
    proc = subprocess.Popen(["git", "--git-dir", str(mirror), "cat-file", "blob", obj], stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=gitsrc.git_env())
    assert proc.stdout is not None
    dest.parent.mkdir(parents=True, exist_ok=True)
    try:
        with proc.stdout as src, open(dest, "xb") as out:
            digest, n = copy_hashed(src, out, READ)
    finally:
        rc = proc.wait(timeout=gitsrc.LOCAL_TIMEOUT)
    if rc != 0:
        dest.unlink(missing_ok=True)
        raise ResolveError(f"kits.{name}: {rel}: not in {spec.source} at {commit[:12]} (run `builder lock`)")
    return digest, n


def resolve(name: str, spec: Kit, *, root: Path, cache: Path, offline: bool, spec_hash: str,
            source: LockedSource | None = None, source_spec: GitSource | None = None,
            progress: HashProgress | None = None) -> LockedKit:
    """Lock one kit. A kit from a git source needs that source's entry of the lock being written
    (``source``: locked first, builder.lock.resolve passes it) and its pin; ``cache`` holds the mirrors."""
    if spec.local is not None:
        return resolve_local(name, spec, root, spec_hash, progress)
    if source is None or source_spec is None:
        raise ResolveError(f"kits.{name}: its source sources.{spec.source} is not locked (it must resolve "
                           "first)")
    mirror = mirror_for(str(spec.source), source_spec, root=root, cache=cache, offline=offline)
    return resolve_git(name, spec, mirror, source, spec_hash)


__all__ = ["resolve", "resolve_local", "resolve_git", "parse_manifest", "local_file", "export_file", "folder",
           "mirror_for", "tree_path", "Line"]
