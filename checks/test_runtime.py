"""Runtime: the docker CLI and engine, the NVIDIA runtime, and the API port free or held by the lane's
own running release."""

from __future__ import annotations

import json
from typing import Any

import pytest
from checklib import LISTENERS, Cmd, Concern, docker_info, exists, lane_docker, lane_owns_running_release, or_skip, run


def planned(expect: dict[str, Any]) -> list[Cmd]:
    """This rank's containers and `docker info` (where docker is expected), the head's listeners."""
    cmds = lane_docker(expect)
    if expect["expect"].get("docker"):
        cmds.append(docker_info())
    if expect["host"]["role"] == "head":
        cmds.append(LISTENERS)
    return cmds


CONCERN = Concern(name="runtime", order=90, phase="preflight", containers=True, prefetch=planned)


@pytest.fixture(scope="module")
def docker_facts(host: Any, expect: dict[str, Any]) -> dict[str, Any]:
    """Whether the engine answers (and why not) and its runtimes: one `docker info` answer (checklib.docker_info),
    read by both checks."""
    want = expect["expect"]
    if not want["docker"]:
        return {}
    if not exists(host, "docker"):
        return {"cli": False}
    r = run(host, *docker_info())
    try:
        info = json.loads(r.stdout)
    except ValueError:
        info = None
    if not isinstance(info, dict):
        return {"cli": True, "answer": f"exit {r.rc}: {_last(r.stderr or r.stdout)}", "runtimes": {}}
    # a CLI whose engine is down still prints its own half, with the reason in ServerErrors
    errors = [str(e) for e in info.get("ServerErrors") or []]
    if errors or not info.get("ServerVersion"):
        why = _last(errors[-1] if errors else r.stderr) or "no server version"
        return {"cli": True, "answer": f"exit {r.rc or 1}: {why}", "runtimes": {}}
    return {"cli": True, "answer": "", "runtimes": info.get("Runtimes") or {}}


def _last(text: str) -> str:
    return (text.strip().splitlines() or [""])[-1][:120]


def test_docker(docker_facts: dict[str, Any], expect: dict[str, Any]) -> None:
    if not expect["expect"]["docker"]:
        pytest.skip("docker not expected on this host")
    assert docker_facts["cli"], "docker CLI: expected on PATH, found none"
    assert not docker_facts["answer"], f"docker engine: expected to answer, found {docker_facts['answer']}"


def test_nvidia_runtime(docker_facts: dict[str, Any], expect: dict[str, Any]) -> None:
    if not expect["expect"]["docker"] or not expect["expect"]["nvidia_runtime"]:
        pytest.skip("the NVIDIA container runtime is not expected on this host")
    if not docker_facts["cli"]:
        pytest.fail("NVIDIA runtime: expected docker with an nvidia runtime, found no docker CLI")
    runtimes = sorted(docker_facts["runtimes"])
    assert "nvidia" in runtimes, f"docker runtimes: expected nvidia, found {', '.join(runtimes) or 'none'}"


def test_api_port_free(host: Any, expect: dict[str, Any]) -> None:
    """Before start the port must be free; once the lane serves, the listener must be the lane's own
    release (this rank's container, started from the installed bundle). Which process listens is
    not asked: `ss -p` sees other users' sockets only as root."""
    serve = or_skip(expect.get("serve"), expect.get("serve_reason") or "lane settings unknown")
    if expect["host"]["role"] != "head":
        pytest.skip("the API is served by the head")
    port = int(serve["port"])
    r = run(host, *LISTENERS)
    if port not in _listening_ports(r.stdout):
        return
    ours, what = lane_owns_running_release(host, expect) if expect["expect"]["docker"] else (False, "no docker")
    assert ours, f"API port {port}: expected free or held by the lane's own release, found a listener ({what})"


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
