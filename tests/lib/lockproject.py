"""A small project for the lock tests, written through tests.lib.factory: a real upstream git repo
with a patch against it, a Zig toolchain pin, a plain file, a local model, a recipe and a lane; and the
real CLI run on it."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

from tests.lib import factory
from tests.lib.gitlib import Upstream
from tests.lib.shipped import Result, builder

TINY_COMMIT = "0123456789abcdef0123456789abcdef01234567"
ZIG_SHA = "a" * 64


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


class Project:
    """A tmp project: pins.toml, a patch, a recipe, a plain file, a local model, an upstream repo."""

    def __init__(self, tmp: Path, *, rev: bool = False) -> None:
        self.tmp = tmp
        self.root = tmp / "proj"
        self.pins = self.root / "pins.toml"
        self.lock = self.root / "pins.lock"
        self.up = Upstream(tmp)
        self.c1 = self.up.commit({"README": "engine\n", "src/main.zig": "pub fn main() void {}\n"})
        self.up.push()
        r = self.root
        (r / "patches").mkdir(parents=True)
        (r / "patches" / "0001-fix.patch").write_text("--- a/README\n+++ b/README\n")
        (r / "images" / "demo").mkdir(parents=True)
        (r / "images" / "demo" / "Dockerfile").write_text("FROM scratch\n")
        (r / "files").mkdir()
        self.template = b"{{ messages }}\n"
        (r / "files" / "chat.jinja").write_bytes(self.template)
        m = r / "models" / "tiny"
        m.mkdir(parents=True)
        for i in (1, 2):
            (m / f"model-0000{i}-of-00002.safetensors").write_bytes(bytes([i]) * 1000)
        (m / "config.json").write_text('{"hidden": 8}\n')
        self.rev = self.c1 if rev else None
        self.write_pins()

    def doc(self, *, patch_reason: str = "fix the readme", **extra: dict[str, Any]) -> dict[str, Any]:
        """The project's pins; `extra`: more entries, section -> name -> entry."""
        engine: dict[str, Any] = {"url": self.up.url, "ref": "main"}
        if self.rev:
            engine["rev"] = self.rev
        engine["patches"] = [{"file": "patches/0001-fix.patch", "reason": patch_reason}]
        zig = {"kind": "zig", "version": "0.13.0", "platforms": {"linux/arm64": {
            "url": "https://ziglang.org/download/0.13.0/zig-linux-aarch64-0.13.0.tar.xz", "sha256": ZIG_SHA}}}
        doc = factory.pins(
            sources={"engine": engine},
            toolchains={"zig": zig},
            files={"template": {"url": "files/chat.jinja", "sha256": sha(self.template)}},
            models={"tiny": factory.model("org/tiny", TINY_COMMIT, local="models/tiny")},
            images={"demo": factory.image("images/demo", sources=["engine"], toolchains=["zig"], files=["template"])},
            lanes={"demo": factory.lane("demo", ["tiny"], serve={
                "tensor_parallel": 1, "context": 4096, "streams": 1, "port": 8000, "served_name": "tiny"})},
        )
        for section, entries in extra.items():
            doc.setdefault(section, {}).update(entries)
        return doc

    def write_pins(self, **kw: Any) -> None:
        factory.write_pins(self.root, self.doc(**kw))

    def run(self, *args: str) -> Result:
        return builder(self.root, *args, timeout=300)
