"""Helpers shared by the check modules (imported as `checklib`; checks/ is on sys.path under pytest).

Each check module declares its concern at its top level, `CONCERN = Concern(name=..., order=...,
phase=..., containers=..., prefetch=...)` (builder.audit.concerns): every keyword but `prefetch` a
literal, as `builder audit` reads them from the source.
"""

from __future__ import annotations

import json
import shlex
from dataclasses import dataclass
from typing import Any

import pytest

from builder.audit.concerns import Cmd, Concern
from builder.core.labels import LABEL_BUNDLE, lane_filters
from builder.hostscripts import BATCH, BURN, DERIVE, FILES, GPUPROCS, MEMORY, dumps, fits, parse_batch, split_args, tied

APPLIED_CACHE: dict[str, tuple[dict[str, Any] | None, str]] = {}
#: results of the commands the prefetch ran, by command line (see prefetch)
RAN: dict[str, Any] = {}
PREFETCHED: list[bool] = []
EXISTS_CACHE: dict[str, bool] = {}
LIST_CACHE: dict[str, Any] = {}

#: the commands the checks look for, found with one remote command (one pytest process = one host)
KNOWN_COMMANDS = ("docker", "nvidia-smi")


def or_skip(value: Any, reason: str) -> Any:
    """The expectation, or skip the check saying why it is absent."""
    if value is None or value == [] or value == {}:
        pytest.skip(reason or "no expectation for this check")
    return value


def require(value: Any, message: str) -> Any:
    """The value, or fail the check with `message` ("expected X ..., found none"): for a value
    whose absence is itself drift (a real Spark always has it), where `or_skip` would skip."""
    if value is None or value == [] or value == {}:
        pytest.fail(message)
    return value


def expected_image(expect: dict[str, Any]) -> dict[str, Any]:
    """The image build record the lock expects. Without a lock there is nothing to compare (skip);
    with one, a missing record fails: nothing else would compare the host's image with the lock."""
    why = expect.get("image_reason") or "no image expected"
    if expect.get("lock_hash") is None:
        return or_skip(expect.get("image"), why)
    return require(expect.get("image"), why)


# ----------------------------------------------------------------------------- commands and prefetch
#
# Every command a check runs is built by one of these functions (a command is testinfra's
# (format, *args) pair, `Cmd`), so the prefetch below can run the same command lines ahead of the
# checks, all in one remote call, and `run` can answer a check from there.

#: the most seconds one prefetched shell command may take; past it, it answers exit status 124
#: ("builder: timed out after N s") and the check that reads it fails saying so
COMMAND_SECONDS = 120

MEMINFO: Cmd = ("cat /proc/meminfo",)
FSTAB: Cmd = ("cat /etc/fstab",)
LISTENERS: Cmd = ("ss -Hltn 2>/dev/null || cat /proc/net/tcp /proc/net/tcp6",)


def cat(path: str) -> Cmd:
    return ("cat %s", path)


PYTHON = "python3 -c %s %s"


def python(source: str, arg: str) -> Cmd:
    """Run a fact module of builder.hostscripts (its source) with one argument."""
    return (PYTHON, source, arg)


def docker_info() -> Cmd:
    """Whether the engine answers (ServerErrors, ServerVersion) and its runtimes."""
    return argv_command(["docker", "info", "--format", "{{json .}}"])


def inspect_images(refs: list[str]) -> Cmd:
    """`docker image inspect REF...` for several references at once: the images found, as a JSON
    list, and "No such image: REF" on stderr for each one not found."""
    return argv_command(["docker", "image", "inspect", *refs])


def lane_containers(lane: str, rank: int) -> Cmd:
    """`docker container inspect` of every container (running or not) that start.sh made for this
    lane and rank (by its labels, builder.launch), `[]` when there is none."""
    filters = lane_filters(lane, rank)
    return (
        f'ids=$(docker ps -aq{" %s" * len(filters)}) && '
        'if [ -n "$ids" ]; then docker container inspect $ids; else echo "[]"; fi',
        *filters,
    )


