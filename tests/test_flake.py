"""The flake: it parses, its nixpkgs-free outputs evaluate offline, and it agrees with pyproject.toml.

Building the package or entering the dev shell needs nixpkgs, which this machine cannot
fetch; the README says so.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
NIX = shutil.which("nix-instantiate")
needs_nix = pytest.mark.skipif(NIX is None, reason="nix-instantiate not installed (Debian nix-bin)")

# nixpkgs attribute name -> PyPI name, where they differ
NIX_TO_PYPI = {"huggingface-hub": "huggingface_hub"}


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _pyproject_deps() -> tuple[set[str], set[str]]:
    data = tomllib.loads((ROOT / "pyproject.toml").read_text())
    dep = {_norm(re.split(r"[<>=!~ \[]", d)[0]) for d in data["project"]["dependencies"]}
    dev = {_norm(re.split(r"[<>=!~ \[]", d)[0]) for d in data["project"]["optional-dependencies"]["dev"]}
    return dep, dev


def _eval_lib() -> dict[str, object]:
    expr = ('let f = import ./flake.nix; o = f.outputs { self = o; nixpkgs = throw "no nixpkgs offline"; }; '
            "in o.lib")
    out = subprocess.run([NIX or "nix-instantiate", "--eval", "--strict", "--json", "-E", expr], cwd=ROOT,
                         capture_output=True, text=True, timeout=60, check=True)
    return dict(json.loads(out.stdout))


def test_flake_lock_pins_nixpkgs() -> None:
    lock = json.loads((ROOT / "flake.lock").read_text())
    assert lock["version"] == 7
    node = lock["nodes"]["nixpkgs"]["locked"]
    assert re.fullmatch(r"[0-9a-f]{40}", node["rev"])
    assert node["narHash"].startswith("sha256-")
    assert lock["nodes"]["root"]["inputs"] == {"nixpkgs": "nixpkgs"}


@needs_nix
def test_flake_parses() -> None:
    subprocess.run([NIX or "", "--parse", "flake.nix"], cwd=ROOT, capture_output=True, check=True, timeout=60)


@needs_nix
def test_flake_python_deps_match_pyproject() -> None:
    lib = _eval_lib()
    dep, dev = _pyproject_deps()
    nix_dep = {_norm(NIX_TO_PYPI.get(n, n)) for n in lib["pythonDeps"]}  # type: ignore[attr-defined]
    nix_dev = {_norm(NIX_TO_PYPI.get(n, n)) for n in lib["pythonDevDeps"]}  # type: ignore[attr-defined]
    assert nix_dep == dep, f"flake pythonDeps {sorted(nix_dep)} != pyproject dependencies {sorted(dep)}"
    # dev extras in the flake must be a subset of pyproject's dev extras (ruff comes from nixpkgs directly)
    assert nix_dev <= dev, f"flake pythonDevDeps {sorted(nix_dev - dev)} not in pyproject dev extras"


@needs_nix
def test_flake_version_matches_pyproject() -> None:
    lib = _eval_lib()
    data = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert lib["version"] == data["project"]["version"]
