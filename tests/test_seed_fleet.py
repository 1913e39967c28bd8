"""Every shipped seed lane runs the journey and deploy on the test fleet, with the simulator engine.

Two substitutions, made in the test project's copy of pins.toml (tests/lib/simlane.py `substitute`), and
the gates' speed judged nowhere (the simulator's tok/s is not an engine's):
- the lane's image is built from `images/sim` (the simulator engine: the seed engines' command lines,
  required variables, refusals and rendezvous direction) instead of its GB10 recipe;
- its models (and kit, and runtime files whose bytes nobody has published) are small snapshots with
  the same file names, in local folders instead of the Hub.
Everything else is the shipped lane: what each rank runs, its env, mounts, start order, readiness and
derivations. The vLLM lanes (300k with CUDA graphs, 1m eager) run on 2 hosts (tensor_parallel = 2) to
keep the fleet small.
"""

from __future__ import annotations

import json
import re
import shlex
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from builder.inputs.pins import expand_lanes
from tests.lib import factory, fleetlib
from tests.lib.journeylib import PATHS, Journey, edit_on, failing, journey
from tests.lib.simlane import set_serve_keys, substitute

pytestmark = [pytest.mark.fleet, pytest.mark.docker, pytest.mark.build, pytest.mark.slow]

# lane -> (hosts, image name in pins, serve keys to change for the test fleet)
LANES: dict[str, tuple[int, str, dict[str, Any]]] = {
    "tensorfold-tp4": (4, "tensorfold", {}),
    "tensorfold-tp2": (2, "tensorfold-tp2", {}),
    "vllm-native": (2, "vllm", {"tensor_parallel": 2}),
    "vllm-native-1m": (2, "vllm", {"tensor_parallel": 2}),  # (the eager lane: its own command line)
    "tensorfold-python-tp2": (2, "tensorfold-python", {}),
}
def head_args(root: Path, lane: str, extra: list[str]) -> None:
    """Append arguments to the head's args (a flag the engine refuses: a start that fails)."""
    doc = factory.read_pins(root)
    head = doc["lanes"][lane]["roles"]["head"]
    head["args"] = [*head["args"], *extra]
    factory.write_pins(root, doc)


@pytest.fixture(scope="module", params=list(LANES))
def seed(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Journey]:
    """A test fleet of the lane's size with nothing installed; the lane locked, fetched and built."""
    lane = request.param
    n, image, serve = LANES[lane]
    if not fleetlib.docker_available():
        pytest.fail("Docker Engine not reachable: the seed-lane fleet tests need it")
    work = tmp_path_factory.mktemp(lane)

    def prepare_pins(root: Path) -> None:
        substitute(root, lane, image, work)
        if serve:
            set_serve_keys(root, lane, serve)

    with journey(work, n, lane=lane, name="seed", bundle=False, image=image, before_lock=prepare_pins) as j:
        yield j


def _deploy(j: Journey) -> tuple[int, dict[str, Any]]:
    return j.deploy("--key", str(j.keys / "builder.key"), "--with-image", "--with-models", "--stop-timeout", "2",
                    "--start-timeout", "60", "--connect-timeout", "5")


