"""Runtime: the docker CLI and engine, the NVIDIA runtime, and (before start) the API port free."""

from __future__ import annotations

import json
from typing import Any

import pytest
from checklib import need


def test_docker(host: Any, expect: dict[str, Any]) -> None:
    if not expect["expect"]["docker"]:
        pytest.skip("docker not expected on this host")
    assert host.exists("docker"), "docker CLI: expected on PATH, found none"
    r = host.run("docker version --format '{{.Server.Version}}'")
    assert r.rc == 0, (
        f"docker engine: expected to answer, found exit {r.rc}: "
        f"{(r.stderr.strip().splitlines() or [''])[-1][:120]}"
    )


def test_nvidia_runtime(host: Any, expect: dict[str, Any]) -> None:
    if not expect["expect"]["docker"] or not expect["expect"]["nvidia_runtime"]:
        pytest.skip("the NVIDIA container runtime is not expected on this host")
    if not host.exists("docker"):
        pytest.fail("NVIDIA runtime: expected docker with an nvidia runtime, found no docker CLI")
    r = host.run("docker info --format '{{json .Runtimes}}'")
    runtimes = sorted(json.loads(r.stdout or "{}")) if r.rc == 0 else []
    assert "nvidia" in runtimes, f"docker runtimes: expected nvidia, found {', '.join(runtimes) or 'none'}"


def test_api_port_free(host: Any, expect: dict[str, Any]) -> None:
    serve = need(expect.get("serve"), expect.get("serve_reason") or "lane settings unknown")
    if expect.get("phase") != "preflight":
        pytest.skip("the API port is in use once the lane runs (checked in --phase preflight)")
    if expect["host"]["role"] != "head":
        pytest.skip("the API is served by the head")
    port = int(serve["port"])
    r = host.run("ss -Hltn 2>/dev/null || cat /proc/net/tcp /proc/net/tcp6")
    listening = _listening_ports(r.stdout)
    assert port not in listening, f"API port {port}: expected free before start, found a listener"


def _listening_ports(text: str) -> set[int]:
    ports: set[int] = set()
    for line in text.splitlines():
        parts = line.split()
        if len(parts) >= 4 and parts[0] == "LISTEN":  # ss -Hltn: State Recv-Q Send-Q Local:Port Peer
            ports.add(int(parts[3].rsplit(":", 1)[1]))
        elif (
            len(parts) >= 4 and ":" in parts[1] and parts[3] == "0A"
        ):  # /proc/net/tcp: local_address st=LISTEN
            ports.add(int(parts[1].rsplit(":", 1)[1], 16))
    return ports
