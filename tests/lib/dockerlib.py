"""Containers from the local Docker Engine, for the tests: run an image to completion, or start one
detached with published ports, read its logs and remove it. builder itself runs containers only on
hosts, through start.sh; these go through builder.foundation.dockerio's client and error wrapping. Also the tags
a test makes, put back as they were, and the platform of this machine's engine."""

from __future__ import annotations

import contextlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from docker.errors import NotFound

from builder.errors import BuilderError
from builder.foundation import dockerio
from builder.foundation.dockerio import _call, client
from tests.lib.fleetlib import docker_available


@dataclass(frozen=True)
class RunResult:
    exit_code: int
    stdout: str
    stderr: str


def run(
    image: str,
    args: Sequence[str] = (),
    *,
    env: Mapping[str, str] | None = None,
    network: str = "none",
    entrypoint: Sequence[str] | None = None,
    timeout: float = 120,
) -> RunResult:
    """``docker run --rm IMAGE ARGS`` to completion, with the network off by default."""

    def do() -> RunResult:
        api = client().api
        cid = api.create_container(
            image,
            command=list(args),
            environment=dict(env or {}),
            entrypoint=list(entrypoint) if entrypoint is not None else None,
            host_config=api.create_host_config(network_mode=network),
            network_disabled=network == "none",
        )["Id"]
        try:
            api.start(cid)
            status = api.wait(cid, timeout=timeout)
            out = api.logs(cid, stdout=True, stderr=False).decode("utf-8", "replace")
            err = api.logs(cid, stdout=False, stderr=True).decode("utf-8", "replace")
            return RunResult(int(status.get("StatusCode", -1)), out, err)
        finally:
            api.remove_container(cid, force=True, v=True)

    result: RunResult = _call(f"docker run {image}", do)
    return result


def start(
    image: str,
    args: Sequence[str] = (),
    *,
    env: Mapping[str, str] | None = None,
    publish: Mapping[int, int | None] | None = None,
    bind_address: str = "127.0.0.1",
    name: str | None = None,
    labels: Mapping[str, str] | None = None,
) -> str:
    """Start a detached container; ``publish`` maps container TCP ports to host ports on
    ``bind_address`` only (None picks a free port). Returns the container ID."""

    def do() -> str:
        api = client().api
        ports = dict(publish or {})
        host_config = api.create_host_config(
            port_bindings={f"{p}/tcp": (bind_address, hp) for p, hp in ports.items()},
        )
        cid = str(
            api.create_container(
                image,
                command=list(args),
                environment=dict(env or {}),
                ports=[int(p) for p in ports],
                host_config=host_config,
                name=name,
                labels=dict(labels or {}),
            )["Id"]
        )
        try:
            api.start(cid)
        except BaseException:
            api.remove_container(cid, force=True, v=True)
            raise
        return cid

    result: str = _call(f"docker run -d {image}", do)
    return result


def published_port(container: str, port: int) -> int:
    """The host port a started container's TCP ``port`` was published on."""

    def do() -> int:
        binding = client().api.port(container, port)
        if not binding:
            raise BuilderError(f"container {container[:12]}: port {port} is not published")
        return int(binding[0]["HostPort"])

    result: int = _call(f"docker port {container[:12]}", do)
    return result


def logs(container: str) -> str:
    out: bytes = _call(f"docker logs {container[:12]}", lambda: client().api.logs(container))
    return out.decode("utf-8", "replace")


def stop(container: str) -> None:
    """Stop and remove a container started by ``start``; no error if it is already gone."""

    def do() -> None:
        with contextlib.suppress(NotFound):
            client().api.remove_container(container, force=True, v=True)

    _call(f"docker rm -f {container[:12]}", do)


def engine_platform() -> str:
    """The local engine's platform (linux/amd64 where there is no engine)."""
    return dockerio.engine_platform() if docker_available() else "linux/amd64"


class Tags:
    """Tags a test makes: removed at the end; a tag that existed before is pointed back where it was."""

    def __init__(self) -> None:
        self.before: dict[str, str | None] = {}

    def watch(self, tag: str) -> str:
        if tag not in self.before:
            self.before[tag] = dockerio.image_id(tag)
        return tag

    def restore(self) -> None:
        for tag, old in self.before.items():
            now = dockerio.image_id(tag)
            if old is None:
                if now is not None:
                    dockerio.remove(tag, force=True)
            elif now != old:
                repo, _, t = tag.rpartition(":")
                dockerio.tag(old, repo, t)
