"""A bundle's manifest: its format, the names a bundle folder uses, the structure and path rules
every manifest must meet (check_manifest), its id and the files it lists."""

# ruff: noqa: UP031
from __future__ import annotations

import hashlib
import os
import re
from collections.abc import Callable
from typing import Any

from builder.core.canonjson import canonical_json

from .errors import InstallError

FORMAT = 1
KIND = "builder-bundle"
MANIFEST = "manifest.json"
SIGNATURE = "manifest.json.minisig"
IMAGE_ARCHIVE = "image.tar"
#: the CA file of the fleet registry's TLS, carried by a bundle whose model files come from the registry
REGISTRY_CA = "registry-ca.crt"
RESERVED = (MANIFEST, SIGNATURE)
MAX_MANIFEST = 64 * 1024 * 1024
MODES = {"0644": 0o644, "0755": 0o755}
HEX64 = re.compile(r"^[0-9a-f]{64}$")
DIGEST = re.compile(r"^sha256:[0-9a-f]{64}$")
#: a lane, image, input, fleet or host name: the one rule, here because the installer checks it on hosts
#: with the standard library alone; builder.inputs.schema (the pydantic field) and the operator side use it
NAME_RE = r"^[a-z0-9][a-z0-9._-]{0,63}$"
NAME = re.compile(NAME_RE)

# host[:port]/repo@sha256:<hex>: the only form of image.pull (by digest, never by tag)
REPOSITORY = re.compile(r"^[a-z0-9]+([._/-][a-z0-9]+)*$")
REGISTRY_URL = re.compile(r"^https?://([A-Za-z0-9.-]+|\[[0-9A-Fa-f:]+\])(:[0-9]{1,5})?$")

PULL_REF = re.compile(
    r"^([A-Za-z0-9.-]+|\[[0-9A-Fa-f:]+\])(:[0-9]{1,5})?/[a-z0-9]+([._/-][a-z0-9]+)*@sha256:[0-9a-f]{64}$"
)


def is_name(s: str) -> bool:
    """The whole of `s` is a name (fullmatch: ``$`` alone would also take a name with a final newline,
    which the schema's pattern refuses)."""
    return NAME.fullmatch(s) is not None


def bundle_id_of(manifest: dict[str, Any]) -> str:
    """sha256 of the canonical manifest body without its bundle_id."""
    body = {k: v for k, v in manifest.items() if k != "bundle_id"}
    return hashlib.sha256(canonical_json(body)).hexdigest()


def _err(where: str, msg: str) -> InstallError:
    return InstallError("%s: %s: %s" % (MANIFEST, where, msg))


def _want(obj: Any, keys: dict[str, Any], where: str, optional: tuple[str, ...] = ()) -> None:
    if not isinstance(obj, dict):
        raise _err(where, "expected an object")
    for k in sorted(obj):
        if k not in keys:
            raise _err("%s.%s" % (where, k) if where else k, "unknown key")
    for k, typ in keys.items():
        p = "%s.%s" % (where, k) if where else k
        if k not in obj:
            if k in optional:
                continue
            raise _err(p, "missing required key")
        v = obj[k]
        if typ is int:
            ok = isinstance(v, int) and not isinstance(v, bool)
        elif typ == "str?":
            ok = v is None or isinstance(v, str)
        else:
            ok = isinstance(v, typ)
        if not ok:
            raise _err(p, "wrong type")


def check_rel_path(path: str, where: str) -> str:
    """A path inside the bundle: relative, '/'-separated, no '..', '.', empty parts or odd characters."""
    if not path or len(path) > 1024:
        raise _err(where, "empty or too long path")
    if path.startswith("/") or "\\" in path or any(ch in path for ch in "\x00\r\n"):
        raise _err(where, "path %r escapes the bundle or has odd characters" % path)
    parts = path.split("/")
    for p in parts:
        if p in ("", ".", ".."):
            raise _err(where, "path %r escapes the bundle (empty, '.' or '..' part)" % path)
    return path


def check_abs_path(path: str, where: str) -> str:
    if not isinstance(path, str) or not path.startswith("/") or any(ch in path for ch in "\x00\r\n\\"):
        raise _err(where, "not an absolute path: %r" % (path,))
    if os.path.normpath(path) != path or ".." in path.split("/") or path.startswith("//"):
        raise _err(where, "path %r is not normalized (or has '..')" % path)
    return path


def under(path: str, root: str) -> bool:
    return path.startswith(root.rstrip("/") + "/")


def check_manifest(obj: Any) -> dict[str, Any]:
    """Validate a manifest's structure and every path rule; return it. InstallError on the first problem."""
    _check_identity(obj)
    img = obj["image"]
    _check_image(img)
    paths = obj["paths"]
    _want(paths, {"bundles": str, "models": str, "engram": str}, "paths")
    for k in ("bundles", "models", "engram"):
        check_abs_path(paths[k], "paths." + k)
    names, physical = _check_files(obj["files"])
    _check_no_file_under_a_file(physical)
    if img["archive"] is not None and img["archive"] not in names:
        raise _err("image.archive", "names no file of the bundle")
    _check_models(obj["models"], obj["files"], names, paths)
    return obj


