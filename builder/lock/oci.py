"""Base images: resolve a tag to the index digest and each platform's manifest digest.

Online the registry is asked through builder.foundation.distribution (the OCI distribution API: the
manifest with the Accept headers for OCI index, Docker manifest list, OCI manifest and Docker v2
manifest, its sha256 checked against Docker-Content-Digest, the registry's credentials and tokens).

Offline, a local image in the Docker engine is used (``source = "local"``). For such an
entry ``platforms`` holds the local ImageID (the config digest, the image's identity in the
classic store), since the engine does not keep manifest digests; ``index_digest`` is the
RepoDigest of the same repository when the engine has one.
"""

from __future__ import annotations

import http.client
import json
import re
import subprocess
import urllib.error
from typing import Any

from builder.errors import ConfigError, ResolveError
from builder.foundation.distribution import INDEX_TYPES, MANIFEST_TYPES, RegistryClient, network_reason, parse_ref
from builder.inputs.pins import BaseImage
from builder.lock.lockfile import LockedBase


def split_platform(p: str) -> tuple[str, str, str | None]:
    parts = p.split("/")
    return parts[0], parts[1], (parts[2] if len(parts) > 2 else None)


def platform_matches(want: str, os_: str, arch: str, variant: str | None) -> bool:
    wos, warch, wvar = split_platform(want)
    if (wos, warch) != (os_, arch):
        return False
    if wvar is None:
        return True
    if arch == "arm64" and wvar == "v8" and not variant:
        return True
    return wvar == variant


def _env_of(config: dict[str, Any]) -> list[str]:
    env = (config.get("config") or {}).get("Env") or []
    return [str(x) for x in env]


# ---------------------------------------------------------------------------------------
# resolution


def resolve_registry(name: str, spec: BaseImage, spec_hash: str) -> LockedBase:
    where = f"bases.{name}"
    ref = parse_ref(spec.ref)
    reg = RegistryClient(ref)
    try:
        doc, media, digest = reg.manifest(ref.reference)
        index_digest: str | None = None
        if media in INDEX_TYPES or "manifests" in doc:
            index_digest = digest
            platforms, env = _from_index(where, spec, reg, doc)
        elif media in MANIFEST_TYPES or "config" in doc:
            platforms, env = _from_manifest(where, spec, reg, doc, digest)
        else:
            raise ResolveError(f"{where}: {spec.ref}: unsupported manifest type {media or 'unknown'}")
    except urllib.error.HTTPError as e:
        what = "not found" if e.code == 404 else f"HTTP {e.code}"
        raise ResolveError(f"{where}: {spec.ref}: {what} at {ref.registry}") from None
    except (urllib.error.URLError, OSError, http.client.HTTPException) as e:
        raise ResolveError(f"{where}: cannot reach {ref.registry} for {spec.ref}: {network_reason(e)}") from None
    _check_pins(where, spec, index_digest, platforms)

    return LockedBase(spec_hash=spec_hash, ref=spec.ref, index_digest=index_digest, platforms=platforms,
                      source="registry", config_env=env)


def _from_index(where: str, spec: BaseImage, reg: RegistryClient,
                doc: dict[str, Any]) -> tuple[dict[str, str], dict[str, list[str]]]:
    """Each pinned platform's manifest digest and environment, through the index's entry for it."""
    platforms: dict[str, str] = {}
    env: dict[str, list[str]] = {}
    entries = doc.get("manifests") or []
    for want in spec.platforms:
        match = None
        for m in entries:
            p = m.get("platform") or {}
            if platform_matches(want, p.get("os", ""), p.get("architecture", ""), p.get("variant")):
                match = m
                break
        if match is None:
            raise ResolveError(f"{where}: platform {want} is not in the index of {spec.ref}")
        pdigest = str(match.get("digest"))
        man, _, got = reg.manifest(pdigest)
        platforms[want] = got
        env[want] = _env_of(reg.blob_json(str((man.get("config") or {}).get("digest"))))
    return platforms, env


def _from_manifest(where: str, spec: BaseImage, reg: RegistryClient, doc: dict[str, Any],
                   digest: str) -> tuple[dict[str, str], dict[str, list[str]]]:
    """A single-platform image: its one manifest digest and environment for each pinned platform, which
    must be its own."""
    platforms: dict[str, str] = {}
    env: dict[str, list[str]] = {}
    config = reg.blob_json(str((doc.get("config") or {}).get("digest")))
    os_, arch, var = config.get("os", ""), config.get("architecture", ""), config.get("variant")
    for want in spec.platforms:
        if not platform_matches(want, os_, arch, var):
            have = "/".join(x for x in (os_, arch, var) if x)
            raise ResolveError(f"{where}: platform {want} is not in {spec.ref} (single-platform "
                               f"image for {have})")
        platforms[want] = digest
        env[want] = _env_of(config)
    return platforms, env


