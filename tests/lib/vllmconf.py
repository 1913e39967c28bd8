"""The vLLM release the conformance tier checks the vLLM lanes against, installed once into a cached
venv outside the clone, and the runner that feeds it the ranks (tests/lib/vllm_conformance.py).

The release: 0.30.0 (2026-09-22), the first release after the lanes' pinned tree (dsv41-feat at
e47aa780, 2026-09-10, merged as vllm-project/vllm#56214 on 2026-09-11): the first with DeepSeek V4.1
(``vllm/models/deepseek_v41``, ``EngramConfig``, the ``dspark`` method, the ``deepseek_v41`` parsers);
0.29.0 (2026-09-09) has none of them. The release's package has that model code under
``vllm/models/deepseek_v41/``; the boot-10 mount targets use ``models/deepseek_v4_1/``, as the e47aa780
tree does (recipes.md §10.6, reference/data/tonyd2wild__patch-exl3-tp3-mounts.txt): the targets follow
the pinned tree, not the release.

The venv: ``$BUILDER_VLLM_CACHE`` (default /var/cache/builder-vllm) ``/<release>``, made when missing
or when its stamp (the release and the requirements below) differs, reused otherwise; built in a
sibling folder and renamed into place, so a half-made venv is never used. vLLM is installed without
its dependencies, then its own requirements (as its METADATA states them) less `LEFT_OUT`: the GPU
kernels, their compilers and the media decoders, which nothing here loads. Cold, on this machine
(2026-12-04, 2 cores shared): 268 s and 6.2 GB (torch's CUDA wheels are most of it); warm: a stamp
check. `python3 -m tests.lib.vllmconf` makes it (.ci/run does).
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

VLLM_RELEASE = "0.30.0"
#: vLLM's own requirements (its METADATA) that are left out: GPU kernels and their compilers, video
#: and audio decoders. None is imported by its parser, its configuration or its model registry; torch
#: is installed, with its own CUDA wheels (it does not import without them).
LEFT_OUT = (
    "torchaudio", "torchvision", "torchcodec", "flashinfer-python", "apache-tvm-ffi", "tilelang",
    "nvidia-cudnn-frontend", "nvtx", "fastsafetensors", "instanttensor", "nvidia-cutlass-dsl", "quack-kernels",
    "tokenspeed-mla", "humming-kernels", "pynvvideocodec", "numba",
)
#: prints vLLM's requirements less LEFT_OUT, as its METADATA states them (versions and markers kept)
_REQS = """
import importlib.metadata as md, re, sys
skip = set(sys.argv[1:])
for r in md.requires("vllm") or []:
    name = re.split(r"[<>=!;\\[ ]", r, maxsplit=1)[0].strip().lower().replace("_", "-")
    if "extra ==" not in r and name not in skip:
        print(r)
"""
HERE = Path(__file__).resolve().parent
CHECKER = HERE / "vllm_conformance.py"


def cache_root() -> Path:
    return Path(os.environ.get("BUILDER_VLLM_CACHE", "/var/cache/builder-vllm"))


def venv_dir() -> Path:
    return cache_root() / VLLM_RELEASE


def stamp() -> str:
    text = json.dumps({"vllm": VLLM_RELEASE, "left_out": list(LEFT_OUT), "python": sys.version_info[:2]})
    return hashlib.sha256(text.encode()).hexdigest()


def python() -> Path:
    return venv_dir() / "bin" / "python"


def ready() -> bool:
    s = venv_dir() / "builder-stamp"
    return python().exists() and s.exists() and s.read_text().strip() == stamp()


def quiet(log: Any, argv: list[str]) -> None:
    """Run pip; its output only when it fails (pip warns that the left-out requirements are missing)."""
    p = subprocess.run(argv, capture_output=True, text=True)
    if p.returncode != 0:
        print(p.stdout[-4000:] + p.stderr[-4000:], file=log, flush=True)
        raise RuntimeError(f"{' '.join(argv[:6])} ...: exit {p.returncode}")


def ensure_venv(log: Any = sys.stderr) -> Path:
    """The cached venv's python, made first if missing or stale."""
    if ready():
        return python()
    root, final = cache_root(), venv_dir()
    root.mkdir(parents=True, exist_ok=True)
    with open(root / f".{VLLM_RELEASE}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # (two test workers: one installs, the other waits and reuses)
        if ready():
            return python()
        return _install(root, final, log)


def _install(root: Path, final: Path, log: Any) -> Path:
    # (a venv works from another folder when run as bin/python -m ...: it is made aside, then renamed)
    work = Path(tempfile.mkdtemp(prefix=f".{VLLM_RELEASE}-", dir=root))
    t0 = time.monotonic()
    pip = [str(work / "bin" / "python"), "-m", "pip", "install", "-q", "--disable-pip-version-check"]
    print(f"vllm {VLLM_RELEASE}: installing into {final} (once; reused while its stamp holds)", file=log, flush=True)
    try:
        subprocess.run([sys.executable, "-m", "venv", str(work)], check=True)
        quiet(log, [*pip, "--no-deps", f"vllm=={VLLM_RELEASE}"])
        reqs = subprocess.run([str(work / "bin" / "python"), "-c", _REQS, *LEFT_OUT], check=True,
                              capture_output=True, text=True).stdout.split("\n")
        quiet(log, [*pip, *(r for r in reqs if r.strip())])
        (work / "builder-stamp").write_text(stamp() + "\n")
        if final.exists():
            shutil.rmtree(final)
        work.rename(final)
    except BaseException:
        shutil.rmtree(work, ignore_errors=True)
        raise
    print(f"vllm {VLLM_RELEASE}: ready in {time.monotonic() - t0:.0f} s", file=log, flush=True)
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
    print(ensure_venv())
