"""Wheel sets (``[wheels.NAME]``, builder.lock.wheelset): a hash-pinned requirements file locked to the
wheel files it names, through the real CLI on a small project, with a wheelhouse of small wheels made here.

The requirements file is read as pip reads its hash-checking form (continuations, comments, several
hashes for one requirement) and refused, naming file and line, where a line does not name one file.
`builder lock --offline` finds each wheel by its sha256 in the wheelhouse (a file of the right name with
other bytes is not it), records name, version, filename, size and sha256, and names what no wheelhouse
holds with the command that fills it, writing nothing; an edit of the requirements file makes the lock
stale. An image that lists the set gets every wheel in its closure (an image that lists none keeps the
spec hash and address it had before wheel sets existed) and, built, in its build context at wheels/
(the image here copies them in): verified from the store, kept by `builder gc`, each in the SBOM as
``pkg:pypi/NAME@VERSION``. `builder diff` names a wheel that moved.
"""

from __future__ import annotations

import hashlib
import io
import json
import subprocess
import tarfile
import zipfile
from pathlib import Path

import pytest

from builder.errors import ConfigError
from builder.inputs.pins import ImageRecipe
from builder.lock.lockfile import spec_hash
from builder.lock.wheelset import parse_requirements, wheel_name_version
from tests.lib import clirun, factory, fleetlib