def _check_identity(obj: Any) -> None:
    """The top level's keys, and who the bundle is for: format, kind, id, fleet, host, lane, rank, role."""
    _want(
        obj,
        {
            "format": int,
            "kind": str,
            "bundle_id": str,
            "builder": str,
            "fleet": str,
            "host": str,
            "lane": str,
            "rank": int,
            "role": str,
            "world_size": int,
            "lock_hash": str,
            "image": dict,
            "paths": dict,
            "files": list,
            "models": list,
        },
        "",
    )
    if obj["format"] != FORMAT:
        raise _err(
            "format", "unsupported bundle format %r (this installer reads %d)" % (obj["format"], FORMAT)
        )
    if obj["kind"] != KIND:
        raise _err("kind", "not a builder bundle")
    if not HEX64.match(obj["bundle_id"]):
        raise _err("bundle_id", "not a sha256")
    for k in ("fleet", "host", "lane"):
        if not is_name(obj[k]):
            raise _err(k, "not a valid name")
    if obj["role"] not in ("head", "worker"):
        raise _err("role", "must be head or worker")
    if not (1 <= obj["world_size"] <= 64 and 0 <= obj["rank"] < obj["world_size"]):
        raise _err("rank", "rank/world_size out of range")
    if (obj["rank"] == 0) != (obj["role"] == "head"):
        raise _err("role", "rank 0 is the head and only rank 0")
    if not HEX64.match(obj["lock_hash"]):
        raise _err("lock_hash", "not a sha256")


def _check_image(img: Any) -> None:
    """``image``: its digests, and how the host gets it (the archive, a pull by digest, a thin archive)."""
    _want(
        img,
        {"name": str, "input_address": str, "image_id": str, "diff_ids": list, "archive": "str?", "pull": "str?",
         "omitted_layers": int},
        "image",
        optional=("pull", "omitted_layers"),
    )
    if not HEX64.match(img["input_address"]):
        raise _err("image.input_address", "not a sha256")
    if not DIGEST.match(img["image_id"]):
        raise _err("image.image_id", "not a sha256: digest")
    for i, d in enumerate(img["diff_ids"]):
        if not isinstance(d, str) or not DIGEST.match(d):
            raise _err("image.diff_ids[%d]" % i, "not a sha256: digest")
    if img["archive"] is not None and img["archive"] != IMAGE_ARCHIVE:
        raise _err("image.archive", "must be %r or null" % IMAGE_ARCHIVE)
    if img.get("pull") is not None and not PULL_REF.match(img["pull"]):
        raise _err("image.pull", "not a registry reference by digest (host:port/repo@sha256:...)")
    if "omitted_layers" in img and (img["archive"] is None or not 0 < img["omitted_layers"] <= len(img["diff_ids"])):
        raise _err("image.omitted_layers", "must count leading layers of a carried archive")


def _check_files(files: list[Any]) -> tuple[set[str], dict[str, str]]:
    """``files``: each entry and its parts. Returns the files' paths and the folder's own files (a part
    instead of a file in parts), each with where the manifest lists it, in the manifest's order."""
    physical: dict[str, str] = {}

    def claim(p: str, where: str) -> None:
        if p in RESERVED:
            raise _err(where, "path %r is reserved" % p)
        if p in physical:
            raise _err(where, "path %r listed twice" % p)
        physical[p] = where

    names = set()
    for i, f in enumerate(files):
        w = "files[%d]" % i
        _want(
            f, {"path": str, "size": int, "sha256": str, "mode": str, "parts": list}, w, optional=("parts",)
        )
        check_rel_path(f["path"], w + ".path")
        if f["path"].startswith("parts/"):
            raise _err(w + ".path", "the parts/ folder is for parts only")
        if f["size"] < 0 or not HEX64.match(f["sha256"]):
            raise _err(w, "bad size or sha256")
        if f["mode"] not in MODES:
            raise _err(w + ".mode", "must be one of %s" % ", ".join(sorted(MODES)))
        if f["path"] in names:
            raise _err(w + ".path", "path %r listed twice" % f["path"])
        names.add(f["path"])
        parts = f.get("parts")
        if parts is None:
            claim(f["path"], w + ".path")
            continue
        _check_parts(f, parts, w, claim)
    return names, physical


