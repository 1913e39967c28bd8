"""Published images without an engine or a registry: the pins' one-line refusals, and the lock, plan,
staleness check and gc of a published image (the registry's answer stood in for by a resolver that
returns what a registry gave; the real registry and engine are tests/test_published.py's)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from builder.errors import ResolveError
from builder.image import gc
from builder.image.plan import make_plan
from builder.inputs.pins import PublishedImage, load_pins
from builder.lock import published, resolve
from builder.lock.lockfile import LockedPublishedImage, check_lock, load_lock, spec_hash
from tests.lib import clirun, journeylib

DIGEST = "sha256:" + "ab" * 32
REF = f"127.0.0.1:5000/builder/demo@{DIGEST}"
IMAGE_ID = "sha256:" + "cd" * 32
DIFF_IDS = ["sha256:" + "01" * 32, "sha256:" + "02" * 32]


@pytest.fixture(scope="module")
def project(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return journeylib.project_copy(tmp_path_factory.mktemp("published") / "project")


def _with(root: Path, extra: str) -> Path:
    pins = root / "pins.toml"
    base = pins.read_text().split("\n# -- test --\n")[0]
    pins.write_text(base + "\n# -- test --\n" + extra)
    return pins


def _builder(root: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return clirun.run(*args, cwd=root, timeout=120, argv0=(clirun.SCRIPT,),
                      env={"PATH": "/usr/bin:/bin", "NO_COLOR": "1", "HOME": str(root)})


@pytest.mark.parametrize(("entry", "says"), [
    ('published = "127.0.0.1:5000/builder/demo:latest"', "names a tag, not a digest"),
    ('published = "127.0.0.1:5000/builder/demo"', "names a tag, not a digest"),
    ('published = "127.0.0.1:5000/builder/demo@sha256:abc"', "is not a reference by digest"),
    (f'published = "{REF}"\nrecipe = "images/demo"', "built from a recipe or published, not both"),
    (f'published = "{REF}"\nbase = "x"', "images.pub.base: unknown key"),
])
def test_bad_published_pins_are_one_line(project: Path, entry: str, says: str) -> None:
    pins = _with(project, f"[images.pub]\n{entry}\n")
    lock_before = (project / "pins.lock").read_bytes()
    p = _builder(project, "lock", "pub")
    assert p.returncode == 2, p.stderr
    assert len(p.stderr.strip().splitlines()) == 1 and "Traceback" not in p.stderr, p.stderr
    assert f"{pins.name}: images.pub" in p.stderr and says in p.stderr, p.stderr
    assert (project / "pins.lock").read_bytes() == lock_before  # nothing half-written


def _locked(spec: PublishedImage, source: str = "registry") -> LockedPublishedImage:
    return LockedPublishedImage(spec_hash=spec_hash(spec), published=spec.published, manifest_digest=DIGEST,
                                image_id=IMAGE_ID, diff_ids=DIFF_IDS, platform=spec.platform,
                                source=source)  # type: ignore[arg-type]


def test_lock_plan_check_and_gc_of_a_published_image(project: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pins_path = _with(project, f'[images.pub]\npublished = "{REF}"\nplatform = "linux/amd64"\n\n'
                               '[lanes.pub]\nimage = "pub"\n[lanes.pub.serve]\ntensor_parallel = 1\ncontext = 1\n'
                               'streams = 1\nport = 8000\nserved_name = "pub"\n')
    lock_path = project / "pins.lock"
    calls: list[bool] = []

    def registry_says(name: str, spec: PublishedImage, *, offline: bool, spec_hash: str) -> LockedPublishedImage:
        calls.append(offline)
        return _locked(spec)

    monkeypatch.setattr(published, "resolve_published", registry_says)
    rep = resolve.resolve(pins_path, lock_path, resolve.ResolveOptions(names=["pub"], offline=False))
    assert rep.resolved == ["images.pub"] and not rep.failed and calls == [False]
    lock = load_lock(lock_path)
    entry = lock.images["pub"]
    assert isinstance(entry, LockedPublishedImage)
    assert (entry.image_id, entry.diff_ids, entry.manifest_digest) == (IMAGE_ID, DIFF_IDS, DIGEST)
    assert check_lock(pins_path, lock_path, ["pub"]).ok, check_lock(pins_path, lock_path, ["pub"]).problems
    before = lock_path.read_bytes()

    # offline, as other inputs: what is locked stays, and no resolver is asked
    def unreachable(name: str, spec: PublishedImage, *, offline: bool, spec_hash: str) -> LockedPublishedImage:
        raise ResolveError(f"images.{name}: not reachable offline")

    monkeypatch.setattr(published, "resolve_published", unreachable)
    rep = resolve.resolve(pins_path, lock_path, resolve.ResolveOptions(offline=True, names=["pub"]))
    assert "images.pub" in rep.kept and not rep.failed and lock_path.read_bytes() == before
    # --update asks again; a failure keeps the entry and names the image
    rep = resolve.resolve(pins_path, lock_path, resolve.ResolveOptions(offline=True, names=["pub"],
                                                                             update={"pub"}))
    assert rep.failed == {"images.pub": "images.pub: not reachable offline"} and lock_path.read_bytes() == before

    pins = load_pins(pins_path)
    plan = make_plan(pins, lock, "pub", project)
    assert plan.published == {"ref": REF, "manifest_digest": DIGEST, "image_id": IMAGE_ID, "diff_ids": DIFF_IDS}
    assert plan.platform == "linux/amd64" and plan.source_date_epoch == 0
    assert make_plan(pins, lock, "pub", project).address == plan.address  # a function of the lock alone
    _, _, images = gc.referenced(lock, pins_path)
    assert plan.address in images

    # another digest pinned: stale until locked again
    _with(project, f'[images.pub]\npublished = "{REF.replace("ab", "ef")}"\nplatform = "linux/amd64"\n')
    res = check_lock(pins_path, lock_path, ["pub"])
    assert res.problems == ["images.pub: pins changed since the lock was written"]
    p = _builder(project, "image", "pub", "--plan")
    assert p.returncode == 2 and "images.pub" in p.stderr and len(p.stderr.strip().splitlines()) == 1, p.stderr