def image_refs(expect: dict[str, Any]) -> list[str]:
    """The image's ID and tag, when the image checks run (else none)."""
    img = expect.get("image")
    return [img["image_id"], img["tag"]] if "image" in (expect.get("concerns") or []) and img else []


def docker_objects_command(expect: dict[str, Any]) -> Cmd:
    """The image's ID and tag (when the image checks run) and this rank's containers (when the
    runtime, serving or GPU checks run) in one `docker inspect`, which takes images and containers
    alike: one docker CLI start less. With one of them only, that one's own command."""
    refs = image_refs(expect)
    lane, rank = expect["lane"], expect["host"]["rank"]
    if not refs:
        return lane_containers(lane, rank)
    if not expect.get("containers"):  # (no selected concern declares containers)
        return inspect_images(refs)
    filters = lane_filters(lane, rank)
    return (
        f"ids=$(docker ps -aq{' %s' * len(filters)}) && docker inspect" + " %s" * len(refs) + " $ids",
        *filters,
        *refs,
    )


@dataclass
class DockerObjects:
    """What docker said of the image and of this rank's containers (`docker_objects`)."""

    #: each image reference's inspect (None: not found); every one None when docker gave no answer;
    #: None when the answer cannot be matched with the references (ask for each on its own)
    images: dict[str, Any] | None
    #: this rank's containers, or None when docker gave no answer (`why`)
    containers: list[dict[str, Any]] | None
    why: str = ""


def docker_objects(host: Any, expect: dict[str, Any]) -> DockerObjects:
    """The answer of `docker_objects_command`, taken apart: the containers are the objects with a
    State; the images, the others, in the order asked, less those docker says it did not find."""
    refs = image_refs(expect)
    r = run(host, *docker_objects_command(expect))
    missing = {x for x in refs if f"No such image: {x}" in r.stderr or f"No such object: {x}" in r.stderr}
    try:
        found = json.loads(r.stdout or "[]")
    except ValueError:
        found = None
    if not isinstance(found, list) or (r.rc != 0 and not missing):
        if r.rc != 0:
            err = (r.stderr or r.stdout).strip().splitlines()
            why = f"docker gave no answer (exit {r.rc}: {err[-1] if err else 'no output'})"
            return DockerObjects(None if missing else dict.fromkeys(refs), None, why)
        return DockerObjects(None, None, "docker inspect: output is not JSON")
    containers = [o for o in found if isinstance(o, dict) and "State" in o]
    images = [o for o in found if not (isinstance(o, dict) and "State" in o)]
    present = [x for x in refs if x not in missing]
    matched = dict.fromkeys(refs) | dict(zip(present, images, strict=True)) if len(images) == len(present) else None
    return DockerObjects(matched, containers)


def container_pids(container_id: str) -> Cmd:
    """The host PIDs of a container's processes (`docker top`)."""
    return ("docker top %s -eo pid", container_id)


def memory_facts() -> Cmd:
    """Who holds the host's memory (hostscripts.memory): each running container's memory from its
    cgroup (v1 or v2) and its processes, and the biggest processes outside containers."""
    return python(MEMORY, dumps({"processes": 5}))


def derived_command(expect: dict[str, Any]) -> Cmd:
    """This rank's derivations against their records (builder.hostscripts.derive; full mode hashes)."""
    return python(DERIVE, dumps({"plan": expect["derivations"], "mode": expect.get("mode") or "fast"}))


def free_disk(path: str) -> Cmd:
    # the nearest existing folder above the path holds the filesystem it will use
    return ('p=%s; while [ ! -e "$p" ] && [ "$p" != / ]; do p=$(dirname "$p"); done; df -Pk "$p" | tail -n 1', path)


def readable_within(mount: str) -> Cmd:
    return ("timeout 10 ls -d %s/.", mount)


