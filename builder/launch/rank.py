"""What one rank runs: its command, environment, mounts and container options, and the ``docker run``
argv start.sh runs, rendered from the lane (builder.inputs.lanes), the inventory and the placement rule.

The one renderer: `builder bundle` writes its result into start.sh and rank.env, `builder launch`
prints it, and the audit compares a running container with it.
"""

from __future__ import annotations

import contextlib
import ipaddress
import re
from dataclasses import dataclass, field
from typing import Any

from builder.core.labels import LABEL_BUNDLE, LABEL_FLEET, LABEL_HOST, LABEL_LANE, LABEL_RANK
from builder.errors import ConfigError
from builder.inputs.hosts import Fleet, Host
from builder.inputs.lanes import PLACEHOLDERS, Lane, Mount, Ready, Run
from builder.inputs.pins import Pins
from builder.store.placement import mount_path

CONFIG_IN_CONTAINER = "/etc/builder/config.json"
#: start.sh puts the installed bundle's id here (the bundle's manifest covers start.sh itself)
BUNDLE_ID = "{bundle_id}"
#: the environment builder gives every rank; a lane may not set these
OWN_ENV = ("BUILDER_LANE", "BUILDER_FLEET", "BUILDER_HOST", "BUILDER_ROLE", "BUILDER_RANK", "BUILDER_CONFIG")


#: the address of a one-host fleet's only rank: there are no other ranks to reach it, and every rank runs
#: with --network host, so its own rendezvous and the head's API are on the host's loopback
LOOPBACK = "127.0.0.1"


def host_address(fleet: Fleet, host: Host) -> str:
    """The address other ranks use: ``address``, else the first rail, else the ssh target if it is an IP;
    in a one-host fleet, where there are no other ranks, the loopback."""
    if host.address:
        return host.address
    if host.fabric.rails:
        return host.fabric.rails[0]
    target = host.ssh.rsplit("@", 1)[-1]
    m = re.fullmatch(r"\[?([0-9A-Fa-f:.]+?)\]?(?::\d+)?", target)
    if m:
        with contextlib.suppress(ValueError):
            return str(ipaddress.ip_address(m.group(1)))
    if len(fleet.hosts) == 1:
        return LOOPBACK
    raise ConfigError(
        f"fleet {fleet.fleet.name}: host {host.name}: no address for the other ranks "
        "(set address, or fabric.rails)"
    )


def container_name(lane: str, rank: int) -> str:
    return f"builder-{lane}-r{rank}"


def release_dir(host: Host) -> str:
    """The installed release on the host (the installer's ``current`` link)."""
    return f"{host.paths.bundles.rstrip('/')}/current"


@dataclass(frozen=True)
class RankRun:
    """One rank's run, merged from the lane, its role and its own ``ranks.N`` entry."""

    entrypoint: list[str] | None
    args: list[str]
    env: dict[str, str]
    mounts: list[Mount]
    ready: Ready


def merged_run(lane: Lane, host: Host) -> RankRun:
    role: Run | None = lane.roles.head if host.role == "head" else lane.roles.worker
    own = lane.ranks.get(str(host.rank))
    layers = [r for r in (role, own) if r is not None]
    if not layers:
        raise ConfigError(f"lanes: no roles.worker and no ranks.{host.rank}: what does rank {host.rank} run?")
    entry: list[str] | None = None
    args: list[str] = []
    ready: Ready | None = None
    env: dict[str, str] = dict(lane.env)
    mounts: list[Mount] = list(lane.mounts)
    for r in layers:
        if r.entrypoint is not None:
            entry = r.entrypoint
        if r.args is not None:
            args = r.args
        if r.ready is not None:
            ready = r.ready
        env.update(r.env)
        mounts += r.mounts
    assert ready is not None  # (the lane's schema wants ready on each role)
    return RankRun(entrypoint=entry, args=list(args), env=env, mounts=mounts, ready=ready)


