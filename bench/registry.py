"""(j) Images to many hosts: what an update that changes only the top layer sends, and a push of what the
registry holds already.

Data: a copy of the project whose demo image is two layers (a payload an engine change leaves alone,
then the engine), built by `builder image`, then built again with another ENGINE_VERSION (only the
engine layer changes). The registry is Debian's docker-registry (the CNCF distribution registry), with
its access log on: the bytes it served are read from its own log.

- **registry path**: one test host (tests/lib/fleetlib.py: its own dockerd) holds the first image; the
  second is pushed (`builder push`) and the host pulls it by digest (`docker pull`, what the installer
  runs), from a registry on the fleet's network with TLS from a CA made here. Bytes the registry
  served to the host, against the changed layers (target <= 1.1x); the full archive a bundle would
  carry is the standard.
- **thin bundle**: `builder bundle --with-image --thin --have FILE` (FILE: the first image's DiffIDs,
  as an apply record gives them); the archive's bytes, against the changed layers (target <= 1.1x).
- **push of an image the registry holds**: `builder push` (HEAD of the manifest, read back and checked)
  against `docker push` of the same image into the same loopback registry, each after a first push
  of its own (wall time, medians of interleaved runs; target <= 1x). Bytes each sent are in the note;
  so is the floor of any Python CLI here (python3 starting, `builder --version`), timed in the same rounds.
"""

from __future__ import annotations

import ipaddress
import json
import secrets
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bench.common import Config, Row, judge, skipped, wheelhouse
from tests.lib import fleetlib, projectlib, registrylib

NAME = "registry"
FIG_REG = "top-layer update via the registry: bytes to a host / changed layers"
FIG_THIN = "top-layer update by thin bundle: archive bytes / changed layers"
FIG_PUSH = "builder push vs docker push, image already in the registry (wall time)"
FIG_PUSH_SENT = "builder push vs docker push, image already in the registry (writes to the registry)"


def _helpers() -> tuple[Any, Any, Any]:
    return fleetlib, projectlib, registrylib


