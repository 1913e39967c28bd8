"""The operator's journey, end to end, CLI only, on the shipped pins: a correct install passes its own
audit before start and while it serves, and each drift fails exactly one host, naming exactly that drift.

The steps are the README's quick tour (tests/lib/journeylib.py): `builder lock --offline demo`,
`builder image demo`, `builder keygen`, `builder bundle --fleet F --with-image --with-models`,
`builder ship` to each host (workers first), `current/start.sh` (workers first), `builder audit`.
No fake installer, no hand-written lock, no stand-in image: the real image is built from the shipped
pins, shipped in the real bundle and installed by the real installer. The copy's pins add to the demo
lane what the seed lanes mount besides their models (the shipped demo lane has none): a kernel kit (a
folder and its MANIFEST), the shipped chat template and an overlay file, mounted on every rank; their
drift is named like a model file's.
"""

from __future__ import annotations

import base64
import hashlib
import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.lib import factory, fleetlib
from tests.lib.journeylib import PATHS, Journey, edit_on, failing, journey

pytestmark = [pytest.mark.fleet, pytest.mark.docker, pytest.mark.build]

MODEL = f"{PATHS['models']}/demo-tiny/model-00001-of-00002.safetensors"
ENGRAM = f"{PATHS['engram']}/demo-engram"
RANK_ENV = f"{PATHS['bundles']}/current/rank.env"
KIT = f"{PATHS['models']}/demo-kit"
KIT_FILES = {
    "aot/aot.json": b'{"kernels": ["00ab"]}\n',
    "cubins/linear.cubin": bytes(range(256)) * 16,
    "rope.json": b'{"theta": 10000}\n',
}
TEMPLATE = f"{PATHS['models']}/demo-chat-template/demo-chat-template.jinja"
OVERLAY = f"{PATHS['models']}/demo-overlay/engram.py"
#: where each rank's container sees them
MOUNTS = {KIT: "/kit", TEMPLATE: "/templates/chat_template.jinja", OVERLAY: "/overlay/engram.py"}


def runtime_inputs(workdir: Path) -> Callable[[Path], None]:
    """A kit (a folder and its MANIFEST, in the shape of bertholomus-tp4's) and an overlay file in the
    workdir; returned, the change of a project's pins that mounts them and the shipped chat template on
    every rank."""
    kit = workdir / "demo-kit"
    lines = []
    for rel, data in KIT_FILES.items():
        (kit / rel).parent.mkdir(parents=True, exist_ok=True)
        (kit / rel).write_bytes(data)
        lines.append(f"{hashlib.sha256(data).hexdigest()} {len(data):>10}  git   -    {rel}")
    (kit / "MANIFEST").write_text("# the demo kit\n# Columns: sha256, bytes, origin, two-node, path.\n"
                                  + "\n".join(lines) + "\n")
    overlay = b"# mounted over the engine's engram.py (an overlay file, as vLLM's boot-10 files)\nENGRAM = 1\n"
    (workdir / "engram.py").write_bytes(overlay)
    mounts = [{"source": f"input:{n}", "target": MOUNTS[p]}
              for n, p in (("demo-kit", KIT), ("demo-chat-template", TEMPLATE), ("demo-overlay", OVERLAY))]

    def mount(d: dict[str, Any]) -> None:
        d.setdefault("kits", {})["demo-kit"] = {"local": str(kit), "expect_files": len(KIT_FILES)}
        d["files"]["demo-overlay"] = {"url": f"file://{workdir / 'engram.py'}",
                                      "sha256": hashlib.sha256(overlay).hexdigest()}
        d["lanes"]["demo"].setdefault("ranks", {}).update({"0": {"mounts": mounts}, "1": {"mounts": mounts}})

    def add(root: Path) -> None:
        factory.edit_pins(root, mount)

    return add