def substitutions(fleet: Fleet, host: Host, lane_name: str, lane: Lane) -> dict[str, str]:
    s = lane.serve
    fab = host.fabric
    subs = {
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
        "address": host_address(fleet, host),
        "rdma_devices": ",".join(fab.rdma_devices),
        "interfaces": ",".join(fab.interfaces),
        "interface": fab.interfaces[0] if fab.interfaces else "",
        "gid_index": "" if fab.gid_index == "auto" else str(fab.gid_index),
        # (a lane without a draft length has neither: using them is refused in fill, naming the key)
        "speculative_tokens": "" if s.speculative_tokens is None else str(s.speculative_tokens),
        "cudagraph_capture_sizes": ",".join(str(n) for n in s.capture_sizes()),
    }
    assert set(subs) == set(PLACEHOLDERS)
    return subs


#: placeholders that have a value only when ``serve.speculative_tokens`` is set
NEEDS_DRAFT = ("speculative_tokens", "cudagraph_capture_sizes")


def fill(text: str, subs: dict[str, str], where: str) -> str:
    for k in NEEDS_DRAFT:
        if "{" + k + "}" in text and subs[k] == "":
            raise ConfigError(f"{where}: {{{k}}} needs serve.speculative_tokens (the draft length k)")
    try:
        return text.format_map(subs)
    except (KeyError, ValueError, IndexError) as e:
        raise ConfigError(f"{where}: bad placeholder in {text!r}: {e} (known: {', '.join(PLACEHOLDERS)})") from None


@dataclass(frozen=True)
class RankCommand:
    """Everything start.sh needs to run this rank, rendered."""

    name: str
    image: str
    entrypoint: list[str] | None
    args: list[str]  # the container's command: the entrypoint's rest, then the args
    env: dict[str, str]
    #: (host path, target, writable, kind)
    mounts: list[tuple[str, str, bool, str]]
    options: list[str]
    ready: dict[str, Any]
    argv: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return {"container": self.name, "argv": self.argv, "env": self.env, "ready": self.ready,
                "mounts": [{"source": s, "target": t, "writable": w, "kind": k} for s, t, w, k in self.mounts]}


def rank_command(
    pins: Pins, fleet: Fleet, host: Host, lane_name: str, image: str, derived: dict[str, str] | None = None
) -> RankCommand:
    """This rank's ``docker run``, from the lane, inventory and placement; ``image`` is the ImageID
    (or, before a build, the image's tag by its input address); ``derived``: each derivation's folder
    on this host (builder.launch.derivplan), for the ``derived:NAME`` mounts."""
    lane = pins.lanes[lane_name]
    where = f"lanes.{lane_name}"
    run = merged_run(lane, host)
    subs = substitutions(fleet, host, lane_name, lane)
    env = _rank_env(fleet, host, lane_name, run, subs)
    entry = [fill(a, subs, f"{where}.entrypoint") for a in run.entrypoint] if run.entrypoint else None
    args = [fill(a, subs, f"{where}.args[{i}]") for i, a in enumerate(run.args)]
    cmd = (entry[1:] if entry else []) + args
    mounts = _rank_mounts(pins, host, lane_name, run, derived)
    opts = container_options(lane, host)
    ready = ready_spec(run.ready, subs, f"{where}: rank {host.rank}.ready")
    if host.rank != 0 and lane.start in ("workers-first", "workers-in-rank-order") and ready["kind"] in (
            "running", "port"):  # (a worker started before its head: not ready in time means its peer is missing)
        ready["peer"] = True
    name = container_name(lane_name, host.rank)
    rel = release_dir(host)
    argv = [
        "docker", "run", "-d", "--init", "--name", name, "--network", "host", "--restart", "no",
        "--label", f"{LABEL_LANE}={lane_name}", "--label", f"{LABEL_RANK}={host.rank}",
        "--label", f"{LABEL_BUNDLE}={BUNDLE_ID}", "--label", f"{LABEL_FLEET}={fleet.fleet.name}",
        "--label", f"{LABEL_HOST}={host.name}",
        "--env-file", f"{rel}/rank.env", "-v", f"{rel}/config.json:{CONFIG_IN_CONTAINER}:ro",
        *opts,
    ]
    for src, target, writable, _ in mounts:
        argv += ["-v", f"{src}:{target}" + ("" if writable else ":ro")]
    if entry:
        argv += ["--entrypoint", entry[0]]
    argv += [image, *cmd]
    return RankCommand(name=name, image=image, entrypoint=entry[:1] if entry else None, args=cmd, env=env,
                       mounts=mounts, options=opts, ready=ready, argv=argv)