def test_first_deploy_in_the_lanes_order_then_audits_pass(seed: Journey) -> None:
    j = seed
    launch = json.loads(j.builder("launch", "--fleet", j.name, "--json").stdout)
    rc, rep = _deploy(j)
    assert rc == 0 and rep["result"] == "deployed", (rep.get("reason"), j.last_stderr[-3000:])
    up = [ln.split(":")[0] for ln in j.last_stderr.splitlines() if re.match(r"^spark-\S+: rank \d+ is up", ln)]
    # the lane's order, one rank at a time, each once the one before it is up (builder.launch.order)
    assert up == launch["start_order"], (up, launch["start_order"])
    if launch["derivations"]:
        assert re.search(r"derivation \S+: made", j.last_stderr), j.last_stderr[-3000:]
    for mode in ("fast", "full"):
        rc, report = j.audit("--phase", "all", "--mode", mode)
        assert rc == 0, (mode, failing(report))
    # every rank runs exactly what `builder launch` showed (the bundle id and ImageID filled in)
    launch = json.loads(j.builder("launch", "--fleet", j.name, "--json").stdout)
    # the mounts that replace image paths found them in the built image (its record lists them)
    spec = expand_lanes(factory.read_pins(j.root), j.root / "pins.toml")["lanes"][launch["lane"]]
    replaces = any(m.get("replaces") for m in spec.get("mounts", []))
    assert launch["mount_targets"]["state"] == ("passed" if replaces else "none"), launch["mount_targets"]
    for h, want in zip(j.fleet.hosts, launch["hosts"], strict=True):
        got = json.loads(j.fleet.exec(h, f"docker inspect {want['container']}").stdout)[0]["Config"]
        argv = want["argv"]
        after = argv[argv.index(launch["image"]["ref"]) + 1:]
        assert (got.get("Cmd") or []) == after, (h.name, got.get("Cmd"), after)
        env = dict(e.split("=", 1) for e in got["Env"])
        assert {k: env.get(k) for k in want["env"]} == want["env"], h.name


def test_drift_of_a_derivation_or_model_file_is_named_on_its_host(seed: Journey) -> None:
    j = seed
    launch = json.loads(j.builder("launch", "--fleet", j.name, "--json").stdout)
    if not launch["derivations"]:
        model_drift_is_named(j, launch)
        return
    hosts = launch["hosts"]
    a, b = hosts[-1], hosts[-2]  # two ranks: b's file put into a's folder, then a's file truncated
    ha, hb = (next(h for h in j.fleet.hosts if h.name == x["host"]) for x in (a, b))
    path_a, path_b = a["derivations"][0]["path"], b["derivations"][0]["path"]
    files_b = j.fleet.exec(hb, f"cd {path_b} && find . -type f -name '*of*' ! -name '.builder*'").stdout.split()
    assert files_b, f"{hb.name}: no per-rank file in {path_b}"
    data = j.fleet.exec(hb, f"base64 -w0 {path_b}/{files_b[0]}").stdout
    j.fleet.exec(ha, ["sh", "-c", f"base64 -d > {path_a}/{Path(files_b[0]).name}"], input=data.encode())
    rc, report = j.audit("--phase", "preflight")
    assert rc == 1
    bad = {(h, c) for h, c in failing(report)}
    assert bad == {(ha.name, "engram::derivations_match_their_records")}, bad
    msg = json.dumps(report["hosts"][ha.name])
    assert "another rank's file" in msg and Path(files_b[0]).name in msg
    j.fleet.exec(ha, f"rm {path_a}/{Path(files_b[0]).name}")
    own = j.fleet.exec(ha, f"cd {path_a} && find . -type f ! -name '.builder*' | head -1").stdout.strip()
    j.fleet.exec(ha, f"truncate -s 1 {path_a}/{own}")
    rc, report = j.audit("--phase", "preflight")
    assert rc == 1 and failing(report) == {(ha.name, "engram::derivations_match_their_records")}
    assert "found 1" in json.dumps(report["hosts"][ha.name])
    # the operator's repair: make it again (derive.py remakes a folder that differs from its record)
    cur = "/var/lib/builder/current"
    r = j.fleet.ssh(ha, f"python3 {cur}/derive.py make {cur}/derive.json", timeout=300)
    assert r.returncode == 0 and "making it again" in r.stderr, r.stderr
    rc, report = j.audit("--phase", "all", "--mode", "full")
    assert rc == 0, failing(report)


