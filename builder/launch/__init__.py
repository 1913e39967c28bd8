"""Launch files for one rank: rank.env, config.json, start.sh, stop.sh.

Pure rendering (no I/O but reading the scripts' bodies): the same fleet, host, lane and image give the same bytes.

- ``rank.env`` (docker ``--env-file``): WORLD_SIZE, RANK, MASTER_ADDR (the head's address),
  MASTER_PORT (the lane's rendezvous port), TF_TP_WORLD/TF_TP_MASTER/TF_TP_PORT, NCCL_IB_HCA and
  TF_RDMA_DEVICES (the host's RDMA devices), NCCL_SOCKET_IFNAME (its interfaces), NCCL_IB_GID_INDEX
  (unless ``auto``), BUILDER_* serve settings, then the lane's ``serve.env``.
- ``config.json``: the lane's serve settings for this rank.
- ``start.sh``: refuses while a container of this lane and rank is running (``docker ps`` by label) and,
  on a worker, while the head already answers (an old head). The head waits, bounded by
  ``BUILDER_START_TIMEOUT`` (default 600 s), until every worker answers on its serve port or its
  rendezvous port. The container runs the image by its ImageID with ``--network host``, the labels
  ``io.builder.lane``/``io.builder.rank``/``io.builder.bundle-id``, the rank env file and the model
  folders mounted read-only. Start the workers first, the head last.
- ``stop.sh``: stops and removes this lane's container for this rank (stop the head first).

Each script is the rank's settings (shell variables and bash arrays, rendered here) above a body that
is the same for every rank: ``start.sh`` and ``stop.sh`` beside this module, real shell files (package
data) so that shellcheck and a reader see them whole.

``serve.args`` may use ``{host} {port} {served_name} {context} {streams} {tensor_parallel} {rank}
{world_size} {master_addr} {rendezvous_port} {lane}``; they are substituted per rank. Empty args run the
image's own command.
"""

from __future__ import annotations

import contextlib
import ipaddress
import re
import shlex
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

from builder.canon import pretty_json
from builder.errors import ConfigError
from builder.hosts import Fleet, Host
from builder.pins import Lane

LABEL_LANE = "io.builder.lane"
LABEL_RANK = "io.builder.rank"
LABEL_BUNDLE = "io.builder.bundle-id"
LABEL_FLEET = "io.builder.fleet"
LABEL_HOST = "io.builder.host"
CONFIG_IN_CONTAINER = "/etc/builder/config.json"
_HERE = Path(__file__).resolve().parent

MODE_EXEC = "0755"
MODE_FILE = "0644"


@dataclass(frozen=True)
class ModelMount:
    """A model folder on the host, mounted read-only at the same path in the container."""

    model: str
    path: str


def host_address(fleet: Fleet, host: Host) -> str:
    """The address other ranks use: ``address``, else the first rail, else the ssh target if it is an IP."""
    if host.address:
        return host.address
    if host.fabric.rails:
        return host.fabric.rails[0]
    target = host.ssh.rsplit("@", 1)[-1]
    m = re.fullmatch(r"\[?([0-9A-Fa-f:.]+?)\]?(?::\d+)?", target)
    if m:
        with contextlib.suppress(ValueError):
            return str(ipaddress.ip_address(m.group(1)))
    raise ConfigError(
        f"fleet {fleet.fleet.name}: host {host.name}: no address for the other ranks "
        "(set address, or fabric.rails)"
    )


def container_name(lane: str, rank: int) -> str:
    return f"builder-{lane}-r{rank}"


def _substitutions(fleet: Fleet, host: Host, lane_name: str, lane: Lane) -> dict[str, str]:
    s = lane.serve
    return {
        "host": s.host,
        "port": str(s.port),
        "served_name": s.served_name,
        "context": str(s.context),
        "streams": str(s.streams),
        "tensor_parallel": str(s.tensor_parallel),
        "rank": str(host.rank),
        "world_size": str(len(fleet.hosts)),
        "master_addr": host_address(fleet, fleet.head()),
        "rendezvous_port": str(s.rendezvous_port),
        "lane": lane_name,
    }


