"""Git sources: resolve a url + ref (+ optional rev) to a full commit through the real git CLI.

Every remote is kept as a bare mirror under ``cache/<sha256(url)[:16]>.git`` (``git clone
--mirror``, then ``git fetch --prune`` with the mirror's forced refspec, so force-pushes are
seen). A relative url is a path relative to the project root (the demo engine ships as a git
bundle file; git clones and fetches from bundle files like from any remote). ``--offline``
never contacts a network remote (the mirror must be cached) but still reads local ones.

A ref is a branch or tag name (``main``, ``v0.6.0``: ``refs/heads/`` then ``refs/tags/``) or a
full ref name (``refs/pull/56214/head``). The mirror holds every ref the remote advertises, so
a commit whose branch was force-pushed and deleted can still be pinned through a ref that keeps
it (GitHub keeps a merged pull request's head as ``refs/pull/N/head``); the pin's ``note`` keeps
the original branch name for the record.

Rules (see ``resolve``): a pinned rev that is no longer on its ref, or (without a pinned
rev) a previously locked commit that is no longer an ancestor of the ref's new head, is
never moved silently: resolution fails with one line saying so, unless ``--update NAME``
asks to move an unpinned source.

The tree hash (``tree_sha256``) is defined so that ``builder.foundation.canon.sha256_tree`` of an
exported tree gives the same value; see ``tree_hash_of_commit``.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path

from builder.errors import ResolveError
from builder.foundation.answer import Answer
from builder.foundation.canon import address, file_lock
from builder.inputs.pins import GitSource
from builder.lock.lockfile import LockedSource
from builder.lock.plainfiles import scrub_url

#: Seconds for one network git operation (clone/fetch) and for local plumbing.
FETCH_TIMEOUT = 1800
LOCAL_TIMEOUT = 300

HEX40 = re.compile(r"^[0-9a-f]{40}$")
PLACEHOLDER_HASH = "0" * 64


class GitError(Exception):
    """A git command failed; ``reason`` is one short line (the first ``fatal:``/``error:`` line)."""

    def __init__(self, reason: str, returncode: int) -> None:
        super().__init__(reason)
        self.reason = reason
        self.returncode = returncode


def git_env() -> dict[str, str]:
    env = dict(os.environ)
    env["GIT_TERMINAL_PROMPT"] = "0"
    env.setdefault("GIT_SSH_COMMAND", "ssh -o BatchMode=yes")
    env["LC_ALL"] = "C"
    env.pop("GIT_DIR", None)
    env.pop("GIT_WORK_TREE", None)
    env.pop("GIT_INDEX_FILE", None)
    return env


def _short_reason(stderr: bytes) -> str:
    a = Answer.from_parts(1, b"", stderr)
    return scrub_url(a.error(("fatal:", "error:")))[:240] if a.stderr.strip() else "git failed"


def git(args: list[str], *, cwd: Path | None = None, timeout: float = LOCAL_TIMEOUT,
        check: bool = True) -> subprocess.CompletedProcess[bytes]:
    """Run git with no prompts and a timeout; on failure raise GitError with a one-line reason."""
    cmd = ["git", "-c", "protocol.file.allow=always", "-c", "core.askPass=", *args]
    try:
        p = subprocess.run(cmd, cwd=cwd, env=git_env(), stdin=subprocess.DEVNULL, capture_output=True,
                           timeout=timeout, check=False)
    except subprocess.TimeoutExpired:
        raise GitError(f"git {args[0]} timed out after {int(timeout)}s", 124) from None
    except FileNotFoundError:
        raise GitError("git is not installed", 127) from None
    if check and p.returncode != 0:
        raise GitError(_short_reason(p.stderr), p.returncode)
    return p


def is_remote_url(url: str) -> bool:
    """True for scheme URLs (file://, https://, ssh://...) and scp-like user@host:path."""
    return "://" in url or bool(re.match(r"^[\w.-]+@[\w.-]+:", url))


def is_local_url(url: str) -> bool:
    """A path or file:// URL: reading it is not network access, so --offline allows it."""
    return url.startswith("file://") or not is_remote_url(url)


def source_url(url: str, root: Path) -> str:
    """The url git is given: scheme URLs as they are, other paths relative to the project root."""
    if is_remote_url(url):
        return url
    p = Path(url)
    return str(p if p.is_absolute() else (root / p).resolve())


def mirror_path(cache: Path, url: str) -> Path:
    """The bare mirror of this (already resolved) url in the cache."""
    return cache / f"{hashlib.sha256(url.encode()).hexdigest()[:16]}.git"


def ensure_mirror(url: str, cache: Path, *, offline: bool, name: str, shown: str | None = None) -> Path:
    """Return an up-to-date bare mirror of url (or, offline, the cached one as it is).

    Offline, a network remote is not contacted; a local one (a path, a bundle file, file://)
    is still fetched, since reading local files is not network access.
    """
    mirror = mirror_path(cache, url)
    shown = shown or scrub_url(url)
    cache.mkdir(parents=True, exist_ok=True)
    with file_lock(cache / f".{mirror.name}.lck"):
        if offline and not is_local_url(url):
            if not (mirror / "objects").is_dir():
                raise ResolveError(f"sources.{name}: not in the cache and --offline was given ({shown})")
            return mirror
        try:
            if (mirror / "objects").is_dir():
                git(["--git-dir", str(mirror), "fetch", "--prune", "--force", "--quiet", "origin"],
                    timeout=FETCH_TIMEOUT)
            else:
                tmp = Path(tempfile.mkdtemp(prefix=f".{mirror.name}.", dir=cache))
                try:
                    git(["clone", "--mirror", "--quiet", "--no-hardlinks", url, str(tmp / "m.git")],
                        timeout=FETCH_TIMEOUT)
                    os.replace(tmp / "m.git", mirror)
                finally:
                    shutil.rmtree(tmp, ignore_errors=True)
        except GitError as e:
            raise ResolveError(f"sources.{name}: cannot fetch {shown}: {e.reason}") from None
    return mirror


def _rev_parse(mirror: Path, expr: str) -> str | None:
    p = git(["--git-dir", str(mirror), "rev-parse", "--verify", "--quiet", f"{expr}^{{commit}}"], check=False)
    out = p.stdout.decode().strip()
    return out if p.returncode == 0 and HEX40.match(out) else None


def is_full_ref(ref: str) -> bool:
    """A full ref name (``refs/...``), taken as it is; anything else is a branch or tag name."""
    return ref.startswith("refs/")


def ref_head(mirror: Path, ref: str) -> str | None:
    """The commit a branch or tag (or full ref name, e.g. ``refs/pull/N/head``) points at, or None."""
    candidates = [ref] if is_full_ref(ref) else [f"refs/heads/{ref}", f"refs/tags/{ref}"]
    for c in candidates:
        sha = _rev_parse(mirror, c)
        if sha:
            return sha
    return None


def expand_rev(mirror: Path, rev: str) -> list[str]:
    """All commits whose id starts with rev (rev: at least 4 hex digits)."""
    if HEX40.match(rev):
        return [rev] if _rev_parse(mirror, rev) == rev else []
    p = git(["--git-dir", str(mirror), "rev-parse", f"--disambiguate={rev}"], check=False)
    objs = [ln.strip() for ln in p.stdout.decode().splitlines() if HEX40.match(ln.strip())]
    if not objs:
        return []
    check = subprocess.run(
        ["git", "--git-dir", str(mirror), "cat-file", "--batch-check=%(objectname) %(objecttype)"],
        input="\n".join(objs).encode() + b"\n", capture_output=True, env=git_env(), timeout=LOCAL_TIMEOUT,
        check=False)
    out = []
    for ln in check.stdout.decode().splitlines():
        parts = ln.split()
        if len(parts) == 2 and parts[1] == "commit":
            out.append(parts[0])
    return sorted(out)


def is_ancestor(mirror: Path, commit: str, head: str) -> bool:
    p = git(["--git-dir", str(mirror), "merge-base", "--is-ancestor", commit, head], check=False)
    if p.returncode in (0, 1):
        return p.returncode == 0
    return False  # the commit is not in the mirror any more (e.g. gc after a rewrite)


def commit_time(mirror: Path, commit: str) -> int:
    return int(git(["--git-dir", str(mirror), "show", "-s", "--format=%ct", commit]).stdout.decode().strip())


# ---------------------------------------------------------------------------------------
# the tree: hash and export, one definition


def _iter_tree(mirror: Path, commit: str) -> Iterator[tuple[str, str, bytes]]:
    """(path, kind, content) of every blob in the commit's tree; kind is "644", "755" or "link".

    Submodules (gitlinks) are skipped: an exported tree has no content for them.
    """
    ls = git(["--git-dir", str(mirror), "ls-tree", "-r", "-z", "--full-tree", commit])
    entries: list[tuple[str, str, str]] = []
    for rec in ls.stdout.split(b"\0"):
        if not rec:
            continue
        meta, _, raw_path = rec.partition(b"\t")
        mode, otype, oid = meta.decode().split()
        if otype != "blob":
            continue
        kind = {"100644": "644", "100755": "755", "120000": "link"}.get(mode, "644")
        entries.append((os.fsdecode(raw_path), kind, oid))
    for (path, kind, _), data in zip(entries, blobs(mirror, [oid for _, _, oid in entries]), strict=True):
        yield path, kind, data


def blobs(mirror: Path, oids: list[str]) -> Iterator[bytes]:
    """Each object's bytes in order, through one ``git cat-file --batch`` (the tree's export and hash,
    and a kit's files read from a source's tree)."""
    if not oids:
        return
    proc = subprocess.Popen(["git", "--git-dir", str(mirror), "cat-file", "--batch"], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=git_env())
    assert proc.stdin is not None and proc.stdout is not None
    stdin, stdout = proc.stdin, proc.stdout

    def feed() -> None:
        try:
            for oid in oids:
                stdin.write(oid.encode() + b"\n")
            stdin.close()
        except BrokenPipeError:
            pass

    writer = threading.Thread(target=feed, daemon=True)
    writer.start()
    try:
        for oid in oids:
            header = stdout.readline().decode().split()
            if len(header) != 3 or header[0] != oid:
                raise ResolveError(f"git cat-file: unexpected answer for object {oid[:12]}")
            data = stdout.read(int(header[2]))
            stdout.read(1)  # the newline after each object
            yield data
    finally:
        writer.join(timeout=5)
        stdout.close()
        proc.wait(timeout=LOCAL_TIMEOUT)


def tree_hash_of_commit(mirror: Path, commit: str) -> str:
    """Content hash of a commit's source tree, independent of git's object format.

    Definition (the same as ``builder.foundation.canon.sha256_tree`` of the exported tree): take every
    file of the tree as ``[path, kind, value]`` where path is relative with ``/``; kind is
    ``"755"`` for executables, ``"644"`` for other regular files (value: the sha256 hex of
    its bytes, as committed, no filters or line-ending conversion) and ``"link"`` for
    symlinks (value: the link target). Sort the list and take the sha256 of its canonical
    JSON (``builder.foundation.canon.address``). Directories are implied; empty ones and submodules
    do not count.
    """
    entries = []
    for path, kind, data in _iter_tree(mirror, commit):
        value = os.fsdecode(data) if kind == "link" else hashlib.sha256(data).hexdigest()
        entries.append([path, kind, value])
    return address(sorted(entries))


def export_tree(mirror: Path, commit: str, dest: Path) -> None:
    """Write the commit's tree into dest (created; must be empty), bytes exactly as committed.

    ``builder.foundation.canon.sha256_tree(dest)`` then equals ``tree_hash_of_commit(mirror, commit)``.
    mirror is any git directory (a bare mirror from ``ensure_mirror``, or a ``.git`` folder).
    """
    dest.mkdir(parents=True, exist_ok=True)
    if any(dest.iterdir()):
        raise ResolveError(f"{dest}: export folder is not empty")
    base = dest.resolve()
    for path, kind, data in _iter_tree(mirror, commit):
        target = (base / path)
        if ".." in Path(path).parts or Path(path).is_absolute():
            raise ResolveError(f"{commit[:12]}: refusing unsafe path in tree: {path!r}")
        target.parent.mkdir(parents=True, exist_ok=True)
        if kind == "link":
            os.symlink(os.fsdecode(data), target)
        else:
            fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o755 if kind == "755" else 0o644)
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.chmod(target, 0o755 if kind == "755" else 0o644)