def model_drift_is_named(j: Journey, launch: dict[str, Any]) -> None:
    """A lane that derives nothing (the vLLM lanes): a worker's model file with other bytes of the same
    size is named on its host by the full audit, and passes again once its bytes are back."""
    rank = launch["hosts"][-1]
    h = next(x for x in j.fleet.hosts if x.name == rank["host"])
    folder = next(a.split(":")[0] for a in rank["argv"] if a.endswith(":/model:ro"))
    name = j.fleet.exec(h, f"cd {folder} && ls *.safetensors | head -1").stdout.strip()
    assert name, f"{h.name}: no weights in {folder}"
    path = f"{folder}/{name}"
    keep = j.fleet.exec(h, f"base64 -w0 {path}").stdout
    mtime = j.fleet.exec(h, f"stat -c %.9Y {path}").stdout.strip()
    j.fleet.exec(h, ["sh", "-c", f"head -c $(stat -c %s {path}) /dev/zero > {path}.x && cat {path}.x > {path}"
                     f" && rm {path}.x"])
    rc, report = j.audit("--phase", "preflight", "--mode", "full")
    assert rc == 1 and {c for _, c in failing(report)} == {"models::content"}, failing(report)
    assert {x for x, _ in failing(report)} == {h.name} and name in json.dumps(report["hosts"][h.name])
    j.fleet.exec(h, ["sh", "-c", f"base64 -d > {path} && touch -m -d @{mtime} {path}"], input=keep.encode())
    rc, report = j.audit("--phase", "all", "--mode", "full")
    assert rc == 0, failing(report)


def in_place_targets(j: Journey, launch: dict[str, Any]) -> dict[str, tuple[fleetlib.Host, str]]:
    """kind -> (host, path) of one installed file of each kind, spread over the fleet's hosts."""
    hosts = {h.name: h for h in j.fleet.hosts}
    ranks = [hosts[x["host"]] for x in launch["hosts"]]  # rank order
    rec = {h.name: json.loads(j.fleet.exec(h, "cat /var/lib/builder/state/applied.json").stdout) for h in ranks}
    engram = PATHS["engram"].rstrip("/") + "/"

    def model(h: fleetlib.Host, pick: Any) -> str:
        return next(m["path"] for m in rec[h.name]["models"] if pick(m["path"]))

    def derived(h: fleetlib.Host, pick: Any) -> str:
        folder = next(x for x in launch["hosts"] if x["host"] == h.name)["derivations"][0]["path"]
        names = j.fleet.exec(h, f"cd {folder} && find . -type f ! -name '.builder*'").stdout.split()
        return f"{folder}/{next(n for n in sorted(names) if pick(n))[2:]}"

    return {
        "launch file": (ranks[0], f"{rec[ranks[0].name]['release']}/rank.env"),
        "Engram shard": (ranks[1], model(ranks[1], lambda p: p.startswith(engram))),
        "rank-cache byte": (ranks[1], derived(ranks[1], lambda n: "rank-cache/" in n)),
        "kit file": (ranks[2], model(ranks[2], lambda p: p.endswith("/cubins/experts.cubin"))),
        "token map": (ranks[2], derived(ranks[2], lambda n: n.endswith("token_map.json"))),
        "model shard": (ranks[3], model(ranks[3], lambda p: p.endswith(".safetensors") and not p.startswith(engram))),
    }


