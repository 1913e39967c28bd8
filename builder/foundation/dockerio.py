"""The one adapter around the Docker SDK: nothing else in builder imports ``docker``.

Everything here talks to the engine named by the environment (DOCKER_HOST, or the local socket),
so building against a remote engine (``DOCKER_HOST=ssh://spark-head``) needs no code change.
Every expected failure becomes a one-line BuilderError; SDK exceptions never escape.

Streams stay streams: ``save`` yields the docker-archive in chunks, ``load`` sends a file or an
iterator of chunks without reading it into memory. A build goes through this adapter too: its log stream
and the cleanup of an abandoned one are builder.foundation.dockerbuild's.
"""

from __future__ import annotations

import base64
import json
import os
import re
import sys
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any
from urllib.parse import urlsplit

from builder.errors import BuilderError

if TYPE_CHECKING:
    from docker import DockerClient

#: Seconds the SDK waits for the next bytes of a response. A compile step inside a build can be
#: silent for minutes, so this is long; it is not a limit on the whole build.
READ_TIMEOUT = 3600
#: Bytes per chunk when streaming an image out of the engine.
SAVE_CHUNK = 1024 * 1024

_clients: dict[str, DockerClient] = {}
_clients_lock = threading.Lock()
_LOADED_ID = re.compile(r"Loaded image ID: (sha256:[0-9a-f]{64})")
_LOADED_REF = re.compile(r"Loaded image: (\S+)")
_ARCH = {"x86_64": "amd64", "aarch64": "arm64", "amd64": "amd64", "arm64": "arm64"}


def _one_line(exc: BaseException) -> str:
    text = getattr(exc, "explanation", None) or str(exc) or type(exc).__name__
    if isinstance(text, bytes):
        text = text.decode("utf-8", "replace")
    return " ".join(str(text).split())


def _import_docker() -> Any:
    """``import docker``, without paramiko unless the engine is reached over ssh.

    The SDK imports paramiko (and through it invoke and cryptography's EC code: about 0.2 s, a
    fifth of an up-to-date `builder image`) whenever paramiko is installed, only to offer its
    ssh:// transport. For any other DOCKER_HOST, paramiko is hidden while the SDK loads (the SDK
    then leaves that transport out, as when paramiko is not installed) and visible again after.
    """
    if "docker" in sys.modules or "paramiko" in sys.modules or os.environ.get("DOCKER_HOST", "").startswith("ssh://"):
        import docker

        return docker
    sys.modules["paramiko"] = None  # type: ignore[assignment]  # `import paramiko` -> ImportError
    try:
        import docker
    finally:
        del sys.modules["paramiko"]
    return docker


# The SDK loads with this module, once, through _import_docker: every module that imports this
# one does so where it is about to talk to the engine.
docker = _import_docker()
from docker.credentials.errors import StoreError  # noqa: E402
from docker.errors import DockerException, ImageNotFound, NotFound  # noqa: E402
from requests.exceptions import RequestException  # noqa: E402


def _causes(exc: BaseException) -> Iterator[BaseException]:
    """The exception, what it was raised from, and the exceptions among its arguments (requests and
    urllib3 carry the socket's error in their args), depth first, each once."""
    seen: set[int] = set()
    todo = [exc]
    while todo:
        e = todo.pop()
        if id(e) in seen:
            continue
        seen.add(id(e))
        yield e
        todo += [a for a in e.args if isinstance(a, BaseException)]
        todo += [c for c in (e.__context__, e.__cause__) if c is not None]


def _socket_path(docker_host: str) -> str:
    """The unix socket a DOCKER_HOST names (the SDK's default when unset); "" for other transports."""
    if not docker_host:
        return docker.constants.DEFAULT_UNIX_SOCKET.removeprefix("http+unix://")
    if docker_host.startswith("unix://"):
        return docker_host.removeprefix("unix://")
    return ""


def _ssh_hint(docker_host: str) -> str:
    u = urlsplit(docker_host)
    target = f"{u.username}@{u.hostname}" if u.username else str(u.hostname)
    return f"ssh {'-p ' + str(u.port) + ' ' if u.port else ''}{target} docker version"