# ---------------------------------------------------------------------------------------
# resolution


def _refuse(name: str, what: str, commit: str, ref: str, head: str, advice: str) -> ResolveError:
    moved = "the ref" if is_full_ref(ref) and not ref.startswith("refs/heads/") else "the branch"
    return ResolveError(
        f"sources.{name}: {what} {commit[:12]} is no longer on ref {ref} (ref now at {head[:12]}): "
        f"{moved} was force-pushed or rewritten; refusing to move it; {advice}")


def _ref_not_found(name: str, spec: GitSource, mirror: Path, shown: str, offline: bool) -> ResolveError:
    """One line for a ref the remote does not have, with what to do when the pinned rev is still there."""
    where = "in the cache" if offline else f"in {shown}"
    msg = f"sources.{name}: ref {spec.ref} not found {where}"
    if re.fullmatch(r"pull/\d+/head", spec.ref):
        return ResolveError(f"{msg}; a pull request's head is the full ref refs/{spec.ref}")
    if spec.rev and len(expand_rev(mirror, spec.rev)) == 1:
        return ResolveError(
            f"{msg}, but rev {spec.rev} is still there: the branch was deleted or renamed; pin a ref that "
            "holds the commit (a merged pull request keeps refs/pull/N/head) and keep the branch name in note")
    return ResolveError(msg)


