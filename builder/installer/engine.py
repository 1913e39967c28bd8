"""The host's Docker Engine: is an image there (by ImageID, with its DiffIDs), `docker load` of a
bundle's archive, `docker pull` by digest, and whether a thin archive can load here."""

# ruff: noqa: UP031
from __future__ import annotations

import contextlib
import json
import shutil
import subprocess
import tempfile
from typing import Any

from .errors import InstallError, say
from .files import human
from .verify import iter_file

PULL_TIMEOUT = 3600


def docker(args: list[str], *, timeout: float = 120, stdin: Any = None) -> subprocess.CompletedProcess:
    exe = shutil.which("docker")
    if exe is None:
        raise InstallError("docker: not found on PATH")
    try:
        return subprocess.run([exe] + args, capture_output=True, timeout=timeout, stdin=stdin, check=False)
    except subprocess.TimeoutExpired:
        raise InstallError("docker %s: no answer within %d s" % (args[0], timeout)) from None


def image_present(image_id: str) -> list[str] | None:
    """The image's DiffIDs when the engine has this ImageID, else None."""
    p = docker(["image", "inspect", "--format", "{{.Id}} {{json .RootFS.Layers}}", image_id])
    if p.returncode != 0:
        err = p.stderr.decode("utf-8", "replace")
        if "No such" in err or "no such" in err:
            return None
        raise InstallError("docker image inspect: %s" % (err.strip().splitlines() or ["failed"])[-1])
    out = p.stdout.decode("utf-8", "replace").strip()
    got_id, _, layers = out.partition(" ")
    if got_id != image_id:
        return None
    try:
        return [str(x) for x in json.loads(layers)]
    except ValueError:
        return []


def docker_root() -> str | None:
    p = docker(["info", "--format", "{{.DockerRootDir}}"], timeout=60)
    if p.returncode != 0:
        return None
    d = p.stdout.decode("utf-8", "replace").strip()
    return d or None


def load_image(bundle_dir: str, manifest: dict[str, Any]) -> None:
    """Stream the archive (reassembled from parts, hash-checked as it goes) into `docker load`;
    check the loaded ID."""
    img = manifest["image"]
    entry = [f for f in manifest["files"] if f["path"] == img["archive"]][0]
    load = Load(img, entry["size"])
    failed: BaseException | None = None
    try:
        assert load.proc.stdin is not None
        for chunk in iter_file(bundle_dir, entry):
            load.proc.stdin.write(chunk)
        load.proc.stdin.close()
    except BrokenPipeError:
        pass
    except BaseException as e:  # a hash mismatch: stop docker load before it finishes
        failed = e
        with contextlib.suppress(OSError):
            load.proc.kill()
    load.finish(failed)


class Load:
    """One `docker load` running: of a whole archive file already checked (``path``: its stdin is
    the file, so it runs beside other work), or fed through its stdin pipe (``path`` None)."""

    def __init__(self, img: dict[str, Any], size: int, path: str | None = None) -> None:
        exe = shutil.which("docker")
        if exe is None:
            raise InstallError("docker: not found on PATH")
        say("loading image %s (%s)" % (img["image_id"][:19], human(size)))
        self.img = img
        self.outf, self.errf = tempfile.TemporaryFile(), tempfile.TemporaryFile()  # no pipe to fill up
        with open(path, "rb") if path is not None else contextlib.nullcontext() as src:
            self.proc = subprocess.Popen([exe, "load"], stdin=src if src is not None else subprocess.PIPE,
                                         stdout=self.outf, stderr=self.errf)

    def finish(self, failed: BaseException | None = None) -> None:
        """Wait for it and check the loaded image (its ID, and DiffIDs, the manifest's); re-raise
        ``failed`` (what stopped its feed) once it has ended."""
        proc = self.proc
        with contextlib.suppress(OSError):
            if proc.stdin is not None:
                proc.stdin.close()
        try:
            proc.wait(timeout=3600)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise InstallError("docker load: no answer within an hour") from None
        self.outf.seek(0)
        self.errf.seek(0)
        out, err = self.outf.read(65536), self.errf.read(65536)
        self.outf.close()
        self.errf.close()
        img = self.img
        if failed is not None:
            raise failed
        if proc.returncode != 0:
            last = (err.decode("utf-8", "replace").strip().splitlines() or ["failed"])[-1]
            raise InstallError("docker load: %s" % last)
        layers = image_present(img["image_id"])
        if layers is None:
            raise InstallError(
                "docker load: the archive did not give image %s (got: %s)"
                % (img["image_id"], out.decode("utf-8", "replace").strip()[:200])
            )
        if layers and layers != img["diff_ids"]:
            raise InstallError("docker load: image %s has DiffIDs other than the manifest's" % img["image_id"])