def run(cfg: Config) -> list[Row]:
    try:
        fleetlib, projectlib, registrylib = _helpers()
    except ImportError as e:
        return [skipped(NAME, f, f"test helpers: {e}") for f in (FIG_REG, FIG_THIN, FIG_PUSH_SENT, FIG_PUSH)]
    if shutil.which("docker-registry") is None:
        return [skipped(NAME, f, "docker-registry not installed") for f in (FIG_REG, FIG_THIN, FIG_PUSH_SENT, FIG_PUSH)]
    if not fleetlib.docker_available():
        return [skipped(NAME, f, "Docker engine not reachable") for f in (FIG_REG, FIG_THIN, FIG_PUSH_SENT, FIG_PUSH)]
    if not fleetlib.image_exists(fleetlib.testhost_tag()):
        why = f"{fleetlib.testhost_tag()} missing: run tests/fleet/build-testhost.sh"
        return [skipped(NAME, f, why) for f in (FIG_REG, FIG_THIN, FIG_PUSH_SENT, FIG_PUSH)]
    wheels, why = wheelhouse("demo", cfg.workdir)
    if wheels is None:
        return [skipped(NAME, f, why) for f in (FIG_REG, FIG_THIN, FIG_PUSH_SENT, FIG_PUSH)]
    work = cfg.workdir / "registry"
    payload = secrets.token_bytes((8 if cfg.quick else 32) * 1024 * 1024)
    root = projectlib.two_layer_project(work / "project", payload)
    env = projectlib.env_for(work)
    env["BUILDER_WHEELHOUSE"] = str(wheels)

    def builder(*args: str) -> subprocess.CompletedProcess[str]:
        out: subprocess.CompletedProcess[str] = projectlib.run_builder(root, env, *args)
        return out

    made: list[str] = []
    fleet = fleetlib.start_fleet(1, work / "fleet")
    try:
        h = fleet.hosts[0]
        gateway = str(next(ipaddress.ip_network(fleet.subnet).hosts()))
        with registrylib.start_registry(work / "reg-tls", ip=gateway, tls=True) as reg:
            fleet.exec(h, f"mkdir -p /etc/docker/certs.d/{reg.addr}")
            fleetlib.docker("cp", str(reg.ca), f"{h.container_name}:/etc/docker/certs.d/{reg.addr}/ca.crt")
            push = ("push", "demo", "--registry", reg.url, "--ca", str(reg.ca), "--json")
            # the host runs the first image, pulled from the registry as a first install would
            builder("lock", "--offline", "demo")
            builder("fetch", "demo", "--offline")
            old = json.loads(builder("image", "demo", "--offline", "--json").stdout)
            made.append(old["image_id"])
            fleet.exec(h, f"docker pull -q {json.loads(builder(*push).stdout)['reference']}", timeout=600)
            # the update: only the engine layer changes
            projectlib.engine_change(root, "0.2.0")
            builder("lock", "--offline", "demo")
            new = json.loads(builder("image", "demo", "--offline", "--json").stdout)
            made.append(new["image_id"])
            ref = json.loads(builder(*push).stdout)["reference"]
            mark = len(reg.requests())
            fleet.exec(h, f"docker pull -q {ref}", timeout=600)
            got = fleet.exec(h, f"docker image inspect --format '{{{{.Id}}}}' {ref}").stdout.strip()
            if got != new["image_id"]:
                raise RuntimeError(f"the host pulled {got}, not {new['image_id']}")
            served = reg.blob_bytes_served(mark)
        fleet.teardown()
        changed = sum(s for i, s in enumerate(new["layer_sizes"])
                      if i >= len(old["diff_ids"]) or old["diff_ids"][i] != new["diff_ids"][i])
        thin = _thin(root, work, builder, old, changed)
        full = thin.values["full_bytes"]
        ratio = served / changed
        rows = [Row(bench=NAME, figure=FIG_REG, builder=f"{served} B", standard=f"full archive {full} B",
                    ratio=ratio, target="<= 1.1", status=judge(ratio, "<= 1.1"),
                    note=f"changed layers {changed} B; what the registry's access log says it served: the "
                         "engine layer and the config",
                    values={"served_bytes": served, "changed_bytes": changed, "full_bytes": full}), thin]
        rows.extend(_push(cfg, projectlib, registrylib, work, builder, new))
    finally:
        fleet.teardown()
        for image_id in made:
            subprocess.run(["docker", "rmi", "--force", image_id], capture_output=True)
    return rows


def _thin(root: Path, work: Path, builder: Any, old: dict[str, Any], changed: int) -> Row:
    keys = work / "keys"
    builder("keygen", "--out", str(keys))
    paths = f'{{ models = "{work}/srv/models", engram = "{work}/srv/engram", bundles = "{work}/var" }}'
    text = f'[fleet]\nname = "bench"\nlane = "demo"\ntrusted_key = "{keys / "builder.pub"}"\n'
    for rank, name in enumerate(("b-1", "b-2")):
        text += (f'\n[[hosts]]\nname = "{name}"\nssh = "{name}"\naddress = "192.0.2.{rank + 10}"\nrank = {rank}\n'
                 f'role = "{"head" if rank == 0 else "worker"}"\npaths = {paths}\n')
    (root / "hosts" / "bench.toml").write_text(text)
    have = work / "applied.json"
    have.write_text(json.dumps({"image": {"diff_ids": old["diff_ids"]}}))
    key = str(keys / "builder.key")
    builder("bundle", "bench/b-1", "--with-image", "--key", key, "--out", str(work / "full"))
    builder("bundle", "bench/b-1", "--with-image", "--thin", "--have", str(have), "--key", key,
            "--out", str(work / "thin"))

    def archive(d: Path) -> int:
        m = json.loads((d / "manifest.json").read_text())
        return int(next(f["size"] for f in m["files"] if f["path"] == "image.tar"))

    full, thin = archive(work / "full"), archive(work / "thin")
    ratio = thin / changed
    return Row(bench=NAME, figure=FIG_THIN, builder=f"{thin} B", standard=f"full archive {full} B",
               ratio=ratio, target="<= 1.1", status=judge(ratio, "<= 1.1"),
               note=f"changed layers {changed} B; the thin archive holds the changed layer, the config and "
                    "the tar headers",
               values={"thin_bytes": thin, "full_bytes": full, "changed_bytes": changed})


