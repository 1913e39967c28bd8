"""Helpers for the audit tests: a FAKE nvidia-smi replaying a real H200 capture, and small projects.

The fake is a python3 script that prints, verbatim, what a real nvidia-smi printed on an H200
(tests/data/nvidia-smi/h200-nvidia-smi-probe.txt, copied from the shared reference captures).
It is a fake: it knows three invocations (the full --query-gpu field list, --version and
--query-compute-apps) and answers anything else like an old driver would ("not a valid field",
exit 2). Drift is injected through files in its state folder (default /etc/fake-nvidia-smi):
`query` replaces the --query-gpu output, `apps` is the --query-compute-apps output.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from builder import gpu as G
from tests.lib import factory

CAPTURE = Path(__file__).resolve().parents[1] / "data" / "nvidia-smi" / "h200-nvidia-smi-probe.txt"


def capture_sections(path: Path = CAPTURE) -> dict[str, str]:
    out: dict[str, list[str]] = {}
    cur = None
    for line in path.read_text().splitlines():
        if line.startswith("== "):
            cur = line[3:].strip()
            out[cur] = []
        elif cur is not None:
            out[cur].append(line)
    return {k: "\n".join(v).strip("\n") + "\n" for k, v in out.items()}


def fake_nvidia_smi(state_dir: str = "/etc/fake-nvidia-smi") -> str:
    """The FAKE nvidia-smi script text (python3), replaying the H200 capture."""
    s = capture_sections()
    query = s["query csv header"]  # header + one row, with units: as real nvidia-smi prints `csv`
    version = s["nvidia-smi --version"]
    return f"""#!/usr/bin/env python3
# FAKE nvidia-smi (builder tests): replays output captured on a real NVIDIA H200, driver 580.159.04.
import os, sys
STATE = os.environ.get("FAKE_NVSMI_DIR", {state_dir!r})
QUERY_FIELDS = {json.dumps(",".join(G.QUERY_FIELDS))}
QUERY = {query!r}
VERSION = {version!r}
def state(name, default):
    p = os.path.join(STATE, name)
    return open(p).read() if os.path.exists(p) else default
args = sys.argv[1:]
q = [a for a in args if a.startswith("--query-gpu=")]
if q:
    fields = q[0].split("=", 1)[1]
    if fields != QUERY_FIELDS:
        bad = [f for f in fields.split(",") if f not in QUERY_FIELDS.split(",")]
        print('Field "%s" is not a valid field to query.' % (bad[0] if bad else fields))
        sys.exit(2)
    sys.stdout.write(state("query", QUERY))
elif "--version" in args:
    sys.stdout.write(VERSION)
elif any(a.startswith("--query-compute-apps=") for a in args):
    sys.stdout.write(state("apps", ""))
else:
    print('Field "%s" is not a valid field to query.' % " ".join(args))
    sys.exit(2)
"""


def install_fake(bin_dir: Path, state_dir: Path) -> Path:
    bin_dir.mkdir(parents=True, exist_ok=True)
    state_dir.mkdir(parents=True, exist_ok=True)
    p = bin_dir / "nvidia-smi"
    p.write_text(fake_nvidia_smi(str(state_dir)))
    p.chmod(0o755)
    return p


#: what a test host with the FAKE nvidia-smi is expected to be: the capture's H200, no RDMA, little
#: free memory and disk (`install_fake_on` puts the fake on a fleet host)
H200_EXPECT: dict[str, Any] = {
    "gpu_name": "NVIDIA H200", "gpu_count": 1, "compute_cap": "9.0", "driver_version": "580.159.04",
    "cuda_version": "13.0", "gpu_clock_mhz": 1980, "min_free_memory_gib": 0.05, "max_swap_used_gib": 1024,
    "min_free_disk_gib": 0.01, "nvidia_runtime": False, "rdma": False,
}


def install_fake_on(fleet: Any, h: Any) -> None:
    """The FAKE nvidia-smi as /usr/local/bin/nvidia-smi on a test fleet host (tests.lib.fleetlib)."""
    fleet.exec(
        h,
        ["sh", "-c", "mkdir -p /etc/fake-nvidia-smi && cat > /usr/local/bin/nvidia-smi && "
         "chmod 755 /usr/local/bin/nvidia-smi"],
        input=fake_nvidia_smi(),
    )


# ------------------------------------------------------------------ small projects

def pins_doc(tp: int, port: int) -> dict[str, Any]:
    """The tiny project's pins: one model, the demo recipe and a lane over both."""
    return factory.pins(
        models={"tiny": factory.model("test/tiny", expect_files=3)},
        images={"demo": factory.image("images/demo")},
        lanes={"demo": factory.lane("demo", ["tiny"], serve={
            "tensor_parallel": tp, "context": 1024, "streams": 1, "port": port, "served_name": "demo-model"})},
    )

#: the tiny model every test host gets (path -> bytes)
MODEL_FILES: dict[str, bytes] = {
    "config.json": b'{"model_type": "tiny"}\n',
    "model-00001-of-00002.safetensors": bytes(range(256)) * 64,
    "model-00002-of-00002.safetensors": b"\x07" * 20000,
}


def make_project(
    root: Path,
    *,
    tp: int = 2,
    port: int = 18091,
    lock: bool = True,
    model_files: dict[str, bytes] | None = None,
) -> dict[str, Path]:
    """pins.toml, images/demo/, and (with lock) a pins.lock built from the real lock models."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "images" / "demo").mkdir(parents=True, exist_ok=True)
    (root / "images" / "demo" / "Dockerfile").write_text("FROM scratch\n")
    pins_path = factory.write_pins(root, pins_doc(tp, port))
    (root / "hosts").mkdir(exist_ok=True)
    out = {
        "pins": pins_path,
        "lock": root / "pins.lock",
        "store": root / ".cache" / "builder",
        "hosts": root / "hosts",
    }
    if not lock:
        return out
    factory.write_lock(root, image="demo", model="tiny", lane="demo",
                     files=model_files if model_files is not None else MODEL_FILES, repo="test/tiny",
                     platform="linux/arm64", builder="test")
    return out


def plan_address(paths: dict[str, Path]) -> str:
    from builder.lockfile import load_lock
    from builder.pins import load_pins
    from builder.plan import make_plan

    return make_plan(load_pins(paths["pins"]), load_lock(paths["lock"]), "demo", paths["pins"].parent).address


def fleet_toml(
    name: str,
    hosts: list[dict[str, Any]],
    *,
    ssh_config: str | None = None,
    lane: str = "demo",
    expect: dict[str, Any] | None = None,
) -> str:
    """A fleet file; each host dict has name, ssh, rank, role and optional connection and paths; every
    host gets `expect`."""
    rows = [factory.host(h["name"], h["rank"], ssh=h["ssh"], role=h["role"], connection=h.get("connection"),
                         paths=h.get("paths"), expect=dict(expect or {})) for h in hosts]
    return factory.toml(factory.fleet(name, lane, rows, ssh_config=ssh_config))


def local_host(base: Path) -> dict[str, Any]:
    """One head audited on this machine (testinfra's local backend), its folders under `base`."""
    return {
        "name": "me",
        "ssh": "localhost",
        "connection": "local",
        "rank": 0,
        "role": "head",
        "paths": {"models": str(base / "m"), "engram": str(base / "e"), "bundles": str(base / "b")},
    }