def resolve(name: str, spec: GitSource, *, root: Path, cache: Path, offline: bool,
            previous: LockedSource | None, update: bool) -> LockedSource:
    """Resolve one git source to a LockedSource (patches empty; builder.lock.resolve fills them and spec_hash).

    - ``ref``: a branch or tag name, or a full ref name such as ``refs/pull/N/head`` (the ref
      that keeps a commit whose branch was deleted); a missing ref is one line, which says so
      when the pinned rev is still in the repository.
    - ``rev`` pinned: it is expanded to the full commit (error if missing or ambiguous) and
      must be an ancestor of the ref's head; if not, ResolveError (never moved silently).
    - no ``rev``: the commit is the ref's head; if a previous lock entry (same url and ref)
      holds a commit that is not an ancestor of the new head, ResolveError unless ``update``.
    - offline: a network remote is not contacted (the mirror cache must have it); local
      remotes (paths, bundle files, file://) are still read.
    """
    url = source_url(spec.url, root)
    shown = scrub_url(spec.url)
    mirror = ensure_mirror(url, cache, offline=offline, name=name, shown=shown)
    head = ref_head(mirror, spec.ref)
    if head is None:
        raise _ref_not_found(name, spec, mirror, shown, offline)
    if spec.rev:
        found = expand_rev(mirror, spec.rev)
        if not found:
            extra = " (the cache may be stale; run without --offline)" if offline else ""
            raise ResolveError(f"sources.{name}: rev {spec.rev} not found in {shown}{extra}")
        if len(found) > 1:
            raise ResolveError(f"sources.{name}: rev {spec.rev} is ambiguous in {shown} "
                               f"({', '.join(c[:12] for c in found)}); pin more digits")
        commit = found[0]
        on_ref = is_ancestor(mirror, commit, head)
        if not on_ref:
            raise _refuse(name, "pinned commit", commit, spec.ref, head, "re-pin rev after review")
    else:
        commit = head
        on_ref = True
        same = previous is not None and previous.url == spec.url and previous.ref == spec.ref
        if (same and previous is not None and previous.commit != head and not update
                and not is_ancestor(mirror, previous.commit, head)):
            raise _refuse(name, "locked commit", previous.commit, spec.ref, head,
                          f"run `builder lock --update {name}` after review")
    try:
        tree = tree_hash_of_commit(mirror, commit)
        ctime = commit_time(mirror, commit)
    except GitError as e:
        raise ResolveError(f"sources.{name}: cannot read {commit[:12]} from the cache: {e.reason}") from None
    return LockedSource(spec_hash=PLACEHOLDER_HASH, url=spec.url, ref=spec.ref, rev=spec.rev, commit=commit,
                        ref_head=head, on_ref=on_ref, tree_sha256=tree, commit_time=ctime, patches=[])


__all__ = ["resolve", "ensure_mirror", "mirror_path", "source_url", "ref_head", "expand_rev", "is_ancestor",
           "tree_hash_of_commit", "export_tree", "GitError"]