def _check_parts(f: dict[str, Any], parts: list[Any], w: str, claim: Callable[[str, str], None]) -> None:
    """A file in parts (``w``: where the manifest lists it): at least two, named in order, their sizes
    adding up to the file's; each part's path is claimed as it is checked."""
    if len(parts) < 2:
        raise _err(w + ".parts", "a file in parts has at least two")
    total = 0
    for j, p in enumerate(parts):
        pw = "%s.parts[%d]" % (w, j)
        _want(p, {"path": str, "size": int, "sha256": str}, pw)
        expect = "parts/%s.part%04d" % (f["path"], j)
        if p["path"] != expect:
            raise _err(pw + ".path", "expected %r" % expect)
        if p["size"] <= 0 or not HEX64.match(p["sha256"]):
            raise _err(pw, "bad size or sha256")
        total += p["size"]
        claim(p["path"], pw + ".path")
    if total != f["size"]:
        raise _err(w + ".parts", "part sizes add up to %d, not %d" % (total, f["size"]))


def _check_no_file_under_a_file(physical: dict[str, str]) -> None:
    """A file may not also be a folder of another file."""
    for ph in physical:
        pre = ph.split("/")
        for depth in range(1, len(pre)):
            if "/".join(pre[:depth]) in physical:
                raise _err(physical[ph], "path %r lies under the file %r" % (ph, "/".join(pre[:depth])))


def _check_models(models: list[Any], files: list[dict[str, Any]], names: set[str], paths: dict[str, str]) -> None:
    """``models``: each file the host must hold, under paths.models or paths.engram, listed once; one
    the bundle carries (``bundled``) is a models/ file of the bundle of the same size and sha256; one
    the host pulls from the fleet registry (``registry``) is named there by its sha256."""
    targets = set()
    for i, m in enumerate(models):
        w = "models[%d]" % i
        _want(m, {"model": str, "file": str, "path": str, "size": int, "sha256": str, "bundled": "str?",
                  "registry": dict}, w, optional=("registry",))
        if not is_name(m["model"]):
            raise _err(w + ".model", "not a valid name")
        check_abs_path(m["path"], w + ".path")
        if not (under(m["path"], paths["models"]) or under(m["path"], paths["engram"])):
            raise _err(w + ".path", "%r is outside paths.models and paths.engram" % m["path"])
        if m["path"] in targets:
            raise _err(w + ".path", "listed twice")
        targets.add(m["path"])
        if m["size"] < 0 or not HEX64.match(m["sha256"]):
            raise _err(w, "bad size or sha256")
        b = m["bundled"]
        if b is not None:
            if not b.startswith("models/") or b not in names:
                raise _err(w + ".bundled", "names no models/ file of the bundle")
            fe = [f for f in files if f["path"] == b][0]
            if fe["size"] != m["size"] or fe["sha256"] != m["sha256"]:
                raise _err(w + ".bundled", "size or sha256 differ from the bundled file")
        if "registry" in m:
            _check_registry_source(m, w, names, b)


def _check_registry_source(m: dict[str, Any], w: str, names: set[str], bundled: Any) -> None:
    """A model file's ``registry``: where the host pulls it (the registry's URL, the repository, the
    blob's digest, which is its sha256) and the bundle's CA file for the registry's TLS, if any."""
    src = m["registry"]
    w += ".registry"
    _want(src, {"url": str, "repository": str, "digest": str, "ca": "str?"}, w)
    if bundled is not None:
        raise _err(w, "a file the bundle carries is not pulled from a registry")
    if not REGISTRY_URL.match(src["url"]):
        raise _err(w + ".url", "not a registry URL (scheme://host:port)")
    if not REPOSITORY.match(src["repository"]):
        raise _err(w + ".repository", "not a repository name")
    if src["digest"] != "sha256:" + m["sha256"]:
        raise _err(w + ".digest", "is not the file's sha256")
    if src["ca"] is not None and (src["ca"] != REGISTRY_CA or REGISTRY_CA not in names):
        raise _err(w + ".ca", "names no %s of the bundle" % REGISTRY_CA)


def physical_files(manifest: dict[str, Any]) -> dict[str, tuple[int, str]]:
    """Every file the bundle folder holds (parts instead of parted files): path -> (size, sha256)."""
    out: dict[str, tuple[int, str]] = {}
    for f in manifest["files"]:
        if f.get("parts"):
            for p in f["parts"]:
                out[p["path"]] = (p["size"], p["sha256"])
        else:
            out[f["path"]] = (f["size"], f["sha256"])
    return out


def release_files(manifest: dict[str, Any]) -> list[dict[str, Any]]:
    """The files a release keeps: all but the image archive and bundled models."""
    skip = {manifest["image"]["archive"]} | {m["bundled"] for m in manifest["models"] if m["bundled"]}
    return [f for f in manifest["files"] if f["path"] not in skip]


def trusted_comment_for(manifest: dict[str, Any]) -> str:
    return "builder-bundle id=%s host=%s fleet=%s lane=%s rank=%d" % (
        manifest["bundle_id"],
        manifest["host"],
        manifest["fleet"],
        manifest["lane"],
        manifest["rank"],
    )