def _push(cfg: Config, projectlib: Any, registrylib: Any, work: Path, builder: Any, new: dict[str, Any]) -> list[Row]:
    with registrylib.start_registry(work / "reg-open") as reg:
        builder("push", "demo", "--registry", reg.url)  # the first push, not timed
        ref = f"{reg.addr}/docker-push/demo:bench"
        subprocess.run(["docker", "tag", new["image_id"], ref], check=True, capture_output=True)
        argv = {"builder": ["push", "demo", "--registry", reg.url], "docker": ["docker", "push", ref]}
        # the floor of any builder command: its interpreter starting, then the CLI loading (`--version`)
        python = shutil.which("python3", path=str(Path(projectlib.journeylib.BUILDER).parent)) or sys.executable
        floor = {"python": [python, "-c", "pass"], "version": [projectlib.journeylib.BUILDER, "--version"]}
        times: dict[str, list[float]] = {"builder": [], "docker": [], "python": [], "version": []}
        writes: dict[str, list[int]] = {"builder": [], "docker": []}
        asked: dict[str, list[int]] = {"builder": [], "docker": []}
        try:
            subprocess.run(argv["docker"], check=True, capture_output=True, timeout=600)
            for i in range(cfg.n() + 1):  # interleaved; the first round warms both up, untimed
                for which in ("python", "version"):
                    t = time.perf_counter()
                    subprocess.run(floor[which], check=True, capture_output=True, timeout=60)
                    if i:
                        times[which].append(time.perf_counter() - t)
                for which in ("builder", "docker"):
                    before = len(reg.requests())
                    t = time.perf_counter()
                    if which == "builder":
                        builder(*argv["builder"])
                    else:
                        subprocess.run(argv["docker"], check=True, capture_output=True, timeout=600)
                    took = time.perf_counter() - t
                    got = reg.requests()[before:]
                    if i:
                        times[which].append(took)
                    writes[which].append(sum(1 for q in got if q["method"] in ("PUT", "POST", "PATCH")))
                    asked[which].append(len(got))
        finally:
            subprocess.run(["docker", "rmi", ref], capture_output=True)
    med = {k: statistics.median(v) for k, v in times.items()}
    ratio = med["builder"] / med["docker"]
    w_b, w_d = max(writes["builder"]), max(writes["docker"])
    w_ratio = w_b / w_d if w_d else None
    return [
        Row(bench=NAME, figure=FIG_PUSH_SENT, builder=f"{w_b} writes", standard=f"docker push {w_d} writes",
            ratio=w_ratio, target="<= 1", status=judge(w_ratio, "<= 1"),
            note=f"requests per push: builder {max(asked['builder'])} (HEAD manifest, GET manifest and config to "
                 f"check them, HEAD tag), docker push {max(asked['docker'])} (its manifest PUT again)",
            values={"builder_writes": w_b, "docker_writes": w_d}),
        Row(bench=NAME, figure=FIG_PUSH, builder=f"{med['builder']:.2f} s",
            standard=f"docker push {med['docker']:.2f} s",
            ratio=ratio, target="<= 1", status=judge(ratio, "<= 1"),
            note=f"floor of a Python CLI: python3 starting {med['python']:.3f} s, `builder --version` "
                 f"{med['version']:.3f} s; the rest is the push's imports (the HTTP client, the image record's "
                 "models), the plan from pins and lock (their models and the staleness check) and four small requests",
            values={"builder_s": med["builder"], "docker_s": med["docker"], "python_start_s": med["python"],
                    "builder_version_s": med["version"]}),
    ]
