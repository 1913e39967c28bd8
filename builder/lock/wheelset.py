"""Wheel sets (``[wheels.NAME]``): a hash-pinned requirements file locked to the wheel files it names.

The pin is a requirements file in pip's hash-checking form (``name==version`` and one or more
``--hash=sha256:...`` per distribution; comments and backslash continuations as pip reads them; no
markers, extras, ranges, includes or index options: each line names one file). Locking it finds, for
each requirement, the wheel whose sha256 the file lists, in the wheelhouses (each folder of
``BUILDER_WHEELHOUSE``, then ``.cache/wheelhouse`` in the project: the folders a wheel toolchain is
taken from); online, pip downloads the missing ones there first (``--require-hashes``). Every candidate
is hashed for real; the lock records each wheel's name, version, filename, size and sha256, and the
requirements file's own sha256, so that an edit of the file is seen (``check``). Nothing is
guessed: a requirement no wheelhouse holds is named, with the one command that fills the wheelhouse.

The lock entry's schema lives here (lockfile imports it); this module imports nothing of lockfile.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import Field

from builder.errors import ConfigError, ResolveError
from builder.foundation.canon import run_folder
from builder.foundation.hashing import in_parallel, sha256_file
from builder.inputs.schema import Sha256, Strict
from builder.inputs.wheelpin import WheelSet

WHEEL_RE = re.compile(r"^(?P<name>[A-Za-z0-9_.]+)-(?P<version>[A-Za-z0-9_.!+]+)(-\d[A-Za-z0-9_]*)?"
                      r"-[A-Za-z0-9_.]+-[A-Za-z0-9_.]+-[A-Za-z0-9_.]+\.whl$")
_REQ_RE = re.compile(r"^(?P<name>[A-Za-z0-9][A-Za-z0-9._-]*)\s*==\s*(?P<version>[A-Za-z0-9_.!+-]+)$")
_HASH_RE = re.compile(r"^--hash[= ]sha256:(?P<hex>[0-9a-f]{64})$")


class LockedWheel(Strict):
    name: str  # the distribution's normalized name (PEP 503)
    version: str
    filename: str = Field(pattern=r"^[A-Za-z0-9_.!+-]+\.whl$")
    sha256: Sha256
    size: int = Field(ge=0)


class LockedWheelSet(Strict):
    spec_hash: Sha256
    requirements: str  # the requirements file, relative to the project
    requirements_sha256: Sha256
    wheels: list[LockedWheel]
    total_size: int = Field(ge=0)


@dataclass(frozen=True)
class Requirement:
    name: str  # normalized
    version: str
    hashes: frozenset[str]
    line: int


def normalize(name: str) -> str:
    """A distribution name as PEP 503 compares it."""
    return re.sub(r"[-_.]+", "-", name).lower()


def wheel_name_version(filename: str) -> tuple[str, str] | None:
    """(normalized name, version) a wheel's filename gives, or None for a name that is not a wheel's."""
    m = WHEEL_RE.match(filename)
    return (normalize(m.group("name")), m.group("version")) if m else None


def parse_requirements(text: str, where: str) -> list[Requirement]:
    """The requirements of a hash-pinned requirements file, in its order (ConfigError naming the line)."""
    out: list[Requirement] = []
    seen: set[str] = set()
    logical: list[tuple[int, str]] = []
    pending, start = "", 0
    for no, raw in enumerate(text.splitlines(), 1):
        line = re.sub(r"(^|\s)#.*$", "", raw).rstrip()
        if not pending:
            start = no
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        pending += line
        if pending.strip():
            logical.append((start, pending.strip()))
        pending = ""
    if pending.strip():
        logical.append((start, pending.strip()))
    for no, line in logical:
        head, *opts = line.split()
        if head.startswith("-"):
            raise ConfigError(f"{where}:{no}: {head}: only `name==version --hash=sha256:...` lines are read "
                              "(no options, includes or indexes)")
        m = _REQ_RE.match(head)
        if m is None or ";" in line or "[" in head:
            raise ConfigError(f"{where}:{no}: {head!r}: want `name==version` (one exact version, no extras or "
                              "markers)")
        hashes = set()
        joined = " ".join(opts).replace("--hash sha256:", "--hash=sha256:").split()
        for opt in joined:
            h = _HASH_RE.match(opt)
            if h is None:
                raise ConfigError(f"{where}:{no}: {opt!r}: only --hash=sha256:<64 hex> follows a requirement")
            hashes.add(h.group("hex"))
        name = normalize(m.group("name"))
        if not hashes:
            raise ConfigError(f"{where}:{no}: {name}: no --hash=sha256:...; every wheel is pinned by its sha256")
        if name in seen:
            raise ConfigError(f"{where}:{no}: {name}: named twice")
        seen.add(name)
        out.append(Requirement(name=name, version=m.group("version"), hashes=frozenset(hashes), line=no))
    if not out:
        raise ConfigError(f"{where}: no requirements")
    return out


def wheelhouses(root: Path) -> list[Path]:
    """Where wheels are looked for: each folder of BUILDER_WHEELHOUSE, then the project's .cache/wheelhouse."""
    out = [Path(x) for x in os.environ.get("BUILDER_WHEELHOUSE", "").split(os.pathsep) if x]
    out.append(root / ".cache" / "wheelhouse")
    return out


