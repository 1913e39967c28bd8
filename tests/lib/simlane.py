"""A seed lane on the simulator engine, in a copy of the project: the two substitutions that let the
test hosts (no GPU, amd64) run it, made in the copy's pins.toml.

- the lane's image is built from `images/sim` (the simulator engine: the seed engines' command lines,
  required variables, refusals and rendezvous direction) instead of its GB10 recipe;
- its models (and kit, and runtime files whose bytes nobody has published) are small snapshots with
  the same file names, in local folders instead of the Hub.

One judgement is left out: the speed floor and tolerance of the lanes' gates (the simulator's tok/s is
not an engine's); the speed is still measured and recorded. Everything else is the shipped lane: what
each rank runs, its env, mounts, start order, readiness and derivations. tests/test_seed_fleet.py runs
every seed lane so; `python3 -m tests.fleet.local up --simulate` gives an operator one.
"""

from __future__ import annotations

import fnmatch
import hashlib
import json
from pathlib import Path
from typing import Any

from builder.inputs.pins import expand_lanes
from tests.lib import factory

SIM_IMAGE = factory.image("images/sim", sources=["sim-engine"], toolchains=["zig-wheel"], platform="linux/amd64",
                          build_args={"ZIG_TARGET": "x86_64-linux-musl"})


def snapshot(folder: Path, names: list[str], seed: str) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    for n in names:
        (folder / n).parent.mkdir(parents=True, exist_ok=True)
        data = hashlib.sha256(f"{seed}/{n}".encode()).digest() * 64
        if n.endswith(".json"):
            data = json.dumps({"name": n, "seed": seed}).encode() + b"\n"
        (folder / n).write_bytes(data)


def model_files(include: list[str]) -> list[str]:
    """Small stand-ins with the same names as the real repo's (the pins' include globs)."""
    names = ["config.json", "tokenizer.json", "model.safetensors.index.json", "tokenizer_config.json",
             "model-00001-of-00048.safetensors", "model-00047-of-00048.safetensors",
             "model-00048-of-00048.safetensors"]
    if not include:
        return ["config.json", "tokenizer.json", "model-00001-of-00002.safetensors",
                "model-00002-of-00002.safetensors"]
    return [n for n in names if any(fnmatch.fnmatch(n, g) for g in include)]


def substitute(root: Path, lane: str, image: str, work: Path) -> None:
    """The two substitutions (see the module), in the copy's pins.toml."""
    doc = factory.read_pins(root)
    spec = expand_lanes(doc, root / "pins.toml")["lanes"][lane]  # (a lane based_on another: its whole table)
    doc["images"][image] = SIM_IMAGE
    for m in spec["models"]:
        model = doc["models"][m]
        folder = work / "snapshots" / m
        snapshot(folder, model_files(model.get("include", [])), m)
        doc["models"][m] = factory.model(model["repo"], hashlib.sha1(m.encode()).hexdigest(), local=str(folder),
                                         **{k: model[k] for k in ("role", "include") if k in model})
    mounted = [m["source"].split(":", 1)[1] for m in
               [*spec.get("mounts", []), *(x for r in spec.get("roles", {}).values() for x in r.get("mounts", []))]
               if m["source"].startswith("input:")]
    for name in mounted:
        if name in doc.get("kits", {}):
            folder = work / "kits" / name
            files = ["aot/aot.json", "cubins/experts.cubin", "engram.json", "vision/gate_bias_vl.safetensors"]
            snapshot(folder, files, name)
            lines = [f"{hashlib.sha256((folder / f).read_bytes()).hexdigest()} {(folder / f).stat().st_size} git - {f}"
                     for f in files]
            (folder / "MANIFEST").write_text("# simulator kit\n" + "\n".join(lines) + "\n")
            doc["kits"][name] = {"local": str(folder), "manifest": "MANIFEST"}
        elif doc["files"][name]["sha256"] == "UNKNOWN":
            f = work / "files" / name / Path(doc["files"][name]["url"]).name
            if f.name == "UNKNOWN":
                f = f.with_name("chat_template.jinja")
            f.parent.mkdir(parents=True, exist_ok=True)
            f.write_text(f"# stand-in for {name}\n")
            doc["files"][name] = {"url": f.as_uri(), "sha256": hashlib.sha256(f.read_bytes()).hexdigest()}
    # the simulator's tok/s is not an engine's (it answers in one piece, at the speed of a shared test
    # machine): its speed is measured and recorded, never judged against the seed lanes' floors
    for spec_ in doc["lanes"].values():
        speed = spec_.get("gates", {}).get("speed")
        if speed:
            speed.pop("floor", None)
            speed.pop("tolerance", None)
    factory.write_pins(root, doc)


def set_serve_keys(root: Path, lane: str, values: dict[str, Any]) -> None:
    doc = factory.read_pins(root)
    doc["lanes"][lane]["serve"].update(values)
    factory.write_pins(root, doc)
