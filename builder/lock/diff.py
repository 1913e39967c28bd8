"""What moved between two locks: commits, patches, model files, digests, files, kits, toolchains.

A lock is named by a path, or by ``REV:path`` for a git revision of the lock file
(``git show REV:./path``, the path taken relative to the current folder).
"""

from __future__ import annotations

import json
import subprocess
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from builder.errors import ConfigError
from builder.inputs.loader import validate
from builder.inputs.pins import INPUT_KINDS
from builder.lock import wheelset
from builder.lock.lockfile import (
    Lock,
    LockedBase,
    LockedFile,
    LockedImage,
    LockedKit,
    LockedLane,
    LockedModel,
    LockedPublishedImage,
    LockedSource,
    LockedToolchain,
)

KIND_ORDER = (*INPUT_KINDS, "images", "lanes")
KIND_WORD = {"sources": "source", "toolchains": "toolchain", "bases": "base", "models": "model",
             "files": "file", "kits": "kit", "wheels": "wheel set", "images": "image", "lanes": "lane"}


@dataclass(frozen=True)
class Change:
    input: str  # "sources.engine"
    kind: str  # "source", "model", ...
    what: str  # one human line: "commit a1b2c3d4e5f6 -> 0f9e8d7c6b5a"

    def as_dict(self) -> dict[str, str]:
        return asdict(self)


def _moved(what: str, old: Any, new: Any, *, short: bool = False) -> list[str]:
    """["WHAT old -> new"] when the two differ (ids shortened with ``short``), else []."""
    if old == new:
        return []
    return [f"{what} {_s(old)} -> {_s(new)}" if short else f"{what} {old} -> {new}"]


def _platforms(old: dict[str, str], new: dict[str, str], changed: str, *, show_added: bool) -> list[str]:
    """What moved in a per-platform map of ids: platforms added or removed, ids changed."""
    out = []
    for plat in sorted(set(old) | set(new)):
        a, b = old.get(plat), new.get(plat)
        if a is None:
            out.append(f"platform added {plat} {_s(b)}" if show_added else f"platform added {plat}")
        elif b is None:
            out.append(f"platform removed {plat}")
        elif a != b:
            out.append(f"{changed} {plat} {_s(a)} -> {_s(b)}")
    return out


def _s(x: str | None, n: int = 12) -> str:
    if x is None:
        return "-"
    if x.startswith("sha256:"):
        return "sha256:" + x[7:7 + n]
    return x[:n]


def read_lock(spec: str, *, cwd: Path | None = None) -> tuple[Lock, str]:
    """Load a lock from a path or ``REV:path``; returns the lock and a label for it."""
    base = cwd or Path.cwd()
    path = Path(spec)
    if not (base / path).is_file() and ":" in spec and not spec.startswith("/"):
        rev, _, rel = spec.partition(":")
        rel = rel or "pins.lock"
        git_path = rel if rel.startswith(("./", "../", "/")) else f"./{rel}"
        if git_path.startswith("/"):
            top = _git_top(base)
            git_path = str(Path(git_path).resolve().relative_to(top))
        try:
            p = subprocess.run(["git", "show", f"{rev}:{git_path}"], cwd=base, capture_output=True,
                               timeout=60, check=False, stdin=subprocess.DEVNULL)
        except (FileNotFoundError, subprocess.TimeoutExpired):
            raise ConfigError(f"{spec}: cannot run git") from None
        if p.returncode != 0:
            why = p.stderr.decode("utf-8", "replace").strip().splitlines()
            reason = why[-1].removeprefix("fatal: ") if why else "git show failed"
            raise ConfigError(f"{spec}: not readable from git: {reason}")
        return _parse(p.stdout, spec), spec
    full = base / path
    if not full.is_file():
        raise ConfigError(f"{spec}: no such lock file")
    return _parse(full.read_bytes(), spec), spec


def _git_top(base: Path) -> Path:
    p = subprocess.run(["git", "rev-parse", "--show-toplevel"], cwd=base, capture_output=True, check=False)
    if p.returncode != 0:
        raise ConfigError(f"{base}: not inside a git repository")
    return Path(p.stdout.decode().strip())


def _parse(data: bytes, label: str) -> Lock:
    try:
        obj = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConfigError(f"{label}: malformed JSON: {e}") from None
    return validate(Lock, obj, label)


# ---------------------------------------------------------------------------------------
# comparing entries


def _source(old: LockedSource, new: LockedSource) -> list[str]:
    out = _moved("url", old.url, new.url) + _moved("ref", old.ref, new.ref)
    out += _moved("commit", old.commit, new.commit, short=True) or _moved(
        "tree", old.tree_sha256, new.tree_sha256, short=True)
    if old.on_ref and not new.on_ref:
        out.append(f"no longer on ref {new.ref}")
    old_p = {p.file: p for p in old.patches}
    new_p = {p.file: p for p in new.patches}
    for p in new.patches:
        if p.file not in old_p:
            out.append(f"patch added {p.file}")
        elif old_p[p.file].sha256 != p.sha256:
            out.append(f"patch changed {p.file} (sha256 {_s(old_p[p.file].sha256)} -> {_s(p.sha256)})")
        elif old_p[p.file].reason != p.reason:
            out.append(f"patch reason changed {p.file}")
    for p in old.patches:
        if p.file not in new_p:
            out.append(f"patch removed {p.file}")
    common_old = [p.file for p in old.patches if p.file in new_p]
    common_new = [p.file for p in new.patches if p.file in old_p]
    if common_old != common_new:
        out.append("patch series reordered")
    return out