@pytest.fixture(scope="module")
def j(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Journey]:
    if not fleetlib.docker_available():
        pytest.fail("Docker Engine not reachable: the journey needs it")
    work = tmp_path_factory.mktemp("journey")
    with journey(work, 2, before_lock=runtime_inputs(work)) as jj:
        yield jj


@pytest.fixture
def up(j: Journey) -> Journey:
    """The journey's lane serving: started in rank order (start.sh is a no-op for a rank that already
    runs its installed bundle), so each test stands alone whatever ran before it."""
    j.start()
    return j


def _ok(rc: int, report: dict[str, Any]) -> None:
    assert rc == 0 and not failing(report), json.dumps(
        {h: r["message"] for h, r in report["hosts"].items()}, indent=1
    )


def _passed(report: dict[str, Any], host: str) -> set[str]:
    return {c for c, r in report["hosts"][host]["checks"].items() if r["status"] == "pass"}


def _drift(j: Journey, host: fleetlib.Host, want: set[str], *args: str) -> dict[str, Any]:
    """Audit the serving fleet; exactly `want` fails, on `host` only. Returns the report."""
    rc, report = j.audit("--phase", "all", *args)
    got = failing(report)
    assert got == {(host.name, c) for c in want}, json.dumps(
        {h: {c: r for c, r in hr["checks"].items() if r["status"] not in ("pass", "skip")}
         for h, hr in report["hosts"].items()}, indent=1
    )
    assert rc == 1
    return report


def _msg(report: dict[str, Any], host: fleetlib.Host, check: str) -> str:
    return str(report["hosts"][host.name]["checks"][check]["message"])


def _edit(j: Journey, h: fleetlib.Host, **req: Any) -> dict[str, Any]:
    return edit_on(j.fleet, h, **req)


def test_preflight_audit_of_the_installed_lane_passes(j: Journey) -> None:
    for mode in ("fast", "full"):
        rc, report = j.audit("--phase", "preflight", "--mode", mode)
        _ok(rc, report)
        for h in j.fleet.hosts:
            must = {
                "image::present_by_id", "image::diff_ids", "release::record_identity", "release::record_lock",
                "release::record_image", "release::manifest_hash", "release::launch_files_unchanged",
                "models::files_present", "models::sizes", "models::content", "models::file_count",
                "engram::own_rank_files", "engram::no_other_rank_files", "runtime::docker",
            }
            assert must <= _passed(report, h.name), (h.name, mode, must - _passed(report, h.name))


def test_each_rank_holds_its_own_engram_files_only(j: Journey) -> None:
    for rank, h in enumerate(j.fleet.hosts):
        names = sorted(j.fleet.exec(h, f"ls {ENGRAM}").stdout.split())
        assert names == [f"engram-l1-r{rank}of2.bin", f"engram-l14-r{rank}of2.bin"]
        assert j.fleet.exec(h, f"ls {PATHS['models']}/demo-tiny | wc -l").stdout.strip() == "4"


def test_runtime_inputs_are_placed_and_mounted_on_every_rank(up: Journey) -> None:
    j = up
    for rank, h in enumerate(j.fleet.hosts):
        names = j.fleet.exec(h, f"cd {KIT} && find . -type f | sort").stdout.split()
        assert names == sorted(f"./{p}" for p in [*KIT_FILES, "MANIFEST"]), (h.name, names)
        sums = j.fleet.exec(h, f"sha256sum {TEMPLATE}").stdout.split()[0]
        assert sums == hashlib.sha256((j.root / "files/demo-chat-template.jinja").read_bytes()).hexdigest()
        mounts = json.loads(j.fleet.exec(h, f"docker inspect -f '{{{{json .Mounts}}}}' builder-demo-r{rank}").stdout)
        seen = {m["Source"]: (m["Destination"], m["RW"]) for m in mounts}
        assert {p: seen.get(p) for p in MOUNTS} == {p: (t, False) for p, t in MOUNTS.items()}, (h.name, seen)