def render_args(fleet: Fleet, host: Host, lane_name: str, lane: Lane) -> list[str]:
    subs = _substitutions(fleet, host, lane_name, lane)
    out = []
    for i, a in enumerate(lane.serve.args):
        try:
            out.append(a.format_map(subs))
        except (KeyError, ValueError, IndexError) as e:
            raise ConfigError(f"lanes.{lane_name}.serve.args[{i}]: bad placeholder in {a!r}: {e}") from None
    return out


def rank_env(fleet: Fleet, host: Host, lane_name: str, lane: Lane) -> dict[str, str]:
    s = lane.serve
    head = host_address(fleet, fleet.head())
    env: dict[str, str] = {
        "WORLD_SIZE": str(len(fleet.hosts)),
        "RANK": str(host.rank),
        "MASTER_ADDR": head,
        "MASTER_PORT": str(s.rendezvous_port),
        "TF_TP_WORLD": str(s.tensor_parallel),
        "TF_TP_MASTER": head,
        "TF_TP_PORT": str(s.rendezvous_port),
        "BUILDER_LANE": lane_name,
        "BUILDER_FLEET": fleet.fleet.name,
        "BUILDER_HOST": host.name,
        "BUILDER_ROLE": host.role,
        "BUILDER_SERVE_HOST": s.host,
        "BUILDER_SERVE_PORT": str(s.port),
        "BUILDER_SERVED_NAME": s.served_name,
        "BUILDER_CONTEXT": str(s.context),
        "BUILDER_STREAMS": str(s.streams),
        "BUILDER_CONFIG": CONFIG_IN_CONTAINER,
    }
    fab = host.fabric
    if fab.rdma_devices:
        env["NCCL_IB_HCA"] = ",".join(fab.rdma_devices)
        env["TF_RDMA_DEVICES"] = ",".join(fab.rdma_devices)
    if fab.interfaces:
        env["NCCL_SOCKET_IFNAME"] = ",".join(fab.interfaces)
    if fab.gid_index != "auto":
        env["NCCL_IB_GID_INDEX"] = str(fab.gid_index)
    for k, v in sorted(s.env.items()):
        if k in env:
            raise ConfigError(f"lanes.{lane_name}.serve.env.{k}: builder sets this per rank; remove it")
        env[k] = v
    for k, v in env.items():
        if any(c in v for c in "\r\n\x00"):
            raise ConfigError(f"lanes.{lane_name}: environment value of {k} has a line break")
    return env


def render_env_file(env: dict[str, str]) -> bytes:
    head = "# generated by `builder bundle`; read by docker --env-file (covered by the bundle's manifest)\n"
    return (head + "".join(f"{k}={v}\n" for k, v in env.items())).encode("utf-8")


def render_config(
    fleet: Fleet, host: Host, lane_name: str, lane: Lane, image: dict[str, Any], models: list[dict[str, Any]]
) -> bytes:
    return pretty_json(
        {
            "format": 1,
            "fleet": fleet.fleet.name,
            "lane": lane_name,
            "host": host.name,
            "rank": host.rank,
            "role": host.role,
            "world_size": len(fleet.hosts),
            "master_addr": host_address(fleet, fleet.head()),
            "serve": lane.serve.model_dump(mode="json"),
            "args": render_args(fleet, host, lane_name, lane),
            "image": image,
            "models": models,
        }
    )


def _q(s: str) -> str:
    return shlex.quote(s)


@cache
def script_body(name: str) -> str:
    """The static part of a launch script (``start.sh`` or ``stop.sh`` beside this module)."""
    return (_HERE / name).read_text()


def render_script(name: str, about: str, settings: dict[str, str], arrays: dict[str, list[str]]) -> bytes:
    """A launch script: the rank's settings (shell-quoted; `arrays` as bash arrays), then its body."""
    lines = [
        "#!/bin/bash",
        f"# generated by `builder bundle` for {about}.",
        "# Do not edit: the bundle's signed manifest covers this file.",
        "set -euo pipefail",
        *(f"{k}={_q(v)}" for k, v in settings.items()),
        *(f"{k}=({' '.join(_q(x) for x in v)})" for k, v in arrays.items()),
    ]
    return ("\n".join(lines) + "\n" + script_body(name)).encode("utf-8")