def check_thin(img: dict[str, Any]) -> None:
    """A thin archive (``image.omitted_layers``: its leading layers left out) loads only on an engine
    with the classic image store that holds those layers' chain already: `docker load` there skips a
    layer whose chain it has, without reading its file. An engine keeping images in containerd needs
    every blob. Refused here, before anything changes, when either does not hold."""
    p = docker(["info", "--format", "{{json .DriverStatus}}"], timeout=60)
    if p.returncode == 0 and b"io.containerd.snapshotter" in p.stdout:
        raise InstallError(
            "image %s: this host's Docker Engine keeps images in containerd, whose docker load needs every "
            "layer; a thin bundle cannot be loaded here (bundle it without --thin)" % img["image_id"]
        )
    k = img["omitted_layers"]
    want = img["diff_ids"][:k]
    ids = docker(["image", "ls", "--quiet", "--no-trunc"], timeout=60)
    listed = sorted(set(ids.stdout.decode("utf-8", "replace").split())) if ids.returncode == 0 else []
    chains: list[list[str]] = []
    if listed:
        q = docker(["image", "inspect", "--format", "{{json .RootFS.Layers}}"] + listed, timeout=120)
        for line in q.stdout.decode("utf-8", "replace").splitlines():
            try:
                chains.append([str(x) for x in json.loads(line) or []])
            except ValueError:
                continue
    held = 0
    for chain in chains:
        n = 0
        while n < min(len(chain), k) and chain[n] == want[n]:
            n += 1
        held = max(held, n)
    if held < k:
        raise InstallError(
            "image %s: the bundle leaves out %d layer(s) this host does not hold, from %s (bundle it without "
            "--thin, or with --have from this host's record)" % (img["image_id"], k - held, want[held][:19])
        )


def pull_image(manifest: dict[str, Any]) -> None:
    """``docker pull`` the image by digest from the fleet's registry; check the pulled ImageID and DiffIDs.

    The host's dockerd fetches only the layers it lacks and checks every blob against its digest; the
    ImageID check here is what ties the registry's manifest to the signed bundle (another image under
    that reference is refused before anything switches). A registry that does not answer is one line
    naming it.
    """
    img = manifest["image"]
    ref = img["pull"]
    registry = ref.split("/", 1)[0]
    say("pulling image %s from %s" % (img["image_id"][:19], registry))
    p = docker(["pull", "--quiet", ref], timeout=PULL_TIMEOUT)
    if p.returncode != 0:
        lines = p.stderr.decode("utf-8", "replace").strip().splitlines() or ["failed"]
        raise InstallError("registry %s: cannot pull %s: %s" % (registry, ref.split("/", 1)[1], lines[-1][:300]))
    layers = image_present(img["image_id"])
    if layers is None:
        got = docker(["image", "inspect", "--format", "{{.Id}}", ref])
        gid = got.stdout.decode("utf-8", "replace").strip() if got.returncode == 0 else "nothing"
        raise InstallError(
            "registry %s: %s is image %s, not the bundle's %s" % (registry, ref.split("/", 1)[1], gid, img["image_id"])
        )
    if layers != img["diff_ids"]:
        raise InstallError("registry %s: image %s has DiffIDs other than the manifest's" % (registry, img["image_id"]))
    # a pull by digest tags nothing; the image gets the tag a `docker load` of its archive gives it
    # (builder.image.imagerecord.tag_for's rule, see pulled_tag), which the audit checks
    tag = pulled_tag(img)
    t = docker(["tag", img["image_id"], tag], timeout=60)
    if t.returncode != 0:
        err = t.stderr.decode("utf-8", "replace").strip() or "failed"
        raise InstallError("docker tag %s: %s" % (tag, err[-200:]))


def pulled_tag(img: dict[str, Any]) -> str:
    """builder/NAME:<input address[:32]>: builder.image.imagerecord.tag_for's rule, written out here
    (builder.installer imports nothing else of builder; tests/test_registry.py holds the two equal)."""
    return "builder/%s:%s" % (img["name"], img["input_address"][:32])