def test_serving_audit_passes_fast_and_full(up: Journey) -> None:
    j = up
    for mode in ("fast", "full"):
        rc, report = j.audit("--phase", "all", "--mode", mode)
        _ok(rc, report)
        head, worker = j.fleet.hosts
        assert {"serving::health", "serving::one_token_completion", "serving::rank_runs_the_release",
                "runtime::api_port_free"} <= _passed(report, head.name)
        assert "serving::rank_runs_the_release" in _passed(report, worker.name)
    # a second preflight while serving: the port and GPU are the lane's own release's
    _ok(*j.audit("--phase", "preflight"))


def test_changed_model_byte_same_size_and_mtime_fails_full_mode(up: Journey) -> None:
    j = up
    worker = j.fleet.hosts[1]
    orig = _edit(j, worker, op="read", path=MODEL)
    data = bytearray(base64.b64decode(orig["data"]))
    data[1000] ^= 0xFF
    _edit(j, worker, op="write_in_place", path=MODEL, data=base64.b64encode(data).decode())
    try:
        _ok(*j.audit("--phase", "all"))  # fast mode trusts size, mtime and inode: that is its rule
        report = _drift(j, worker, {"models::content"}, "--mode", "full")
        assert MODEL in _msg(report, worker, "models::content")
    finally:
        _edit(j, worker, op="write_in_place", path=MODEL, data=orig["data"], mtime_ns=orig["mtime_ns"])
    _ok(*j.audit("--phase", "all", "--mode", "full"))


def test_touched_model_file_fails_fast_mode(up: Journey) -> None:
    j = up
    head = j.fleet.hosts[0]
    orig = _edit(j, head, op="read", path=MODEL)
    _edit(j, head, op="touch", path=MODEL)
    try:
        report = _drift(j, head, {"models::content"})
        assert MODEL in _msg(report, head, "models::content") and "modified" in _msg(report, head, "models::content")
    finally:
        _edit(j, head, op="set_mtime", path=MODEL, mtime_ns=orig["mtime_ns"])
    _ok(*j.audit("--phase", "all"))


def test_changed_kit_file_fails_full_mode_on_its_host(up: Journey) -> None:
    j = up
    worker = j.fleet.hosts[1]
    path = f"{KIT}/cubins/linear.cubin"
    orig = _edit(j, worker, op="read", path=path)
    data = bytearray(base64.b64decode(orig["data"]))
    data[100] ^= 0xFF
    _edit(j, worker, op="write_in_place", path=path, data=base64.b64encode(data).decode())
    try:
        _ok(*j.audit("--phase", "all"))  # fast mode: size, mtime and inode unchanged
        report = _drift(j, worker, {"models::content"}, "--mode", "full")
        assert path in _msg(report, worker, "models::content")
    finally:
        _edit(j, worker, op="write_in_place", path=path, data=orig["data"], mtime_ns=orig["mtime_ns"])
    _ok(*j.audit("--phase", "all", "--mode", "full"))


def test_changed_chat_template_fails_on_its_host(up: Journey) -> None:
    j = up
    head = j.fleet.hosts[0]
    orig = _edit(j, head, op="read", path=TEMPLATE)
    data = base64.b64decode(orig["data"]).replace(b"assistant", b"ASSISTANT")
    assert len(data) == len(base64.b64decode(orig["data"])) and data != base64.b64decode(orig["data"])
    _edit(j, head, op="replace", path=TEMPLATE, data=base64.b64encode(data).decode())
    try:
        report = _drift(j, head, {"models::content"})
        assert TEMPLATE in _msg(report, head, "models::content") and "modified" in _msg(report, head, "models::content")
        report = _drift(j, head, {"models::content"}, "--mode", "full")
        assert TEMPLATE in _msg(report, head, "models::content")
    finally:
        _edit(j, head, op="write_in_place", path=TEMPLATE, data=orig["data"], mtime_ns=orig["mtime_ns"])
    _ok(*j.audit("--phase", "all"))