def _labels() -> dict[str, str]:
    return {"LABEL_LANE": LABEL_LANE, "LABEL_RANK": LABEL_RANK, "LABEL_BUNDLE": LABEL_BUNDLE,
            "LABEL_FLEET": LABEL_FLEET, "LABEL_HOST": LABEL_HOST}


def render_start(
    fleet: Fleet, host: Host, lane_name: str, lane: Lane, image_id: str, mounts: list[ModelMount]
) -> bytes:
    """start.sh: refuses while this rank runs; a worker refuses while the head answers; the head waits
    for every worker; then the container (see the module's docstring)."""
    s = lane.serve
    run_opts: list[str] = []
    if host.expect.gpu_count > 0 and host.expect.nvidia_runtime:
        run_opts += ["--gpus", "all", "--ipc", "host", "--ulimit", "memlock=-1", "--ulimit", "stack=67108864"]
    settings = {
        "LANE": lane_name, "RANK": str(host.rank), "ROLE": host.role, "NAME": container_name(lane_name, host.rank),
        "IMAGE": image_id, "MASTER_ADDR": host_address(fleet, fleet.head()), "SERVE_PORT": str(s.port),
        "RDZV_PORT": str(s.rendezvous_port), "WORLD_SIZE": str(len(fleet.hosts)), "FLEET": fleet.fleet.name,
        "HOST": host.name, "CONFIG": CONFIG_IN_CONTAINER, **_labels(), "RDMA": "1" if host.fabric.rdma_devices else "0",
    }
    arrays = {
        "PEERS": [f"{w.name}={host_address(fleet, w)}" for w in fleet.by_rank() if w.role == "worker"],
        "MODEL_DIRS": [m.path for m in mounts],
        "RUN_OPTS": run_opts,
        "ARGS": render_args(fleet, host, lane_name, lane),
    }
    about = (f"host {host.name}, rank {host.rank} of {len(fleet.hosts)} ({host.role}), lane {lane_name} of fleet "
             f"{fleet.fleet.name}; start the workers first and the head last, stop the head first (stop.sh)")
    return render_script("start.sh", about, settings, arrays)


def render_stop(fleet: Fleet, host: Host, lane_name: str) -> bytes:
    settings = {"LANE": lane_name, "RANK": str(host.rank), **_labels()}
    return render_script("stop.sh", f"host {host.name}, rank {host.rank} of lane {lane_name}", settings, {})


def stop_lane_command(lane_name: str, rank: int, timeout: int = 30) -> str:
    """A shell command that does what stop.sh does, for a host with no release installed: stop and
    remove every container labelled with this lane and rank (only those), whatever bundle started it."""
    filters = f"--filter {_q('label=' + LABEL_LANE + '=' + lane_name)} --filter {_q(f'label={LABEL_RANK}={rank}')}"
    return (
        f"ids=$(docker ps -aq {filters}) && "
        f'if [ -n "$ids" ]; then docker stop -t {int(timeout)} $ids >/dev/null && docker rm $ids >/dev/null; fi'
    )


def render_launch(
    fleet: Fleet,
    host: Host,
    lane_name: str,
    lane: Lane,
    image: dict[str, Any],
    models: list[dict[str, Any]],
    mounts: list[ModelMount],
) -> dict[str, tuple[bytes, str]]:
    """path -> (bytes, mode) of this rank's launch files."""
    env = rank_env(fleet, host, lane_name, lane)
    return {
        "rank.env": (render_env_file(env), MODE_FILE),
        "config.json": (render_config(fleet, host, lane_name, lane, image, models), MODE_FILE),
        "start.sh": (render_start(fleet, host, lane_name, lane, image["image_id"], mounts), MODE_EXEC),
        "stop.sh": (render_stop(fleet, host, lane_name), MODE_EXEC),
    }
