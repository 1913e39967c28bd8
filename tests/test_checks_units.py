"""checks/checklib.py and checks/conftest.py: the commands the checks plan, the prefetch that runs them
in one remote call, and the results the checks report; run for real on this machine (testinfra local://)."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import testinfra

from builder.launch import LABEL_LANE, LABEL_RANK
from tests.lib import checkmods, fleetlib
from tests.lib.checkmods import checklib_fresh, concerns_for, count_commands, local_expect


def test_require_fails_where_or_skip_skips() -> None:
    cl: Any = checklib_fresh()
    assert cl.require([1], "x") == [1] and cl.or_skip({"a": 1}, "x") == {"a": 1}
    for empty in (None, [], {}):
        with pytest.raises(pytest.fail.Exception, match="^expected X, found none$"):
            cl.require(empty, "expected X, found none")
        with pytest.raises(pytest.skip.Exception, match="^why$"):
            cl.or_skip(empty, "why")


def test_a_missing_image_record_fails_with_a_lock_and_skips_without() -> None:
    cl: Any = checklib_fresh()
    img = {"image_id": "sha256:1"}
    assert cl.expected_image({"image": img, "lock_hash": "h"}) == img
    why = "image demo: expected a build record for input address 0123 in S (run `builder image demo`), found none"
    with pytest.raises(pytest.fail.Exception, match="expected a build record"):
        cl.expected_image({"image": None, "image_reason": why, "lock_hash": "h"})
    with pytest.raises(pytest.skip.Exception, match="no lock file"):
        cl.expected_image({"image": None, "image_reason": "no lock file at pins.lock", "lock_hash": None})


def test_collection_error_in_one_line() -> None:
    checkmods.checklib()  # checks/conftest.py imports it as `checklib`
    spec = importlib.util.spec_from_file_location("builder_checks_conftest", checkmods.CHECKS / "conftest.py")
    assert spec is not None and spec.loader is not None
    conf: Any = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(conf)
    imp = "test_x.py:1: in <module>\n    import nope\nE   ModuleNotFoundError: No module named 'nope'"
    syn = 'ast.py:50: in parse\nE     File "test_x.py", line 1\nE       def f(:\nE   SyntaxError: invalid syntax'
    native = 'Traceback:\n  File "test_x.py", line 1, in <module>\n    x = y\nNameError: name \'y\' is not defined\n'
    assert conf._collect_message(SimpleNamespace(longrepr=imp)) == "ModuleNotFoundError: No module named 'nope'"
    assert conf._collect_message(SimpleNamespace(longrepr=syn)) == "SyntaxError: invalid syntax"
    assert conf._collect_message(SimpleNamespace(longrepr=native)) == "NameError: name 'y' is not defined"
    conf._STATE["root"] = "checks"
    conf.pytest_collectreport(SimpleNamespace(failed=True, nodeid="test_x.py", longrepr=imp))
    conf.pytest_collectreport(SimpleNamespace(failed=False, nodeid="test_y.py", longrepr=None))
    assert conf._STATE["collect_errors"] == ["checks/test_x.py: ModuleNotFoundError: No module named 'nope'"]


def test_prefetch_answers_the_checks_commands_from_one_call(tmp_path: Path) -> None:
    cl: Any = checklib_fresh()
    host = testinfra.get_host("local://")
    expect = local_expect(tmp_path)
    planned = cl.planned(expect, concerns_for(expect))
    calls = count_commands(host)
    cl.prefetch(host, expect, concerns_for(expect))
    assert calls == ["python3 -I -S -c %s %s %s"]  # every planned command, one remote call
    assert len(cl.RAN) == len(planned) >= 6
    meminfo = cl.run(host, *cl.MEMINFO)
    assert meminfo.rc == 0 and "MemAvailable:" in meminfo.stdout
    assert cl.listing(host, expect, str(tmp_path / "models" / "tiny")) == ["w.bin"]
    rec, why = cl.read_applied(host, expect)
    assert rec is None and "no apply record" in why
    df = cl.run(host, *cl.free_disk(str(tmp_path / "models")))
    assert df.rc == 0 and len(df.stdout.split()) >= 4
    assert calls == ["python3 -I -S -c %s %s %s"]  # all of that answered from the prefetch
    cl.run(host, "true")  # a command nobody planned still runs, on its own
    assert calls[-1] == "true"
    cl.prefetch(host, expect, concerns_for(expect))  # once per host
    assert len(calls) == 2


def test_release_files_come_with_the_record_in_the_prefetch(tmp_path: Path) -> None:
    """The release files' hashes are in the one prefetch call (the host reads the record's file list
    itself); a check whose record names other files than the host's answer covers asks for its own."""
    cl: Any = checklib_fresh()
    host = testinfra.get_host("local://")
    expect = local_expect(tmp_path)
    cur = tmp_path / "current"
    cur.mkdir()
    (cur / "start.sh").write_text("run")
    (cur / "stop.sh").write_text("halt")
    state = tmp_path / "state"
    state.mkdir()
    (state / "applied.json").write_text(json.dumps({"files": [{"path": "start.sh"}, {"path": "stop.sh"}]}))
    calls = count_commands(host)
    cl.prefetch(host, expect, concerns_for(expect))
    got = cl.release_files(host, expect, [f"{cur}/start.sh", f"{cur}/stop.sh"])
    assert got[f"{cur}/stop.sh"]["sha256"] == hashlib.sha256(b"halt").hexdigest()
    assert calls == ["python3 -I -S -c %s %s %s"]  # answered by the prefetch
    got = cl.release_files(host, expect, [f"{cur}/start.sh"])  # another list: its own call
    assert list(got) == [f"{cur}/start.sh"] and len(calls) == 2