def engine_problem(docker_host: str, exc: BaseException) -> str:
    """One plain line for an engine that does not answer: where builder looked (DOCKER_HOST, or the
    local socket when it is unset), what went wrong, and what to do; never the SDK's nested tuples."""
    sock = _socket_path(docker_host)
    where = f"{docker_host} (DOCKER_HOST)" if docker_host else f"{sock} (the local socket; DOCKER_HOST is not set)"
    causes = list(_causes(exc))
    text = " ".join(str(e) for e in causes)
    if docker_host.startswith("ssh://"):
        if "paramiko" in text:
            why = "the Docker SDK's ssh:// transport needs paramiko (a dependency of builder: reinstall builder)"
        else:
            why = f"ssh reached no Docker engine there (see ssh's message; check that `{_ssh_hint(docker_host)}` works)"
    elif any(isinstance(e, FileNotFoundError) for e in causes) and sock:
        why = "no such socket: start the Docker engine, or set DOCKER_HOST to one that runs"
    elif any(isinstance(e, PermissionError) for e in causes) and sock:
        why = "permission denied: join the docker group, or set DOCKER_HOST to an engine you may use"
    elif any(isinstance(e, ConnectionRefusedError) for e in causes) or "Connection refused" in text:
        why = "connection refused: the engine is not running there, or listens elsewhere"
    elif any(isinstance(e, TimeoutError) for e in causes) or "timed out" in text.lower():
        why = "no answer in time"
    elif "Name or service not known" in text or "nodename nor servname" in text:
        why = "unknown host name"
    else:
        why = _one_line(exc)
    return f"no Docker engine: {where}: {why}"


def client() -> DockerClient:
    """A connected client for the engine the environment names; BuilderError if none answers."""
    key = os.environ.get("DOCKER_HOST", "")
    with _clients_lock:
        cached = _clients.get(key)
        if cached is not None:
            return cached
        try:
            # ssh:// through the system ssh, so the user's ssh_config and known_hosts apply
            c = docker.from_env(timeout=READ_TIMEOUT, use_ssh_client=True)
            c.ping()
        except (DockerException, RequestException, OSError) as exc:
            raise BuilderError(engine_problem(key, exc)) from None
        _clients[key] = c
        return c


def engine_platform() -> str:
    """The engine's native platform, e.g. ``linux/amd64`` or ``linux/arm64``."""
    v = _call("docker version", lambda: client().version())
    os_name = str(v.get("Os", "linux")).lower()
    arch = str(v.get("Arch", ""))
    return f"{os_name}/{_ARCH.get(arch, arch)}"


_HELPER_MISSING = re.compile(r"(docker-credential-\S+) not installed or not available in PATH")


def credential_helper_problem(exc: BaseException) -> str | None:
    """One line for a credential helper of the docker client's config that is not on PATH: the config
    file, the key naming the helper, and the fix. None for any other trouble. (The SDK runs the
    helpers a config names when it sends credentials: for a build, every one of them.)"""
    m = next((m for e in _causes(exc) if (m := _HELPER_MISSING.search(str(e)))), None)
    if m is None:
        return None
    exe = m.group(1)
    helper = exe.removeprefix("docker-credential-")
    path = docker.utils.config.find_config_file() or "the docker config"
    try:
        with open(path, encoding="utf-8") as f:
            doc = json.load(f)
    except (OSError, ValueError):
        doc = {}
    keys = [f"credHelpers.{host}" for host, name in (doc.get("credHelpers") or {}).items() if name == helper]
    key = "credsStore" if doc.get("credsStore") == helper else keys[0] if keys else "credsStore"
    return (f"{path}: {key} names the credential helper {helper}, but {exe} is not on PATH "
            f"(install {exe}, or remove {key} from {path})")


def _call(what: str, fn: Callable[[], Any]) -> Any:
    try:
        return fn()
    except BuilderError:
        raise
    except (DockerException, RequestException, OSError, StoreError) as exc:
        raise BuilderError(credential_helper_problem(exc) or f"{what}: {_one_line(exc)}") from None


def image_inspect(ref: str) -> dict[str, Any] | None:
    """The engine's inspect record for ``ref``, or None when there is no such image."""

    def inspect() -> dict[str, Any] | None:
        try:
            return dict(client().api.inspect_image(ref))
        except (ImageNotFound, NotFound):
            return None

    result: dict[str, Any] | None = _call(f"docker image inspect {ref}", inspect)
    return result


def image_exists(ref: str) -> bool:
    return image_inspect(ref) is not None


def image_id(ref: str) -> str | None:
    rec = image_inspect(ref)
    return None if rec is None else str(rec["Id"])


def save(ref: str, *, chunk_size: int = SAVE_CHUNK) -> Iterator[bytes]:
    """Stream ``docker save ref`` (a docker-archive tar) in chunks."""
    if image_inspect(ref) is None:
        raise BuilderError(f"docker save {ref}: no such image")
    try:
        stream = client().api.get_image(ref, chunk_size=chunk_size)
        yield from stream
    except (DockerException, RequestException, OSError) as exc:
        raise BuilderError(f"docker save {ref}: {_one_line(exc)}") from None


