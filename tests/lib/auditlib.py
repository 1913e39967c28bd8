"""Helpers for the audit tests: a FAKE nvidia-smi replaying a real H200 capture, and small projects.

The fake is tests/lib/fake_nvidia_smi.py, a standalone script that prints, verbatim, what a real
nvidia-smi printed on an H200 (tests/data/nvidia-smi/h200-nvidia-smi-probe.txt, copied from the shared
reference captures, given to it as capture.json in its state folder); the script says what it knows
and how drift is injected.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

from builder import gpu as G
from tests.lib import factory

CAPTURE = Path(__file__).resolve().parents[1] / "data" / "nvidia-smi" / "h200-nvidia-smi-probe.txt"
#: the H200 at rest and under the burn's matmul, 2026-12-04 (tests/data/gpu-states/README.md)
STATES = Path(__file__).resolve().parents[1] / "data" / "gpu-states" / "h200-2026-12-04"


def busy_sample() -> str:
    """One sample of the H200 under the fp16 matmul (the burn's sample at t = 10 s)."""
    facts = json.loads((STATES / "burn-facts.json").read_text())
    return next(s["out"] for s in facts["samples"] if s["t"] >= 10)


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


#: the FAKE nvidia-smi, a standalone script installed as `nvidia-smi`
FAKE = Path(__file__).resolve().parent / "fake_nvidia_smi.py"


def capture_json() -> str:
    """The fake's capture.json: the H200 capture's `csv` reply and --version, and the field list it
    answers (builder's own, builder.gpu.QUERY_FIELDS); the burn's sample fields and the H200's
    replies to them at rest and under load."""
    from builder.gpu.burn import SAMPLE_FIELDS

    s = capture_sections()
    return json.dumps({"query_fields": ",".join(G.QUERY_FIELDS), "query": s["query csv header"],
                       "version": s["nvidia-smi --version"], "sample_fields": ",".join(SAMPLE_FIELDS),
                       "sample": (STATES / "idle-sample.txt").read_text(), "sample_busy": busy_sample()},
                      indent=1) + "\n"


def install_fake(bin_dir: Path, state_dir: Path) -> Path:
    """The fake as bin_dir/nvidia-smi with its capture in `state_dir` (run it with FAKE_NVSMI_DIR set
    to that folder)."""
    bin_dir.mkdir(parents=True, exist_ok=True)
    state_dir.mkdir(parents=True, exist_ok=True)
    (state_dir / "capture.json").write_text(capture_json())
    p = bin_dir / "nvidia-smi"
    p.write_bytes(FAKE.read_bytes())
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
    """The fake as /usr/local/bin/nvidia-smi on a test fleet host (tests.lib.fleetlib), its capture in
    /etc/fake-nvidia-smi, the state folder it reads by default."""
    # (1777: the FAKE GPU load marks the GPU busy there as whichever user runs the burn)
    fleet.exec(h, ["sh", "-c", "mkdir -p /etc/fake-nvidia-smi && chmod 1777 /etc/fake-nvidia-smi && "
                   "cat > /etc/fake-nvidia-smi/capture.json"], input=capture_json())
    fleet.exec(h, ["sh", "-c", "cat > /usr/local/bin/nvidia-smi && chmod 755 /usr/local/bin/nvidia-smi"],
               input=FAKE.read_text())


def install_ssh_logger(bin_dir: Path, log: Path) -> None:
    """tests/lib/ssh_logger.py as bin_dir/ssh (put bin_dir first on PATH): each ssh call's arguments are
    appended to `log`, then the real ssh (the one on PATH now) runs."""
    real = shutil.which("ssh")
    assert real is not None, "no ssh on PATH"
    bin_dir.mkdir(parents=True, exist_ok=True)
    (bin_dir / "ssh-logger.json").write_text(json.dumps({"log": str(log), "ssh": real}))
    (bin_dir / "ssh").write_bytes((Path(__file__).resolve().parent / "ssh_logger.py").read_bytes())
    (bin_dir / "ssh").chmod(0o755)


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
                       files=model_files if model_files is not None else MODEL_FILES,
                       platform="linux/arm64", builder="test")
    return out


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
    return factory.host("me", 0, ssh="localhost", connection="local",
                        paths={"models": str(base / "m"), "engram": str(base / "e"), "bundles": str(base / "b")})