def requirements_path(spec: WheelSet, root: Path, name: str) -> Path:
    path = root / spec.requirements
    if not path.is_file():
        raise ConfigError(f"wheels.{name}.requirements: no such file: {spec.requirements}")
    return path


def fill_command(spec: WheelSet, house: Path) -> str:
    """The one command that puts every wheel of the set into the wheelhouse ``house``."""
    return (f"python3 -m pip download --no-deps --require-hashes --only-binary=:all: -d {shlex.quote(str(house))} "
            f"-r {shlex.quote(spec.requirements)}")


def _candidates(houses: list[Path]) -> dict[str, list[Path]]:
    """Every wheel file in the wheelhouses, by normalized distribution name."""
    out: dict[str, list[Path]] = {}
    for house in houses:
        if not house.is_dir():
            continue
        for p in sorted(house.iterdir()):
            nv = wheel_name_version(p.name) if p.suffix == ".whl" and p.is_file() else None
            if nv is not None:
                out.setdefault(nv[0], []).append(p)
    return out


def _match(reqs: list[Requirement], houses: list[Path]) -> tuple[dict[str, tuple[Path, str, int]], list[Requirement]]:
    """Each requirement's wheel (path, sha256, size) among the wheelhouses' files, every candidate hashed;
    and the requirements none matched."""
    found = _candidates(houses)
    todo = [p for r in reqs for p in found.get(r.name, []) if wheel_name_version(p.name) == (r.name, r.version)]
    hashed = dict(zip(todo, in_parallel(sha256_file, todo, size=lambda p: p.stat().st_size), strict=True))
    got: dict[str, tuple[Path, str, int]] = {}
    for r in reqs:
        for p in found.get(r.name, []):
            if p in hashed and hashed[p][0] in r.hashes:
                got[r.name] = (p, *hashed[p])
                break
    return got, [r for r in reqs if r.name not in got]


def _download(spec: WheelSet, missing: list[Requirement], house: Path, where: str) -> None:
    """pip downloads the missing wheels into ``house``, each checked against its pinned hashes."""
    house.mkdir(parents=True, exist_ok=True)
    with run_folder("builder-wheels-") as td:
        req = td / "missing.txt"
        req.write_text("".join(f"{r.name}=={r.version} " + " ".join(f"--hash=sha256:{h}" for h in sorted(r.hashes))
                               + "\n" for r in missing))
        cmd = ["python3", "-m", "pip", "download", "--no-deps", "--require-hashes", "--only-binary=:all:", "-q",
               "--disable-pip-version-check", "-d", str(house), "-r", str(req)]
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
    if r.returncode != 0:
        said = next((ln.strip() for ln in reversed(r.stderr.splitlines()) if ln.strip()), f"exit {r.returncode}")
        raise ResolveError(f"{where}: pip could not download {len(missing)} wheel(s) ({said}); with the wheels "
                           f"downloaded elsewhere, fill the wheelhouse: `{fill_command(spec, house)}`")


