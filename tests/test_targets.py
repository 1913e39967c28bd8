"""Mount targets that exist (builder.image.mounttargets): the paths a lane's mounts replace, stat'ed in a
real image by the Docker Engine, recorded, and a mount over a missing one refused by name."""

from __future__ import annotations

import io
import subprocess
import tarfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from builder.errors import ConfigError
from builder.foundation import dockerio
from builder.image import mounttargets as targets
from builder.image.imagerecord import ImageRecord
from builder.inputs.pins import load_pins

REPO = Path(__file__).resolve().parents[1]
PKG = "usr/local/lib/python3.12/dist-packages/vllm/"


def image_with(files: list[str], tag: str) -> str:
    """A real image holding exactly these files (docker import of a tar made here); its ImageID."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for f in files:
            info = tarfile.TarInfo(f)
            info.size = 3
            tar.addfile(info, io.BytesIO(b"x=1"))
    p = subprocess.run(["docker", "import", "-", tag], input=buf.getvalue(), capture_output=True, timeout=120)
    assert p.returncode == 0, p.stderr
    image_id = dockerio.image_id(tag)
    assert image_id is not None
    return image_id


@pytest.fixture
def tags(tmp_path: Path) -> Iterator[list[str]]:
    made: list[str] = []
    yield made
    for t in made:
        dockerio.remove(t, force=True)


def record(image_id: str) -> ImageRecord:
    # (the check reads only the name, the ImageID and the listing; the rest is a record's shape)
    return ImageRecord(name="vllm", input_address="0" * 64, image_id=image_id, diff_ids=[], tag="t",
                       lock_hash="0" * 64, platform="linux/amd64", source_date_epoch=0)


@pytest.mark.docker
def test_a_mount_over_a_missing_image_path_is_refused(tags: list[str]) -> None:
    pins = load_pins(REPO / "pins.toml")
    shipped = pins.lanes["vllm-native"].replaced_targets()
    assert len(shipped) == 7
    # an image whose vLLM tree has every replaced file but attention.py, which the tree holds elsewhere
    files = [t.lstrip("/") for t in shipped if not t.endswith("/attention.py")]
    files.append(PKG + "models/deepseek_v41/attention.py")
    tag = f"builder-test-targets:{id(tags)}"
    tags.append(tag)
    rec = targets.record_paths(pins, record(image_with(files, tag)))
    missing = "/" + PKG + "models/deepseek_v4_1/attention.py"
    assert rec.paths[missing] == "missing" and rec.paths["/" + PKG + "models/deepseek_v4_1"] == "dir"
    assert all(rec.paths[t] == "file" for t in shipped if t != missing)
    with pytest.raises(ConfigError) as e:
        targets.check(pins, "vllm-native", rec)
    msg = str(e.value)
    assert msg.startswith("lanes.vllm-native.mounts[5]: input:vllm-boot10-attention replaces " + missing)
    assert f"nearest existing path: /{PKG}models/deepseek_v4_1)" in msg and "\n" not in msg
    # the same lanes on an image with every path: passed
    tag2 = tag + "-all"
    tags.append(tag2)
    ok = targets.record_paths(pins, record(image_with([t.lstrip("/") for t in shipped], tag2)))
    assert targets.check(pins, "vllm-native-1m", ok)["state"] == "passed"


def test_an_image_not_built_here_is_never_passed() -> None:
    pins = load_pins(REPO / "pins.toml")
    out = targets.check(pins, "vllm-native", None)
    assert out["state"] == "not run" and "7 replaced mount target(s) unchecked" in out["why"]
    old = record("sha256:" + "1" * 64)  # a record from before the listing: no paths
    assert targets.check(pins, "vllm-native", old)["state"] == "not run"
    assert targets.check(pins, "tensorfold-tp4", None)["state"] == "none"