def _check_pins(where: str, spec: BaseImage, index_digest: str | None, platforms: dict[str, str]) -> None:
    if spec.digest is not None:
        top = index_digest or (next(iter(platforms.values())) if len(set(platforms.values())) == 1 else None)
        if top != spec.digest:
            raise ResolveError(f"{where}: {spec.ref} resolves to {top}, but the pin says {spec.digest}")
    for plat, want in sorted(spec.platform_digests.items()):
        got = platforms.get(plat)
        if got != want:
            raise ResolveError(f"{where}: platform {plat}: {spec.ref} resolves to {got}, "
                               f"but the pin says {want}")


def _local_inspect(ref: str) -> dict[str, Any] | None:
    """`docker image inspect` of a local image (None when the engine does not have it).

    Through the docker CLI rather than builder.foundation.dockerio: an offline lock should not need the SDK or a
    running engine, and a missing CLI or engine reads as "not in the engine" (the input is named).
    """
    try:
        p = subprocess.run(["docker", "image", "inspect", ref], capture_output=True, timeout=60, check=False)
    except (FileNotFoundError, subprocess.TimeoutExpired):
        return None
    if p.returncode != 0:
        return None
    try:
        data = json.loads(p.stdout)
    except ValueError:
        return None
    return data[0] if isinstance(data, list) and data and isinstance(data[0], dict) else None


def local_image(where: str, ref: str, platforms: list[str], why_missing: str) -> dict[str, Any]:
    """The engine's inspect of a local image, checked offline: it is there, has a sha256 id, and is
    every one of the platforms the pin asks for (ResolveError naming ``where`` otherwise)."""
    info = _local_inspect(ref)
    if info is None:
        raise ResolveError(f"{where}: not reachable offline ({ref}{why_missing})")
    if not re.fullmatch(r"sha256:[0-9a-f]{64}", str(info.get("Id", ""))):
        raise ResolveError(f"{where}: the local image {ref} has no sha256 id")
    os_, arch, var = str(info.get("Os", "")), str(info.get("Architecture", "")), info.get("Variant")
    for want in platforms:
        if not platform_matches(want, os_, arch, var):
            have = "/".join(x for x in (os_, arch, var) if x)
            raise ResolveError(f"{where}: the local image {ref} is {have}, not {want} (offline)")
    return info


def resolve_local(name: str, spec: BaseImage, spec_hash: str) -> LockedBase:
    where = f"bases.{name}"
    info = local_image(where, spec.ref, spec.platforms, "")
    image_id = str(info["Id"])
    env_list = [str(x) for x in ((info.get("Config") or {}).get("Env") or [])]
    platforms: dict[str, str] = {}
    env: dict[str, list[str]] = {}
    for want in spec.platforms:
        platforms[want] = image_id
        env[want] = env_list
    repo = parse_ref(spec.ref)
    index_digest = None
    for rd in info.get("RepoDigests") or []:
        r, _, d = str(rd).partition("@")
        try:
            pr = parse_ref(r)
        except ConfigError:
            continue
        if (pr.registry, pr.repository) == (repo.registry, repo.repository) and d.startswith("sha256:"):
            index_digest = d
            break
    if spec.digest is not None and index_digest != spec.digest:
        raise ResolveError(f"{where}: the local image {spec.ref} does not carry the pinned digest "
                           f"{spec.digest}")

    return LockedBase(spec_hash=spec_hash, ref=spec.ref, index_digest=index_digest, platforms=platforms,
                      source="local", config_env=env)


def resolve(name: str, spec: BaseImage, *, offline: bool, spec_hash: str) -> LockedBase:
    """Resolve one base image: the registry online, the local Docker engine offline."""
    if spec.ref == "scratch" or spec.ref.startswith("scratch:"):
        raise ConfigError(f"bases.{name}.ref: 'scratch' is not a base; leave the image's base unset")
    try:
        parse_ref(spec.ref)  # bad references are config errors, online or not
    except ConfigError as e:
        raise ConfigError(f"bases.{name}.ref: {e}") from None
    if offline:
        return resolve_local(name, spec, spec_hash)
    return resolve_registry(name, spec, spec_hash)


# ---------------------------------------------------------------------------------------
__all__ = ["resolve", "resolve_registry", "resolve_local", "platform_matches"]