def argv_command(argv: list[str]) -> Cmd:
    return (" ".join(shlex.quote(a) for a in argv),)


def lookup_commands(names: list[str]) -> Cmd:
    words = " ".join(shlex.quote(n) for n in names)
    return (f'for c in {words}; do command -v "$c" >/dev/null 2>&1 && echo "$c"; done; true',)


def model_files_commands(expect: dict[str, Any]) -> list[Cmd]:
    """The hostscripts.filefacts calls that stat (fast) or hash (full) every model file this rank holds."""
    paths = [f["path"] for m in expect.get("models") or [] for f in m["files"]]
    full = expect.get("mode") == "full"
    jobs = expect.get("hash_jobs", 4)
    return [python(FILES, dumps({"paths": c, "hash": full, "jobs": jobs})) for c in split_args(paths)]


def release_files_command(expect: dict[str, Any]) -> Cmd:
    """The hostscripts.filefacts call that hashes every file the apply record names under the release
    (the record is read there, so that the prefetch runs it with the record, not after it)."""
    return python(FILES, dumps({"record": expect["applied_path"], "under": expect["current_path"], "hash": True,
                                "jobs": 4}))


def release_files(host: Any, expect: dict[str, Any], paths: list[str]) -> Any:
    """Size and sha256 of each of `paths` (the release's files the check's apply record names): the
    answer of `release_files_command` when it covers exactly these paths (the host's record then
    named the same files), else a call for these paths."""
    r = run(host, *release_files_command(expect))
    if r.rc == 0:
        try:
            got = json.loads(r.stdout)
        except ValueError:
            got = None
        if isinstance(got, dict) and sorted(got) == sorted(paths):
            return got
    return json_output(run(host, *python(FILES, dumps({"paths": paths, "hash": True, "jobs": 4}))))


def listing_roots(expect: dict[str, Any]) -> list[str]:
    roots = [m["root"] for m in expect.get("models") or []] + [expect["paths"]["engram"].rstrip("/")]
    return list(dict.fromkeys(roots))


def listing_command(roots: list[str]) -> Cmd:
    """Every regular file under each root (hostscripts.filefacts)."""
    return python(FILES, dumps({"roots": roots}))


def gpu_commands() -> list[Cmd]:
    from builder import gpu as G

    return [argv_command(argv) for argv in G.probe_commands()]


def lane_docker(expect: dict[str, Any]) -> list[Cmd]:
    """This rank's containers (with the image, when the image checks run too), where the host has
    docker: what a concern that declares `containers` prefetches."""
    return [docker_objects_command(expect)] if expect["expect"].get("docker") else []


def planned(expect: dict[str, Any], concerns: list[Concern]) -> list[Cmd]:
    """The commands the selected checks will run on this host whatever they find: each concern's
    `prefetch` (commands that depend on another command's answer, such as a container's processes,
    are not there)."""
    cmds: list[Cmd] = [lookup_commands(sorted(KNOWN_COMMANDS))]
    for c in concerns:
        if c.prefetch is not None:
            cmds += c.prefetch(expect)
    return list(dict.fromkeys(cmds))  # (each once: several concerns may need the same command)


def prefetch(host: Any, expect: dict[str, Any], concerns: list[Concern]) -> None:
    """Run the commands `concerns` plan in one remote python3 (hostscripts.batch; a few calls for very
    long lists), once per host.

    Any failure of the batch itself (no python3 on the host, odd output) leaves the cache empty,
    so each check runs its own command as before; a lost connection is raised, as from a check.
    """
    if PREFETCHED:
        return
    PREFETCHED.append(True)
    items: dict[str, Any] = {}
    for c in planned(expect, concerns):
        line = host.backend.quote(*c)
        # a python3 fact script runs inside the batch's own python3 rather than starting another
        items[line] = ["py", line, c[1], c[2]] if c[0] == PYTHON and len(c) == 3 else line
    # a command too long to share a batch call is left to its check, which runs it by itself
    for group in split_args(i for i in items.values() if fits(i)):
        # -I -S: the batch needs only the standard library; no site-packages scan, no user paths
        r = host.run("python3 -I -S -c %s %s %s", BATCH, json.dumps(group), str(COMMAND_SECONDS))
        if r.rc != 0:
            return
        try:
            got = parse_batch(r.stdout)
        except ValueError:
            return
        for line, (rc, out, err) in got.items():
            if line in items:
                RAN[line] = host.backend.result(rc, host.backend.encode(line), out, err)