def test_files_changed_in_place_are_named_and_the_printed_command_repairs_them(seed: Journey) -> None:
    """Each kind of installed file changed in place (its size and mtime kept): the full audit names it,
    a deploy in full mode refuses naming the one command that repairs it, that command (as printed)
    places every one again, and the full audit passes; a second repair finds nothing to do."""
    j = seed
    launch = json.loads(j.builder("launch", "--fleet", j.name, "--json").stdout)
    if launch["lane"] != "tensorfold-tp4":
        pytest.skip("the in-place repair flow runs on the tensorfold-tp4 fleet only (its six kinds of file)")
    targets = in_place_targets(j, launch)
    for host, path in targets.values():
        edit_on(j.fleet, host, op="flip", path=path)
    done = False
    try:
        rc, report = j.audit("--phase", "preflight", "--mode", "full")
        assert rc == 1
        assert {h for h, _ in failing(report)} == {h.name for h, _ in targets.values()}, failing(report)
        for kind, (host, path) in targets.items():
            assert Path(path).name in json.dumps(report["hosts"][host.name]), (kind, path, failing(report))
        rc, rep = j.deploy("--mode", "full")
        assert rc == 1 and rep["result"] == "unchanged", rep.get("reason")
        printed = re.findall(r"`(builder [^`]*--repair[^`]*)`", rep["reason"])
        assert len(printed) == 1 and "--mode full" in printed[0], rep["reason"]
        argv = shlex.split(printed[0])
        fixed = j.builder(*argv[1:], "--json", check=False, timeout=900)
        out = json.loads(fixed.stdout)
        assert fixed.returncode == 0 and out["result"] == "deployed", (out.get("reason"), fixed.stderr[-3000:])
        repaired = {n for n, o in out["hosts"].items() if o["result"] == "repaired"}
        assert repaired == {h.name for h, _ in targets.values()}, out["hosts"]
        for kind, (host, path) in targets.items():
            assert re.search(rf"{host.name}: differed from its bundle or record, put right: .*"
                             rf"{re.escape(Path(path).name)}", fixed.stderr), (kind, fixed.stderr[-3000:])
        rc, report = j.audit("--phase", "all", "--mode", "full")
        assert rc == 0, failing(report)
        rc, rep = j.deploy("--repair")  # in fast mode too, every file hashed: nothing differs now
        assert rc == 0 and rep["result"] == "unchanged" and rep["reason"].startswith("nothing to repair"), rep
        done = True
    finally:
        if not done:  # (the seed fleet is shared: its files put right for the tests after this one)
            j.builder("deploy", "--fleet", j.name, "--repair", "--mode", "full", check=False, timeout=900)


def test_a_killed_worker_is_named_as_the_cause_in_audit_and_status(seed: Journey) -> None:
    """One worker's engine SIGKILLed: the head drops the group and the other followers lose the head, so
    every rank exits; the audit and `builder status` name the killed rank first, with its exit code, time
    and last log lines, and the others as its consequences."""
    j = seed
    launch = json.loads(j.builder("launch", "--fleet", j.name, "--json").stdout)
    if launch["lane"] != "tensorfold-tp4":
        pytest.skip("the killed-worker case runs on the tensorfold-tp4 fleet only")
    hosts = {h.name: h for h in j.fleet.hosts}
    victim, head = launch["hosts"][2], launch["hosts"][0]
    j.fleet.exec(hosts[victim["host"]], f"docker kill -s KILL {victim['container']}")
    try:
        deadline = time.monotonic() + 60
        while j.fleet.exec(hosts[head["host"]], f"docker inspect -f '{{{{.State.Running}}}}' {head['container']}"
                           ).stdout.strip() == "true":
            assert time.monotonic() < deadline, "the head still runs a minute after rank 2 was killed"
            time.sleep(1)
        rc, report = j.audit("--phase", "serving")
        assert rc == 1
        first = report["first_exit"]
        assert first and (first["host"], first["rank"], first["exit_code"]) == (victim["host"], 2, 137), first
        assert first["log"], first  # its last log lines
        msg = report["hosts"][victim["host"]]["message"]
        assert "rank 2" in msg and "exited first" in msg and "the cause" in msg, msg
        after = {e["host"] for e in first["consequences"]}
        assert head["host"] in after and victim["host"] not in after, first
        for name in after:
            assert "after rank 2" in report["hosts"][name]["message"], report["hosts"][name]["message"]
        p = j.builder("status", "--fleet", j.name, "--json", check=False)
        st = json.loads(p.stdout)
        assert p.returncode == 1 and st["first_exit"]["host"] == victim["host"], st
        exited = st["hosts"]
        assert exited[victim["host"]]["exited"] == "first" and exited[head["host"]]["exited"] == "after rank 2"
        assert "exited first" in p.stderr and "the cause" in p.stderr, p.stderr[-2000:]
    finally:  # (the seed fleet is shared: serving again for the tests after this one)
        j.builder("start", "--fleet", j.name, "--stop-timeout", "2", "--start-timeout", "60", timeout=600)