def resolve(name: str, spec: WheelSet, *, root: Path, offline: bool, spec_hash: str) -> LockedWheelSet:
    """Lock a wheel set: every requirement to the wheel file its hash names, found in a wheelhouse
    (online, downloaded there by pip first when missing)."""
    where = f"wheels.{name}"
    path = requirements_path(spec, root, name)
    req_sha, _ = sha256_file(path)
    reqs = parse_requirements(path.read_text(encoding="utf-8"), spec.requirements)
    houses = wheelhouses(root)
    got, missing = _match(reqs, houses)
    if missing and not offline:
        _download(spec, missing, houses[0], where)
        got, missing = _match(reqs, houses)
    if missing:
        first = missing[0]
        looked = ", ".join(str(h) for h in houses)
        raise ResolveError(f"{where}: {len(missing)} of {len(reqs)} wheel(s) are in no wheelhouse ({looked}), "
                           f"first {first.name}=={first.version} ({spec.requirements}:{first.line})"
                           + (" and --offline was given" if offline else "")
                           + f"; fill the wheelhouse: `{fill_command(spec, houses[0])}`")
    wheels = [LockedWheel(name=r.name, version=r.version, filename=got[r.name][0].name, sha256=got[r.name][1],
                          size=got[r.name][2]) for r in sorted(reqs, key=lambda r: r.name)]
    return LockedWheelSet(spec_hash=spec_hash, requirements=spec.requirements, requirements_sha256=req_sha,
                          wheels=wheels, total_size=sum(w.size for w in wheels))


def check(name: str, entry: LockedWheelSet, root: Path) -> str | None:
    """Why a locked set no longer holds: its requirements file is missing or changed (None: it holds).
    `lockfile.why_stale` asks it, for `builder lock` and `--check` alike."""
    path = root / entry.requirements
    if not path.is_file():
        return f"wheels.{name}: {entry.requirements} is missing"
    if sha256_file(path)[0] != entry.requirements_sha256:
        return f"wheels.{name}: {entry.requirements} changed since the lock"
    return None


def identity(entry: LockedWheelSet) -> str:
    """What names a locked set's content in `builder lock`'s "moved" lines."""
    return f"{entry.requirements_sha256[:12]} ({len(entry.wheels)} wheels)"


def closure_entry(entry: LockedWheelSet) -> dict[str, str]:
    """What an image's closure holds of a set: each wheel's filename and sha256."""
    return {w.filename: w.sha256 for w in sorted(entry.wheels, key=lambda w: w.filename)}


def compare(old: LockedWheelSet, new: LockedWheelSet) -> list[str]:
    """`builder diff`'s lines for one set: the requirements file, and each wheel added, removed or moved."""
    out = [] if old.requirements == new.requirements else [f"requirements {old.requirements} -> {new.requirements}"]
    a = {w.name: w for w in old.wheels}
    b = {w.name: w for w in new.wheels}
    for n in sorted(a.keys() & b.keys()):
        if (a[n].version, a[n].sha256) != (b[n].version, b[n].sha256):
            out.append(f"wheel {n} {a[n].version} ({a[n].sha256[:12]}) -> {b[n].version} ({b[n].sha256[:12]})")
    out += [f"wheel added {n}=={b[n].version}" for n in sorted(b.keys() - a.keys())]
    out += [f"wheel removed {n}=={a[n].version}" for n in sorted(a.keys() - b.keys())]
    return out


def sbom_items(closure: dict[str, Any]) -> list[tuple[str, str, str, str, str]]:
    """(set, filename, name, version, sha256) of every wheel an image's closure holds, sorted."""
    out = []
    for set_name, wheels in sorted((closure.get("wheels") or {}).items()):
        for filename, sha in sorted(wheels.items()):
            name, version = wheel_name_version(filename) or (filename, "")
            out.append((set_name, filename, name, version, sha))
    return out