def run(host: Any, command: str, *args: str) -> Any:
    """host.run(command, *args), answered from the prefetch when it ran that command line."""
    line = host.backend.quote(command, *args)
    if line in RAN:
        return RAN[line]
    return host.run(command, *args)


def remote_json(host: Any, source: str, arg: str) -> Any:
    """Run a fact module of builder.hostscripts (its source) on the host and parse its JSON output."""
    return json_output(run(host, *python(source, arg)))


def json_output(r: Any) -> Any:
    if r.rc != 0:
        err = (r.stderr or r.stdout).strip().splitlines()
        raise RuntimeError(f"remote python3 failed (exit {r.rc}): {err[-1] if err else 'no output'}")
    return json.loads(r.stdout)


def read_applied(host: Any, expect: dict[str, Any]) -> tuple[dict[str, Any] | None, str]:
    """The host's apply record (parsed), or None and why."""
    key = expect["applied_path"]
    if key in APPLIED_CACHE:
        return APPLIED_CACHE[key]
    r = run(host, *cat(key))
    if r.rc != 0:
        out: tuple[dict[str, Any] | None, str] = (None, f"no apply record at {key} (nothing installed?)")
    else:
        try:  # the bytes: a damaged record need not even be text
            rec = json.loads(r.stdout_bytes)
            out = (rec, "") if isinstance(rec, dict) else (None, f"{key}: not a JSON object")
        except UnicodeDecodeError:
            out = (None, f"{key}: not UTF-8 text")
        except ValueError as e:
            out = (None, f"{key}: malformed JSON ({getattr(e, 'msg', e)})")
    APPLIED_CACHE[key] = out
    return out


def lane_container(host: Any, expect: dict[str, Any]) -> tuple[dict[str, Any] | None, str]:
    """The one container of this host's lane and rank (docker inspect), or None and why: none,
    several, or no answer from docker."""
    objs = docker_objects(host, expect)
    if objs.containers is None:
        return None, objs.why
    found = objs.containers
    name = f"lane {expect['lane']} rank {expect['host']['rank']}"
    if not found:
        return None, f"no container of {name}"
    if len(found) > 1:
        return None, f"{len(found)} containers of {name}: {', '.join(str(c.get('Name')) for c in found)}"
    return found[0], ""


def lane_owns_running_release(host: Any, expect: dict[str, Any]) -> tuple[bool, str]:
    """Whether this rank's container is running the installed release (the apply record's bundle),
    so that what it holds (the API port, the GPU) is the lane's own; and a word on what was found."""
    c, why = lane_container(host, expect)
    if c is None:
        return False, why
    rec, _ = read_applied(host, expect)
    bundle = (c.get("Config") or {}).get("Labels", {}).get(LABEL_BUNDLE)
    if not (c.get("State") or {}).get("Running"):
        return False, f"container {c.get('Name')} is not running"
    own = {rec.get("bundle_id")} if rec is not None else set()
    if rec is not None and expect.get("release") == "staged":  # (a deploy stops it before the switch)
        own.add(rec.get("previous_bundle_id"))
    if bundle is None or bundle not in own:
        return False, f"container {c.get('Name')} runs bundle {str(bundle)[:16]}, not the installed release"
    return True, f"container {c.get('Name')} of the installed release"