def test_changed_overlay_file_fails_on_its_host(up: Journey) -> None:
    j = up
    worker = j.fleet.hosts[1]
    orig = _edit(j, worker, op="read", path=OVERLAY)
    _edit(j, worker, op="replace", path=OVERLAY, data=base64.b64encode(b"ENGRAM = 0  # edited by hand\n").decode())
    try:
        report = _drift(j, worker, {"models::sizes"})
        assert OVERLAY in _msg(report, worker, "models::sizes")
    finally:
        _edit(j, worker, op="replace", path=OVERLAY, data=orig["data"])
        _edit(j, worker, op="set_mtime", path=OVERLAY, mtime_ns=orig["mtime_ns"])
    _ok(*j.audit("--phase", "all"))


def test_engram_file_with_another_ranks_bytes(up: Journey) -> None:
    j = up
    worker = j.fleet.hosts[1]
    mine = f"{ENGRAM}/engram-l1-r1of2.bin"
    theirs = (j.root / "models/hf-cache/models--builder-demo--tiny-engram/snapshots").glob("*/engram-l1-r0of2.bin")
    other = next(theirs).read_bytes()
    orig = _edit(j, worker, op="read", path=mine)
    assert base64.b64decode(orig["data"]) != other
    _edit(j, worker, op="write_in_place", path=mine, data=base64.b64encode(other).decode())
    try:
        report = _drift(j, worker, {"models::content"}, "--mode", "full")
        assert mine in _msg(report, worker, "models::content")
    finally:
        _edit(j, worker, op="write_in_place", path=mine, data=orig["data"], mtime_ns=orig["mtime_ns"])
    _ok(*j.audit("--phase", "all", "--mode", "full"))


def test_missing_engram_file(up: Journey) -> None:
    j = up
    worker = j.fleet.hosts[1]
    gone = f"{ENGRAM}/engram-l14-r1of2.bin"
    j.fleet.exec(worker, f"mv {gone} /tmp/moved.bin")
    try:
        report = _drift(j, worker, {"models::files_present"})
        assert gone in _msg(report, worker, "models::files_present")
    finally:
        j.fleet.exec(worker, f"mv /tmp/moved.bin {gone}")
    _ok(*j.audit("--phase", "all"))


def test_edited_launch_file(up: Journey) -> None:
    j = up
    head = j.fleet.hosts[0]
    orig = _edit(j, head, op="read", path=RANK_ENV)
    j.fleet.exec(head, f"echo TF_DEBUG=1 >> $(readlink -f {RANK_ENV})")
    try:
        report = _drift(j, head, {"release::launch_files_unchanged"})
        assert "rank.env" in _msg(report, head, "release::launch_files_unchanged")
    finally:
        _edit(j, head, op="replace", path=RANK_ENV, data=orig["data"])
    _ok(*j.audit("--phase", "all"))


def test_a_rank_running_another_image(up: Journey) -> None:
    j = up
    head, worker = j.fleet.hosts
    cur = f"{PATHS['bundles']}/current"
    # another image: the worker's own container committed (same files, another ImageID)
    other = j.fleet.exec(worker, "docker commit builder-demo-r1 other/demo:1").stdout.strip()
    j.stop()
    # the same release started from another image: a copy of the release with its image changed (the
    # IMAGE setting and the rendered docker run that names it)
    j.fleet.exec(worker, f"rm -rf /tmp/other && cp -r $(readlink -f {cur}) /tmp/other && "
                         "img=$(sed -n 's/^IMAGE=//p' /tmp/other/start.sh) && "
                         f"sed -i \"s|$img|{other}|g\" /tmp/other/start.sh && chown -R spark /tmp/other")
    assert j.fleet.ssh(worker, "/tmp/other/start.sh", timeout=120).returncode == 0
    assert j.fleet.ssh(head, f"{cur}/start.sh", timeout=180).returncode == 0
    try:
        report = _drift(j, worker, {"serving::rank_runs_the_release"})
        assert other[:19] in _msg(report, worker, "serving::rank_runs_the_release")
    finally:
        j.stop()
        j.fleet.exec(worker, "docker rmi other/demo:1 >/dev/null; rm -rf /tmp/other")
        j.start()
    _ok(*j.audit("--phase", "all"))


