"""Runtime: the docker CLI and engine, the NVIDIA runtime, and (before start) the API port free."""

from __future__ import annotations

import json
from typing import Any

import pytest
from checklib import exists, need


@pytest.fixture(scope="module")
def docker_facts(host: Any, expect: dict[str, Any]) -> dict[str, Any]:
    """Engine answer (rc, last stderr line) and runtimes; one remote command, read by both checks."""
    want = expect["expect"]
    if not want["docker"]:
        return {}
    if not exists(host, "docker"):
        return {"cli": False}
    if not want["nvidia_runtime"]:
        r = host.run("docker version --format '{{.Server.Version}}'")
        return {"cli": True, "version_rc": r.rc, "version_err": _last(r.stderr)}
    r = host.run(
        "err=$(docker version --format '{{.Server.Version}}' 2>&1 >/dev/null); echo $?; "
        "printf '%s\\n' \"$err\" | tail -n 1; echo @@; "
        "docker info --format '{{json .Runtimes}}' 2>/dev/null && echo @@0 || echo @@1"
    )
    head, _, tail = r.stdout.partition("\n@@\n")
    lines = head.splitlines()
    info, _, info_rc = tail.rstrip("\n").rpartition("@@")
    return {
        "cli": True,
        "version_rc": int(lines[0]) if lines and lines[0].strip().isdigit() else r.rc or 1,
        "version_err": _last("\n".join(lines[1:])),
        "info_rc": int(info_rc) if info_rc.isdigit() else 1,
        "info": info.strip(),
    }


def _last(text: str) -> str:
    return (text.strip().splitlines() or [""])[-1][:120]


def test_docker(docker_facts: dict[str, Any], expect: dict[str, Any]) -> None:
    if not expect["expect"]["docker"]:
        pytest.skip("docker not expected on this host")
    assert docker_facts["cli"], "docker CLI: expected on PATH, found none"
    rc = docker_facts["version_rc"]
    assert rc == 0, f"docker engine: expected to answer, found exit {rc}: {docker_facts['version_err']}"


def test_nvidia_runtime(docker_facts: dict[str, Any], expect: dict[str, Any]) -> None:
    if not expect["expect"]["docker"] or not expect["expect"]["nvidia_runtime"]:
        pytest.skip("the NVIDIA container runtime is not expected on this host")
    if not docker_facts["cli"]:
        pytest.fail("NVIDIA runtime: expected docker with an nvidia runtime, found no docker CLI")
    ok = docker_facts["info_rc"] == 0
    runtimes = sorted(json.loads(docker_facts["info"] or "{}")) if ok else []
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