def _toolchain(old: LockedToolchain, new: LockedToolchain) -> list[str]:
    return _moved("version", old.version, new.version) + _platforms(
        {p: a.sha256 for p, a in old.platforms.items()}, {p: a.sha256 for p, a in new.platforms.items()},
        "sha256 changed", show_added=False)


def _base(old: LockedBase, new: LockedBase) -> list[str]:
    out = _moved("ref", old.ref, new.ref)
    out += _moved("index digest changed", old.index_digest, new.index_digest, short=True)
    out += _platforms(old.platforms, new.platforms, "digest changed", show_added=True)
    out += _moved("source", old.source, new.source)
    for plat in sorted(set(old.config_env) & set(new.config_env)):
        if old.config_env[plat] != new.config_env[plat]:
            a_env, b_env = set(old.config_env[plat]), set(new.config_env[plat])
            names = sorted({e.split("=", 1)[0] for e in a_env ^ b_env})
            out.append(f"config env changed {plat}: {', '.join(names)}")
    return out


def _model(old: LockedModel, new: LockedModel) -> list[str]:
    out = _moved("repo", old.repo, new.repo) + _moved("commit", old.commit, new.commit, short=True)
    a = {f.path: f for f in old.files}
    b = {f.path: f for f in new.files}
    changed = sum(1 for p in a.keys() & b.keys() if (a[p].sha256, a[p].size) != (b[p].sha256, b[p].size))
    added, removed = len(b.keys() - a.keys()), len(a.keys() - b.keys())
    if changed or added or removed:
        parts = [f"{n} {w}" for n, w in ((changed, "changed"), (added, "added"), (removed, "removed")) if n]
        out.append(f"model files changed: {', '.join(parts)}")
    return out + _moved("source", old.source, new.source)


def _files_moved(what: str, old: list[Any], new: list[Any]) -> list[str]:
    a = {f.path: f for f in old}
    b = {f.path: f for f in new}
    changed = sorted(p for p in a.keys() & b.keys() if (a[p].sha256, a[p].size) != (b[p].sha256, b[p].size))
    added, removed = sorted(b.keys() - a.keys()), sorted(a.keys() - b.keys())
    if not (changed or added or removed):
        return []
    parts = [f"{len(n)} {w}" for n, w in ((changed, "changed"), (added, "added"), (removed, "removed")) if n]
    named = (changed + added + removed)[:3]
    more = len(changed) + len(added) + len(removed) - len(named)
    return [f"{what} changed: {', '.join(parts)} ({', '.join(named)}{f' +{more} more' if more else ''})"]


def _kit(old: LockedKit, new: LockedKit) -> list[str]:
    out = _moved("origin", old.origin, new.origin) + _moved("source", old.source, new.source)
    out += _moved("commit", old.commit, new.commit, short=True) + _moved("path", old.path, new.path)
    out += _moved("MANIFEST sha256", old.manifest.sha256, new.manifest.sha256, short=True)
    return out + _files_moved("kit files", old.files, new.files)


def _file(old: LockedFile, new: LockedFile) -> list[str]:
    return _moved("url", old.url, new.url) + _moved("sha256", old.sha256, new.sha256, short=True)


def _image(old: LockedImage | LockedPublishedImage, new: LockedImage | LockedPublishedImage) -> list[str]:
    if isinstance(old, LockedPublishedImage) or isinstance(new, LockedPublishedImage):
        def what(e: LockedImage | LockedPublishedImage) -> str:
            return e.published if isinstance(e, LockedPublishedImage) else f"recipe {e.recipe}"

        return _moved("platform", old.platform, new.platform) + _moved("image", what(old), what(new))
    out = _moved("platform", old.platform, new.platform)
    a, b = old.recipe_files, new.recipe_files
    changed = sorted(p for p in a.keys() & b.keys() if a[p] != b[p])
    for p in changed:
        out.append(f"recipe file changed {p}")
    for p in sorted(b.keys() - a.keys()):
        out.append(f"recipe file added {p}")
    for p in sorted(a.keys() - b.keys()):
        out.append(f"recipe file removed {p}")
    return out + _moved("source date", old.source_date_epoch, new.source_date_epoch)


def _lane(old: LockedLane, new: LockedLane) -> list[str]:
    return _moved("image", old.image, new.image) + _moved(
        "models", ", ".join(old.models) or "-", ", ".join(new.models) or "-")


COMPARE: dict[str, Any] = {"sources": _source, "toolchains": _toolchain, "bases": _base, "models": _model,
                           "files": _file, "kits": _kit, "wheels": wheelset.compare, "images": _image,
                           "lanes": _lane}


def diff_locks(old: Lock, new: Lock) -> list[Change]:
    """Every change from old to new, input by input, in a stable order."""
    out: list[Change] = []
    for kind in KIND_ORDER:
        a: dict[str, Any] = getattr(old, kind)
        b: dict[str, Any] = getattr(new, kind)
        word = KIND_WORD[kind]
        for name in sorted(set(a) | set(b)):
            key = f"{kind}.{name}"
            if name not in a:
                out.append(Change(key, word, "added"))
                continue
            if name not in b:
                out.append(Change(key, word, "removed"))
                continue
            lines = COMPARE[kind](a[name], b[name])
            if not lines and a[name].spec_hash != b[name].spec_hash:
                lines = ["pin edited (same resolution)"]
            out.extend(Change(key, word, line) for line in lines)
    return out


def diff(old_spec: str, new_spec: str, *, cwd: Path | None = None) -> list[Change]:
    old, _ = read_lock(old_spec, cwd=cwd)
    new, _ = read_lock(new_spec, cwd=cwd)
    return diff_locks(old, new)


__all__ = ["Change", "diff", "diff_locks", "read_lock"]