def load(source: str | os.PathLike[str] | IO[bytes] | Iterable[bytes]) -> str:
    """``docker load`` a docker-archive from a path, an open binary file or an iterator of chunks.

    The body is streamed to the engine (a file is read in blocks, an iterator is sent chunked),
    never read whole into memory. Returns the loaded image ID (``sha256:...``).
    """
    what = f"docker load {source}" if isinstance(source, (str, os.PathLike)) else "docker load"

    def run(data: Any) -> str:
        loaded_id: str | None = None
        loaded_ref: str | None = None
        for item in client().api.load_image(data):
            if "error" in item or "errorDetail" in item:
                detail = item.get("errorDetail") or {}
                raise BuilderError(
                    f"{what}: {' '.join(str(detail.get('message') or item.get('error')).split())}"
                )
            text = str(item.get("stream", ""))
            m = _LOADED_ID.search(text)
            if m:
                loaded_id = m.group(1)
                continue
            m2 = _LOADED_REF.search(text)
            if m2:
                loaded_ref = m2.group(1)
        if loaded_id is None and loaded_ref is not None:
            loaded_id = image_id(loaded_ref)
        if loaded_id is None:
            raise BuilderError(f"{what}: the engine reported no image")
        return loaded_id

    if isinstance(source, (str, os.PathLike)):
        path = Path(source)
        if not path.is_file():
            raise BuilderError(f"{path}: no such archive")
        with open(path, "rb") as f:
            return str(_call(what, lambda: run(f)))
    return str(_call(what, lambda: run(source)))


def pull(ref: str) -> None:
    """``docker pull ref`` (``repo@sha256:...``: the engine checks every byte against the digest).

    The engine reports a failed pull in the stream it answers with (HTTP 200 already sent), so the
    stream is read to its end and its first error raised."""
    repo, sep, reference = ref.partition("@")
    if not sep:
        repo, _, reference = ref.rpartition(":")

    def do() -> None:
        for event in client().api.pull(repo, tag=reference, stream=True, decode=True):
            if isinstance(event, dict) and event.get("error"):
                raise BuilderError(f"docker pull {ref}: {' '.join(str(event['error']).split())}")

    _call(f"docker pull {ref}", do)


def tag(image: str, repo: str, tag_name: str) -> None:
    """Point ``repo:tag_name`` at ``image``."""

    def do() -> None:
        if not client().api.tag(image, repo, tag_name, force=True):
            raise BuilderError(f"docker tag {image} {repo}:{tag_name}: refused")

    _call(f"docker tag {image} {repo}:{tag_name}", do)


def remove(ref: str, *, force: bool = False) -> bool:
    """Remove an image (or untag a reference). False when it did not exist."""

    def do() -> bool:
        try:
            client().api.remove_image(ref, force=force, noprune=False)
            return True
        except (ImageNotFound, NotFound):
            return False

    return bool(_call(f"docker rmi {ref}", do))


def path_kinds(image: str, paths: Sequence[str]) -> dict[str, str]:
    """What each path is in the image's filesystem: ``file``, ``dir``, ``link`` or ``missing``, from the
    engine's stat of a created (never started) container (``HEAD /containers/ID/archive``): nothing in
    the image runs, nothing is copied out."""

    def do() -> dict[str, str]:
        api = client().api
        cid = api.create_container(image, entrypoint=["/builder-path-probe"], command=[],
                                   network_disabled=True)["Id"]
        try:
            out: dict[str, str] = {}
            for p in paths:
                # (the SDK has no stat-only call; its client is a requests session on the engine's API)
                res = api.head(api._url("/containers/{0}/archive", cid), params={"path": p})
                if res.status_code == 404:
                    out[p] = "missing"
                    continue
                res.raise_for_status()
                head = res.headers.get("X-Docker-Container-Path-Stat")
                if not head:
                    raise BuilderError(f"docker: no X-Docker-Container-Path-Stat for {p} in {image}")
                stat = json.loads(base64.b64decode(head))
                mode = int(stat.get("mode", 0))
                out[p] = "dir" if mode & (1 << 31) else "link" if mode & (1 << 27) else "file"
            return out
        finally:
            api.remove_container(cid, force=True, v=True)  # (v: an image's VOLUME made one for it)

    return dict(_call(f"docker container create {image} (to stat paths)", do))