def test_the_head_stopped(up: Journey) -> None:
    j = up
    head = j.fleet.hosts[0]
    assert j.fleet.ssh(head, f"{PATHS['bundles']}/current/stop.sh").returncode == 0
    try:
        rc, report = j.audit("--phase", "all")
        got = failing(report)
        assert rc == 1 and {h for h, _ in got} == {head.name}, got
        assert {c for _, c in got if not c.startswith("gates::")} <= {
            "serving::health", "serving::models_lists_served_name", "serving::one_token_completion",
            "serving::rank_runs_the_release",
        }  # (and the gates, which a stopped head cannot answer)
        assert {"serving::health", "serving::rank_runs_the_release"} <= {c for _, c in got}
        assert "no container" in _msg(report, head, "serving::rank_runs_the_release")
        # another program on the lane's port: the head is not ready to serve
        j.fleet.exec(head, "cd /tmp && (setsid python3 -m http.server 8080 >/dev/null 2>&1 & echo $! > /tmp/squat.pid)")
        j.fleet.exec(head, "for i in $(seq 50); do ss -Hltn | grep -q ':8080 ' && exit 0; sleep 0.1; done; exit 1")
        try:
            rc, report = j.audit("--phase", "preflight")
            assert rc == 1 and failing(report) == {(head.name, "runtime::api_port_free")}, failing(report)
            assert "no container" in _msg(report, head, "runtime::api_port_free")
        finally:
            j.fleet.exec(head, "kill $(cat /tmp/squat.pid)")
    finally:
        assert j.fleet.ssh(head, f"{PATHS['bundles']}/current/start.sh", timeout=180).returncode == 0
    _ok(*j.audit("--phase", "all"))


def test_sshd_stopped_on_one_host(up: Journey) -> None:
    j = up
    head, worker = j.fleet.hosts
    j.fleet.stop_sshd(worker)
    try:
        rc, report = j.audit("--phase", "all", "--connect-timeout", "3")
        assert rc == 3
        assert report["hosts"][worker.name]["status"] == "unreachable"
        assert report["hosts"][head.name]["status"] == "pass", report["hosts"][head.name]
    finally:
        j.fleet.start_sshd(worker)
    _ok(*j.audit("--phase", "all"))


# --------------------------------------------------------------------------- three ranks


def test_three_host_tp3_lane_each_host_gets_and_is_audited_for_its_own_rank(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    with journey(tmp_path_factory.mktemp("journey3"), 3, lane="demo-tp3", name="journey3") as j3:
        for rank, h in enumerate(j3.fleet.hosts):
            names = j3.fleet.exec(h, f"ls {PATHS['engram']}/demo-engram-tp3").stdout.split()
            assert names == [f"engram-l1-r{rank}of3.bin"], (h.name, names)
        j3.start()
        _ok(*j3.audit("--phase", "all", "--mode", "full"))
        # rank 2's file on rank 1: rank 1 fails, naming the other rank's file; nobody else does
        r1 = j3.fleet.hosts[1]
        j3.fleet.exec(r1, f"cp {PATHS['engram']}/demo-engram-tp3/engram-l1-r1of3.bin "
                          f"{PATHS['engram']}/demo-engram-tp3/engram-l1-r2of3.bin")
        rc, report = j3.audit("--phase", "all")
        got = failing(report)
        assert rc == 1 and {h for h, _ in got} == {r1.name}, got
        assert "engram-l1-r2of3.bin" in _msg(report, r1, "engram::no_other_rank_files")