def wheel(folder: Path, name: str, version: str, payload: bytes = b"") -> tuple[Path, str]:
    """A small wheel file (a zip with its dist-info) in ``folder``; its path and sha256."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{name.replace('-', '_')}-{version}-py3-none-any.whl"
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        info = zipfile.ZipInfo(f"{name.replace('-', '_')}-{version}.dist-info/METADATA", (2020, 1, 1, 0, 0, 0))
        z.writestr(info, f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
        z.writestr(zipfile.ZipInfo(f"{name.replace('-', '_')}/__init__.py", (2020, 1, 1, 0, 0, 0)), payload)
    path.write_bytes(buf.getvalue())
    return path, hashlib.sha256(buf.getvalue()).hexdigest()


class WheelProject:
    """pins.toml with `[wheels.py]` (requirements/py.lock) and `[images.py]` listing it; a wheelhouse of
    two wheels; the store and wheelhouse under tmp."""

    def __init__(self, tmp: Path) -> None:
        self.root = tmp / "proj"
        self.house = tmp / "wheelhouse"
        self.store = tmp / "store"
        self.alpha, self.alpha_sha = wheel(self.house, "alpha", "1.0", b"A = 1\n")
        self.beta, self.beta_sha = wheel(self.house, "beta-pkg", "2.0.post1", b"B = 2\n")
        recipe = self.root / "images" / "py"
        recipe.mkdir(parents=True)
        (recipe / "Dockerfile").write_text("FROM scratch\nCOPY wheels /wheels\n")
        factory.write_pins(self.root, factory.pins(
            wheels={"py": {"requirements": "requirements/py.lock"}},
            images={"py": factory.image("images/py", wheels=["py"], platform="linux/amd64"),
                    "plain": factory.image("images/py", platform="linux/amd64")},
        ))
        self.write_requirements()

    def write_requirements(self, extra: str = "") -> None:
        (self.root / "requirements").mkdir(exist_ok=True)
        (self.root / "requirements" / "py.lock").write_text(
            "# two wheels, hash-pinned\n"
            f"alpha==1.0 \\\n    --hash=sha256:{self.alpha_sha}\n"
            f"beta_pkg==2.0.post1 \\\n    --hash=sha256:{'0' * 64} \\\n"
            f"    --hash=sha256:{self.beta_sha}  # two hashes\n"
            + extra)

    def run(self, *args: str) -> subprocess.CompletedProcess[str]:
        env = clirun.environment({"BUILDER_WHEELHOUSE": str(self.house), "BUILDER_STORE": str(self.store)},
                                 drop=("BUILDER_",))
        return clirun.run(*args, cwd=self.root, env=env, timeout=600)

    def lock(self) -> dict:
        return json.loads((self.root / "pins.lock").read_text())


@pytest.fixture
def proj(tmp_path: Path) -> WheelProject:
    return WheelProject(tmp_path)


def test_requirements_are_read_as_pip_reads_them_and_lines_that_name_no_one_file_are_refused() -> None:
    text = ("# header\n\nfoo-Bar==1.2.3 \\\n    --hash=sha256:" + "a" * 64 + " \\\n    --hash=sha256:" + "b" * 64
            + "\nbaz==0.1 --hash=sha256:" + "c" * 64 + "  # inline comment\n")
    reqs = parse_requirements(text, "r.lock")
    assert [(r.name, r.version, sorted(r.hashes), r.line) for r in reqs] == [
        ("foo-bar", "1.2.3", ["a" * 64, "b" * 64], 3), ("baz", "0.1", ["c" * 64], 6)]
    h = " --hash=sha256:" + "d" * 64
    for bad, where in [("foo==1.0\n", "r.lock:1"), ("foo>=1.0" + h + "\n", "r.lock:1"),
                       ("x==1" + h + "\nfoo==1.0; python_version<'3'" + h + "\n", "r.lock:2"),
                       ("-r other.txt\n", "r.lock:1"), ("foo[extra]==1.0" + h + "\n", "r.lock:1"),
                       ("foo==1.0" + h + "\nFoo==1.0" + h + "\n", "r.lock:2"),
                       ("foo==1.0 --hash=md5:abc\n", "r.lock:1"), ("# nothing\n", "r.lock")]:
        with pytest.raises(ConfigError, match=where.replace(".", r"\.")):
            parse_requirements(bad, "r.lock")
    assert wheel_name_version("Beta_Pkg-2.0.post1-py3-none-any.whl") == ("beta-pkg", "2.0.post1")
    assert wheel_name_version("torch-2.13.0-cp311-cp311-manylinux_2_28_x86_64.whl") == ("torch", "2.13.0")
    assert wheel_name_version("not-a-wheel.tar.gz") is None


def test_lock_finds_each_wheel_by_its_hash_and_an_edit_of_the_file_makes_it_stale(proj: WheelProject) -> None:
    p = proj.run("lock", "--offline")
    assert p.returncode == 0, p.stderr
    entry = proj.lock()["wheels"]["py"]
    assert entry["requirements"] == "requirements/py.lock"
    assert entry["requirements_sha256"] == hashlib.sha256((proj.root / "requirements/py.lock").read_bytes()).hexdigest()
    assert entry["wheels"] == [
        {"name": "alpha", "version": "1.0", "filename": proj.alpha.name, "sha256": proj.alpha_sha,
         "size": proj.alpha.stat().st_size},
        {"name": "beta-pkg", "version": "2.0.post1", "filename": proj.beta.name, "sha256": proj.beta_sha,
         "size": proj.beta.stat().st_size}]
    assert entry["total_size"] == proj.alpha.stat().st_size + proj.beta.stat().st_size
    assert proj.run("lock", "--check").returncode == 0
    proj.write_requirements("# an edit\n")
    p = proj.run("lock", "--check")
    assert p.returncode == 1 and "wheels.py: requirements/py.lock changed since the lock" in p.stderr, p.stderr
    p = proj.run("lock", "--offline")
    assert p.returncode == 0 and proj.run("lock", "--check").returncode == 0, p.stderr
    assert proj.lock()["wheels"]["py"]["wheels"] == entry["wheels"]


def test_a_wheel_no_wheelhouse_holds_is_named_with_the_command_that_fills_it(proj: WheelProject) -> None:
    assert proj.run("lock", "--offline").returncode == 0
    before = (proj.root / "pins.lock").read_bytes()
    proj.beta.write_bytes(proj.beta.read_bytes() + b"\0")  # the right name, other bytes: not the pinned wheel
    proj.write_requirements("# edited, so that the set is locked again\n")
    p = proj.run("lock", "--offline")
    assert p.returncode == 1, p.stderr
    line = next(ln for ln in p.stderr.splitlines() if "wheels.py" in ln)
    assert "1 of 2 wheel(s) are in no wheelhouse" in line and "beta-pkg==2.0.post1 (requirements/py.lock:4)" in line
    assert "pip download --no-deps --require-hashes --only-binary=:all: -d" in line
    assert "-r requirements/py.lock" in line
    assert (proj.root / "pins.lock").read_bytes() == before  # a lock that fails writes nothing


def test_the_closure_holds_every_wheel_and_an_image_without_wheel_sets_is_as_before(proj: WheelProject) -> None:
    assert proj.run("lock", "--offline").returncode == 0
    p = proj.run("image", "py", "--plan", "--json")
    assert p.returncode == 0, p.stderr
    closure = json.loads(p.stdout)["closure"]
    assert closure["wheels"] == {"py": {proj.alpha.name: proj.alpha_sha, proj.beta.name: proj.beta_sha}}
    plain = json.loads(proj.run("image", "plain", "--plan", "--json").stdout)
    assert "wheels" not in plain["closure"]
    # an image pin dumps (and so hashes) as it did before wheel sets existed: the closure carries them
    img = ImageRecipe(recipe="images/py", platform="linux/amd64", wheels=["py"])
    assert "wheels" not in img.model_dump(mode="json")
    assert spec_hash(img) == spec_hash(ImageRecipe(recipe="images/py", platform="linux/amd64"))
    old = (proj.root / "pins.lock").read_bytes()
    wheel(proj.house, "alpha", "1.1", b"A = 2\n")
    sha = hashlib.sha256((proj.house / "alpha-1.1-py3-none-any.whl").read_bytes()).hexdigest()
    req = proj.root / "requirements" / "py.lock"
    req.write_text(req.read_text().replace(f"alpha==1.0 \\\n    --hash=sha256:{proj.alpha_sha}",
                                           f"alpha==1.1 \\\n    --hash=sha256:{sha}"))
    assert proj.run("lock", "--offline").returncode == 0
    moved = json.loads(proj.run("image", "py", "--plan", "--json").stdout)
    assert moved["input_address"] != json.loads(p.stdout)["input_address"]
    (proj.root / "old.lock").write_bytes(old)
    d = proj.run("diff", "old.lock", "pins.lock", "--json")
    changes = json.loads(d.stdout)
    lines = [c["what"] for c in (changes["changes"] if isinstance(changes, dict) else changes)
             if c["input"] == "wheels.py"]
    assert f"wheel alpha 1.0 ({proj.alpha_sha[:12]}) -> 1.1 ({sha[:12]})" in lines, changes


@pytest.mark.docker
def test_the_build_context_holds_the_wheels_from_the_store(proj: WheelProject) -> None:
    if not fleetlib.docker_available():
        pytest.skip("no Docker Engine")
    assert proj.run("lock", "--offline").returncode == 0
    p = proj.run("image", "py", "--offline", "--json")
    assert p.returncode == 0, p.stderr
    tag = json.loads(p.stdout)["tag"]
    try:
        saved = subprocess.run(["docker", "save", tag], capture_output=True, check=True).stdout
        got: dict[str, bytes] = {}
        with tarfile.open(fileobj=io.BytesIO(saved)) as outer:
            for m in outer:
                if m.name.endswith(".tar") or m.name.startswith("blobs/"):
                    data = outer.extractfile(m)
                    if data is None:
                        continue
                    try:
                        with tarfile.open(fileobj=io.BytesIO(data.read())) as layer:
                            for f in layer:
                                if f.name.startswith("wheels/") and f.isfile():
                                    got[f.name] = layer.extractfile(f).read()  # type: ignore[union-attr]
                    except tarfile.ReadError:
                        continue
        assert {n: hashlib.sha256(b).hexdigest() for n, b in got.items()} == {
            f"wheels/{proj.alpha.name}": proj.alpha_sha, f"wheels/{proj.beta.name}": proj.beta_sha}
        for sha in (proj.alpha_sha, proj.beta_sha):
            assert (proj.store / "objects" / sha).is_file()  # verified into the store, linked into the context
        gc = proj.run("gc", "--dry-run", "--json")
        assert gc.returncode == 0 and proj.alpha_sha not in gc.stdout, gc.stdout
        sbom = json.loads(next((proj.store / "provenance").glob("*/sbom.cdx.json")).read_text())
        purls = {c.get("purl") for c in sbom["components"]}
        assert f"pkg:pypi/alpha@1.0?checksum=sha256:{proj.alpha_sha}" in purls, purls
        assert f"pkg:pypi/beta-pkg@2.0.post1?checksum=sha256:{proj.beta_sha}" in purls, purls
    finally:
        subprocess.run(["docker", "image", "rm", "-f", tag], capture_output=True)