def _rank_env(fleet: Fleet, host: Host, lane_name: str, run: RankRun, subs: dict[str, str]) -> dict[str, str]:
    """The rank's environment: what builder sets per rank, then the lane's, filled in."""
    where = f"lanes.{lane_name}"
    env: dict[str, str] = {
        "BUILDER_LANE": lane_name,
        "BUILDER_FLEET": fleet.fleet.name,
        "BUILDER_HOST": host.name,
        "BUILDER_ROLE": host.role,
        "BUILDER_RANK": str(host.rank),
        "BUILDER_CONFIG": CONFIG_IN_CONTAINER,
    }
    for k, v in run.env.items():
        if k in OWN_ENV:
            raise ConfigError(f"{where}.env.{k}: builder sets this per rank; remove it")
        value = fill(v, subs, f"{where}.env.{k}")
        if any(c in value for c in "\r\n\x00"):
            raise ConfigError(f"{where}.env.{k}: the value has a line break")
        if value != "":  # (an empty value is left out: a host without RDMA gets no NCCL_IB_HCA)
            env[k] = value
    return env


def _rank_mounts(pins: Pins, host: Host, lane_name: str, run: RankRun,
                 derived: dict[str, str] | None) -> list[tuple[str, str, bool, str]]:
    """The rank's mounts (host path, target, writable, kind), one at each target."""
    mounts: list[tuple[str, str, bool, str]] = []
    targets: set[str] = set()
    for m in run.mounts:
        if m.target in targets:
            raise ConfigError(f"lanes.{lane_name}: rank {host.rank} mounts two things at {m.target}")
        targets.add(m.target)
        if m.kind == "derived":
            src = (derived or {}).get(m.name) or f"{host.paths.bundles.rstrip('/')}/derived/{m.name}-(unlocked)"
        else:
            src = mount_path(pins, lane_name, host, m)
        mounts.append((src, m.target, m.writable, m.kind))
    return mounts


def container_options(lane: Lane, host: Host) -> list[str]:
    """The lane's container options as docker flags; GPU options only where the host expects GPUs
    with the NVIDIA runtime, RDMA devices only where its inventory lists RDMA devices."""
    o = lane.options
    gpu = host.expect.gpu_count > 0 and host.expect.nvidia_runtime
    if not gpu:
        return [x for d in o.devices if d.when == "rdma" and host.fabric.rdma_devices for x in ("--device", d.path)]
    out: list[str] = []
    if o.gpus:
        out += ["--gpus", o.gpus]
    if o.ipc:
        out += ["--ipc", o.ipc]
    if o.shm_size:
        out += ["--shm-size", o.shm_size]
    if o.memory:
        out += ["--memory", o.memory]
    if o.memory_swap:
        out += ["--memory-swap", o.memory_swap]
    if o.oom_score_adj is not None:
        out += ["--oom-score-adj", str(o.oom_score_adj)]
    for k, v in o.ulimits.items():
        out += ["--ulimit", f"{k}={v}"]
    for c in o.cap_add:
        out += ["--cap-add", c]
    for d in o.devices:
        if d.when == "always" or host.fabric.rdma_devices:
            out += ["--device", d.path]
    return out


def ready_spec(r: Ready, subs: dict[str, str], where: str) -> dict[str, Any]:
    """The rank's readiness as the host-side wait takes it (builder.hostscripts.lane)."""
    if r.health is not None:
        return {"kind": "health", "port": int(subs["port"]), "path": r.health}
    if r.port is not None:
        text = fill(str(r.port), subs, where)
        if not text.isdigit() or not 0 < int(text) < 65536:
            raise ConfigError(f"{where}.port: {r.port!r} is not a port")
        return {"kind": "port", "port": int(text)}
    if r.log is not None:
        return {"kind": "log", "pattern": r.log}
    return {"kind": "running"}