def test_a_changed_serve_setting_deploys_and_holds_the_derivations(seed: Journey) -> None:
    j = seed
    lane = json.loads(j.builder("launch", "--fleet", j.name, "--json").stdout)["lane"]
    j.set_serve(lane=lane, streams=3)
    rc, rep = _deploy(j)
    assert rc == 0 and rep["result"] == "deployed", (rep.get("reason"), j.last_stderr[-3000:])
    assert not re.search(r"derivation \S+: made", j.last_stderr), "a derivation whose address held was made again"
    rc, report = j.audit("--phase", "all")
    assert rc == 0, failing(report)


def test_an_engine_that_emits_one_repeated_token_is_refused_by_the_gates_and_rolled_back(seed: Journey) -> None:
    """The recipes' costliest story (an image built from a force-pushed branch booted cleanly and emitted one
    repeated garbage token), as the simulator's SIM_FAULT=garbage-token: every rank starts and /health
    answers, and the serving gates refuse the release, naming the gate, the prompt and what came back; the
    fleet is rolled back to the release it ran, which answers its replay as it did. One lane: the gates
    are the same code on every lane (tests/test_sim_engine.py asks every seed lane's of the simulator)."""
    j = seed
    lane = json.loads(j.builder("launch", "--fleet", j.name, "--json").stdout)["lane"]
    if lane != "tensorfold-tp2":
        pytest.skip("one seed lane carries the fault (tensorfold-tp2)")
    before = {h.name: j.fleet.exec(h, "readlink /var/lib/builder/current").stdout.strip() for h in j.fleet.hosts}
    doc = factory.read_pins(j.root)
    doc["lanes"][lane]["env"]["SIM_FAULT"] = "garbage-token"
    factory.write_pins(j.root, doc)
    j.builder("lock", "--offline", lane)
    try:
        rc, rep = _deploy(j)
        assert rc == 1 and rep["result"] == "rolled-back", (rep.get("reason"), j.last_stderr[-3000:])
        garble = r"gates::garble: gate garble: '17\*19=': one token repeated \(\d+ x id \d+\)"
        assert re.search(garble, rep["reason"]), rep["reason"]
        assert "gates::chat_probe: gate chat_probe: expected '323' in the reply" in rep["reason"], rep["reason"]
        after = {h.name: j.fleet.exec(h, "readlink /var/lib/builder/current").stdout.strip() for h in j.fleet.hosts}
        assert after == before
        back = rep["rollback_audit"]["hosts"][j.fleet.hosts[0].name]["checks"]
        assert back["gates::garble"]["status"] == "pass" and back["gates::replay"]["status"] == "pass", back
    finally:
        doc["lanes"][lane]["env"].pop("SIM_FAULT")
        factory.write_pins(j.root, doc)
        j.builder("lock", "--offline", lane)


def test_a_start_the_engine_refuses_rolls_the_fleet_back(seed: Journey) -> None:
    j = seed
    lane = json.loads(j.builder("launch", "--fleet", j.name, "--json").stdout)["lane"]
    before = {h.name: j.fleet.exec(h, "readlink /var/lib/builder/current").stdout.strip() for h in j.fleet.hosts}
    head_args(j.root, lane, ["--no-such-flag"])
    j.builder("lock", "--offline", lane)
    rc, rep = _deploy(j)
    assert rc == 1 and rep["result"] == "rolled-back", (rep.get("reason"), j.last_stderr[-3000:])
    assert "--no-such-flag" in rep["reason"] or "unrecognized" in rep["reason"] or "unknown argument" in rep["reason"]
    after = {h.name: j.fleet.exec(h, "readlink /var/lib/builder/current").stdout.strip() for h in j.fleet.hosts}
    assert after == before
    assert rep["rollback_audit"] and rep["rollback_audit"]["exit"] == 0, rep["reason"]