def exists(host: Any, name: str) -> bool:
    """`command -v NAME` on the host, cached; the first call looks up every known command at once."""
    if name not in EXISTS_CACHE:
        names = sorted(set(KNOWN_COMMANDS) | {name})
        r = run(host, *lookup_commands(names))
        if r.rc == 0:
            found = set(r.stdout.split())
            for n in names:
                EXISTS_CACHE[n] = n in found
        else:  # an odd shell: ask testinfra, one name at a time
            EXISTS_CACHE[name] = bool(host.exists(name))
    return EXISTS_CACHE[name]


def listing(host: Any, expect: dict[str, Any], root: str) -> Any:
    """The listing of `root` (None: no such folder). One remote call lists every model
    root and the Engram folder together, the first time any of them is asked for."""
    if root not in LIST_CACHE:
        roots = listing_roots(expect)
        if root not in roots:
            roots.append(root)
        LIST_CACHE.update(json_output(run(host, *listing_command(roots))))
    return LIST_CACHE[root]


def gpu_report(host: Any) -> Any:
    """builder.gpu's probe of the host (through the prefetch); GpuError when nvidia-smi fails."""
    from builder import gpu as G

    def runner(argv: list[str]) -> tuple[int, str, str]:
        r = run(host, *argv_command(argv))
        return r.rc, r.stdout, r.stderr

    return G.probe(runner)


def gpu_process_owners(host: Any, pids: list[int]) -> dict[str, Any]:
    """builder.hostscripts.gpuprocs on the host: each pid's BUILDER_* variables (None: unreadable)."""
    return dict(remote_json(host, GPUPROCS, dumps({"pids": sorted(pids)})))


def own_gpu_pids(host: Any, expect: dict[str, Any], pids: list[int]) -> tuple[set[int], str]:
    """Which of the GPU's compute processes are the lane's own, and a word on what could not be told.

    A process is the lane's own when its environment names this lane, fleet and rank (the variables
    every rank's container gets, builder.launch.rank; seen from the host's /proc, with or without
    Docker), or, where Docker is expected, when it runs in this rank's container of the installed
    release (`docker top`). A process whose environment is unreadable is not the lane's."""
    if not pids:
        return set(), ""
    own: set[int] = set()
    notes: list[str] = []
    try:
        facts = gpu_process_owners(host, pids)
    except (RuntimeError, ValueError) as e:
        facts, notes = {"pids": {}}, [f"the processes' environments are unknown: {e}"]
    want = {"BUILDER_LANE": expect["lane"], "BUILDER_FLEET": expect["fleet"],
            "BUILDER_RANK": str(expect["host"]["rank"])}
    for pid, env in (facts.get("pids") or {}).items():
        if isinstance(env, dict) and all(env.get(k) == v for k, v in want.items()):
            own.add(int(pid))
    unread = sorted(facts.get("why") or {})
    if unread:
        notes.append(f"environment unreadable for pid {', '.join(unread[:3])} ({facts['why'][unread[0]]})")
    if expect["expect"].get("docker"):
        ours, _ = lane_owns_running_release(host, expect)
        if ours:
            c, _ = lane_container(host, expect)
            r = run(host, *container_pids(str((c or {}).get("Id"))))
            if r.rc == 0:
                own |= {int(w) for w in r.stdout.split() if w.isdigit()}
    return own & set(pids), "; ".join(notes)


def burn_facts(host: Any, request: dict[str, Any]) -> dict[str, Any]:
    """builder.hostscripts.burnload on the host: run the load, sample the GPUs (not prefetched: it takes
    the load's seconds, and runs after the checks that tell whether the GPU is free)."""
    # tied: a load whose ssh channel closed (the audit ended, however) is ended on the host, not left on the GPU
    return dict(json_output(host.run(tied(f"python3 -I -S -c {shlex.quote(BURN)} {shlex.quote(dumps(request))}"))))