def test_prefetch_that_fails_leaves_each_check_to_run_its_own_command(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cl: Any = checklib_fresh()
    host = testinfra.get_host("local://")
    expect = local_expect(tmp_path)
    monkeypatch.setattr(cl, "BATCH", "print('not the batch output')")
    cl.prefetch(host, expect, concerns_for(expect))
    assert cl.RAN == {}
    r = cl.run(host, *cl.MEMINFO)  # runs for real
    assert r.rc == 0 and "MemAvailable:" in r.stdout


def test_a_hung_tool_costs_its_own_fact_only(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """FAKE nvidia-smi (test only: no GPU here) that hangs, as a wedged driver's does."""
    cl: Any = checklib_fresh()
    fake = tmp_path / "bin" / "nvidia-smi"
    fake.parent.mkdir()
    fake.write_text("#!/bin/sh\nexec sleep 300\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{fake.parent}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setattr(cl, "COMMAND_SECONDS", 1)
    expect = local_expect(tmp_path)
    expect["concerns"] = ["gpu", "memory"]
    expect["expect"]["gpu_count"] = 1  # type: ignore[index]
    host = testinfra.get_host("local://")
    cl.prefetch(host, expect, concerns_for(expect))
    assert cl.exists(host, "nvidia-smi")
    for c in cl.gpu_commands():
        r = cl.run(host, *c)
        assert r.rc == 124 and "timed out after 1 s" in r.stderr
    assert "MemAvailable:" in cl.run(host, *cl.MEMINFO).stdout


# ----------------------------------------------------------------------------- docker facts


@pytest.mark.docker
def test_inspect_images_answers_found_and_missing_images_in_one_call() -> None:
    """Against this machine's real Docker Engine, through testinfra's local backend as a check runs it."""
    if not fleetlib.docker_available():
        pytest.skip("Docker engine not reachable")
    cl: Any = checklib_fresh()
    image_id = fleetlib.tiny_image("builder-test-dockerfacts:1", labels={"org.builder.test": "yes"})
    refs = [image_id, "builder-test-dockerfacts:1", "builder-test-missing:0"]
    r = cl.run(testinfra.get_host("local://"), *cl.inspect_images(refs))
    assert r.rc == 1 and [i["Id"] for i in json.loads(r.stdout)] == [image_id, image_id]
    assert "No such image: builder-test-missing:0" in r.stderr
    info = cl.run(testinfra.get_host("local://"), *cl.docker_info())
    assert info.rc == 0 and json.loads(info.stdout)["ServerVersion"]


IMAGE_ID = "sha256:" + "ab" * 32
IMAGE = {"Id": IMAGE_ID, "RepoTags": ["builder/demo:1"]}


def docker_expect(concerns: list[str]) -> dict[str, Any]:
    return {"concerns": concerns, "containers": any(checkmods.check_module(c).CONCERN.containers for c in concerns),
            "lane": "demo", "host": {"rank": 1, "role": "worker"},
            "image": {"image_id": IMAGE_ID, "tag": "builder/demo:1"}}


def container(n: int, lane: str, rank: int) -> dict[str, Any]:
    """A container as `docker inspect` gives it (the keys the checks read), labelled as start.sh labels them."""
    return {"Id": str(n) * 64, "Name": f"/{lane}-r{rank}", "State": {"Running": True},
            "Config": {"Labels": {LABEL_LANE: lane, LABEL_RANK: str(rank)}}}


FAKE_DOCKER = """
# FAKE docker CLI (test only: the fast tier has no Docker Engine), holding the images and containers of the
# JSON file $FAKE_DOCKER_STATE. Where the checks read docker it follows the docker CLI: `ps -aq --filter
# label=K=V ...` prints the short ID of each container with every such label, one a line; `inspect REF...`
# (`image inspect`, `container inspect`) prints a JSON list of the objects found, in the order asked, and
# "Error: No such object: REF" (No such image, No such container) on stderr for each one not found, exit 1
# then; `info` prints the engine's JSON; with no engine, docker's own line and exit 1. The state's "answer"
# replaces inspect's with one docker does not give (the checks guard against it). Each call's arguments
# are appended, a JSON line, to $FAKE_DOCKER_STATE.calls.
import json, os, sys
args, path = sys.argv[1:], os.environ["FAKE_DOCKER_STATE"]
with open(path + ".calls", "a") as f:
    f.write(json.dumps(args) + "\\n")
with open(path) as f:
    state = json.load(f)
if not state["engine"]:
    sys.exit("Cannot connect to the Docker daemon at unix:///var/run/docker.sock. Is the docker daemon running?")
images, containers = state["images"], state["containers"]
if args[0] == "info":
    print(json.dumps({"ServerVersion": "20.10.24", "ServerErrors": None}))
elif args[:2] == ["ps", "-aq"]:
    want = [a[len("label="):].split("=", 1) for a in args[2:] if a.startswith("label=")]
    print("".join(c["Id"][:12] + "\\n" for c in containers if all(c["Config"]["Labels"].get(k) == v for k, v in want)),
          end="")
elif state["answer"] is not None:
    print(state["answer"])
else:
    kind = args[0] if args[0] in ("image", "container") else "object"
    refs = args[1:] if kind == "object" else args[2:]
    pool = (containers if kind != "image" else []) + (images if kind != "container" else [])
    found = [next((o for o in pool if o["Id"].startswith(r) or r in o.get("RepoTags", [])), None) for r in refs]
    print(json.dumps([o for o in found if o is not None], indent=4))
    for r, o in zip(refs, found):
        if o is None:
            print(f"Error: No such {kind}: {r}", file=sys.stderr)
    sys.exit(1 if None in found else 0)
"""


class FakeDocker:
    """FAKE_DOCKER on PATH, as `docker`; `holds` sets what it holds and forgets the calls so far."""

    def __init__(self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        exe = tmp_path / "bin" / "docker"
        exe.parent.mkdir()
        exe.write_text(f"#!{sys.executable}\n{FAKE_DOCKER}")
        exe.chmod(0o755)
        self.state = tmp_path / "docker-state.json"
        monkeypatch.setenv("PATH", f"{exe.parent}{os.pathsep}{os.environ['PATH']}")
        monkeypatch.setenv("FAKE_DOCKER_STATE", str(self.state))

    def holds(self, images: list[dict[str, Any]], containers: list[dict[str, Any]], *, engine: bool = True,
              answer: str | None = None) -> None:
        self.state.write_text(json.dumps({"images": images, "containers": containers, "engine": engine,
                                          "answer": answer}))
        Path(f"{self.state}.calls").unlink(missing_ok=True)

    def calls(self) -> list[str]:
        """Which docker command each call was (ps, inspect, image, container, info)."""
        log = Path(f"{self.state}.calls")
        return [json.loads(ln)[0] for ln in log.read_text().splitlines()] if log.exists() else []


def test_the_image_and_the_ranks_containers_are_one_docker_inspect(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """One docker inspect answers the image checks and the container checks, run through a local shell as
    a check runs it, against FakeDocker; docker's answer is taken apart by what it says (containers have a
    State, images are in the order asked, less those it names as not found), and an answer it cannot take
    apart leaves each image to its own call."""
    cl: Any = checklib_fresh()
    host = testinfra.get_host("local://")
    docker = FakeDocker(tmp_path, monkeypatch)
    mine, others = container(1, "demo", 1), [container(2, "demo", 0), container(3, "other", 1)]
    both = docker_expect(["image", "runtime"])

    def seen(exp: dict[str, Any], images: list[dict[str, Any]], containers: list[dict[str, Any]],
             **kw: Any) -> Any:
        docker.holds(images, containers, **kw)
        return cl.docker_objects(host, exp)

    got = seen(both, [IMAGE], [mine, *others])
    assert got.images == {IMAGE_ID: IMAGE, "builder/demo:1": IMAGE} and got.containers == [mine]
    assert docker.calls() == ["ps", "inspect"]  # (the rank's containers listed, then one inspect of all)
    got = seen(docker_expect(["image"]), [IMAGE], [mine])
    assert got.images == {IMAGE_ID: IMAGE, "builder/demo:1": IMAGE} and docker.calls() == ["image"]
    got = seen(docker_expect(["serving"]), [IMAGE], [mine, *others])
    assert got.images == {} and got.containers == [mine] and docker.calls() == ["ps", "container"]
    got = seen(docker_expect(["serving"]), [IMAGE], others)  # no container of this rank
    assert got.containers == [] and docker.calls() == ["ps"]

    got = seen(both, [{"Id": IMAGE_ID, "RepoTags": []}], [mine])  # the tag points nowhere
    assert got.images == {IMAGE_ID: {"Id": IMAGE_ID, "RepoTags": []}, "builder/demo:1": None}
    assert got.containers == [mine]
    got = seen(both, [], [])
    assert got.images == {IMAGE_ID: None, "builder/demo:1": None} and got.containers == []
    got = seen(both, [IMAGE], [mine], engine=False)
    assert got.images == {IMAGE_ID: None, "builder/demo:1": None} and got.containers is None
    assert got.why == ("docker gave no answer (exit 1: Cannot connect to the Docker daemon at "
                       "unix:///var/run/docker.sock. Is the docker daemon running?)")
    assert seen(both, [IMAGE], [mine], answer=json.dumps([IMAGE, mine])).images is None  # ask for each
    assert seen(both, [IMAGE], [mine], answer="garbage").why == "docker inspect: output is not JSON"

    # as the audit runs it: the prefetch runs every planned command in one call, still one docker inspect,
    # and the checks read its answer from there
    cl = checklib_fresh()
    exp = {**both, "expect": {"docker": True}}
    docker.holds([IMAGE], [mine, *others])
    cl.prefetch(host, exp, concerns_for(exp))
    calls = docker.calls()
    assert sorted(calls) == ["info", "inspect", "ps"], calls
    got = cl.docker_objects(host, exp)
    assert got.images == {IMAGE_ID: IMAGE, "builder/demo:1": IMAGE} and got.containers == [mine]
    assert docker.calls() == calls  # (answered by the prefetch)


@pytest.mark.docker
def test_docker_inspect_of_images_and_containers_against_the_engine() -> None:
    """`docker_objects` against this machine's real Docker Engine: a labelled container of the lane
    and rank, the image by ID and a tag that does not exist."""
    if not fleetlib.docker_available():
        pytest.skip("Docker engine not reachable")
    cl: Any = checklib_fresh()
    image_id = fleetlib.tiny_image("builder-test-dockerfacts:1")
    lane = f"test-objects-{os.getpid()}"
    cid = subprocess.run(["docker", "create", "--label", f"{LABEL_LANE}={lane}", "--label", f"{LABEL_RANK}=1",
                          image_id, "true"], capture_output=True, text=True, check=True).stdout.strip()
    try:
        exp = {**docker_expect(["image", "serving"]), "lane": lane,
               "image": {"image_id": image_id, "tag": "builder-test-missing:0"}}
        got = cl.docker_objects(testinfra.get_host("local://"), exp)
        assert got.images[image_id]["Id"] == image_id and got.images["builder-test-missing:0"] is None
        assert [c["Id"] for c in got.containers or []] == [cid]
    finally:
        subprocess.run(["docker", "rm", "-f", cid], capture_output=True)


@pytest.mark.parametrize(("status", "exit_fact"), [("exited", True), ("dead", True), ("created", False),
                                                   ("paused", False), ("restarting", False)])
def test_a_rank_not_running_is_an_exit_only_once_it_ended_and_its_log_hides_secrets(
        monkeypatch: pytest.MonkeyPatch, status: str, exit_fact: bool) -> None:
    serving: Any = checkmods.check_module("serving")
    c = {"Name": "/lane-r1", "State": {"Running": False, "Status": status, "ExitCode": 137,
                                      "FinishedAt": "2026-12-04T16:00:01Z"}}
    monkeypatch.setattr(serving, "lane_container", lambda host, expect: (c, ""))
    monkeypatch.setattr(serving, "run", lambda host, cmd, *a: SimpleNamespace(
        stdout="args: --api-key sk-live-1 --port 8000\nHF_TOKEN=hf_abc\nKilled\n"))
    facts: dict[str, Any] = {}
    expect = {"launch": {"container": "lane-r1"}, "host": {"rank": 1}, "image": None}
    with pytest.raises(pytest.fail.Exception) as e:
        serving.test_rank_runs_the_release(object(), expect, lambda key, value: facts.__setitem__(key, value))
    assert f"found {status} (exit code 137" in str(e.value)
    assert "sk-live-1" not in str(e.value) and "hf_abc" not in str(e.value)
    assert "--api-key *** --port 8000 | HF_TOKEN=*** | Killed" in str(e.value)
    assert ("exit" in facts) is exit_fact
    if exit_fact:
        assert facts["exit"]["log"] == "args: --api-key *** --port 8000 | HF_TOKEN=*** | Killed"


def test_launch_files_are_checked_against_the_signed_manifest_not_the_record(tmp_path: Path) -> None:
    release: Any = checkmods.check_module("release")
    checklib_fresh()
    host = testinfra.get_host("local://")
    expect = local_expect(tmp_path)
    cur = tmp_path / "current"
    cur.mkdir()
    body = {"start.sh": b"run", "stop.sh": b"halt", "rank.env": b"PORT=8000\n"}
    entries = [{"path": n, "size": len(b), "sha256": hashlib.sha256(b).hexdigest(), "mode": "0644"}
               for n, b in body.items()]
    for n, b in body.items():
        (cur / n).write_bytes(b)
    (cur / "manifest.json").write_text(json.dumps({"files": entries, "models": [], "image": {"archive": None}}))
    record = {"files": [{k: e[k] for k in ("path", "size", "sha256")} for e in entries]}
    release.test_launch_files_unchanged(host, record, expect)  # as installed: passes
    edited = b"PORT=9999\n"  # rank.env and its entry in the apply record edited together
    (cur / "rank.env").write_bytes(edited)
    record["files"][2] = {"path": "rank.env", "size": len(edited), "sha256": hashlib.sha256(edited).hexdigest()}
    with pytest.raises(AssertionError, match=r"1 launch file\(s\) changed: rank.env: expected sha256"):
        release.test_launch_files_unchanged(host, record, expect)
    (cur / "rank.env").write_bytes(body["rank.env"])  # the file put back, the record still edited
    with pytest.raises(AssertionError, match="apply record files: expected the manifest's entries, found "
                                                    "rank.env differing"):
        release.test_launch_files_unchanged(host, record, expect)
