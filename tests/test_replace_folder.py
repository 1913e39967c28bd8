"""builder.foundation.canon.replace_folder, the one way a finished folder is put in place (a bundle, a
deploy's lock snapshot): the old folder stays until the new one is in, comes back when the new one
cannot go in, and two processes doing it at once each end with a whole folder. Real folders, real
processes."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from builder.deploy import journal as J
from builder.foundation.canon import replace_folder
from tests.lib import clirun


def folder(path: Path, who: str) -> Path:
    path.mkdir(parents=True)
    (path / "a").write_text(who)
    (path / "b").write_text(who)
    return path


def test_the_old_folder_stays_when_the_new_one_cannot_go_in(tmp_path: Path) -> None:
    dest = folder(tmp_path / "out", "old")
    gone = tmp_path / ".tmp-out-new"  # (its staging removed under it)
    with pytest.raises(FileNotFoundError):
        replace_folder(gone, dest)
    assert (dest / "a").read_text() == "old" and sorted(p.name for p in tmp_path.iterdir()) == ["out"]
    shm = Path("/dev/shm")
    if shm.is_dir() and os.access(shm, os.W_OK) and os.stat(shm).st_dev != os.stat(tmp_path).st_dev:
        other = folder(Path(tempfile.mkdtemp(dir=shm)) / "new", "new")
        try:
            with pytest.raises(OSError):  # EXDEV: another filesystem
                replace_folder(other, dest)
        finally:
            shutil.rmtree(other.parent)
        assert (dest / "a").read_text() == "old" and sorted(p.name for p in tmp_path.iterdir()) == ["out"]
    replace_folder(folder(tmp_path / ".tmp-out-new", "new"), dest)
    assert (dest / "a").read_text() == "new" and sorted(p.name for p in tmp_path.iterdir()) == ["out"]
    link = tmp_path / "link"
    link.symlink_to(dest)  # a link at the path is replaced, not followed
    replace_folder(folder(tmp_path / "n2", "n2"), link)
    assert not link.is_symlink() and (link / "a").read_text() == "n2" and (dest / "a").read_text() == "new"


RACER = """
import os, sys, time
from pathlib import Path
from builder.foundation.canon import replace_folder
dest, t0, n = Path(sys.argv[1]), float(sys.argv[2]), int(sys.argv[3])
while time.time() < t0:
    pass
for i in range(n):
    new = dest.parent / f"new-{os.getpid()}-{i}"
    new.mkdir()
    (new / "a").write_text(f"{os.getpid()}-{i}")
    (new / "b").write_text(f"{os.getpid()}-{i}")
    replace_folder(new, dest)
"""


def test_two_processes_replacing_one_folder_at_once_each_succeed(tmp_path: Path) -> None:
    dest = folder(tmp_path / "out", "first")
    t0 = time.time() + 2.0
    procs = [subprocess.Popen([sys.executable, "-c", RACER, str(dest), str(t0), "300"], env=clirun.environment(),
                              stderr=subprocess.PIPE, text=True) for _ in range(2)]
    for p in procs:
        _, err = p.communicate(timeout=240)
        assert p.returncode == 0, err[-2000:]
    assert {p.name for p in dest.iterdir()} == {"a", "b"}
    assert (dest / "a").read_text() == (dest / "b").read_text()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # no old folder left aside, no new one


SNAPSHOTTER = """
import sys, time
from pathlib import Path
from builder.deploy import journal as J
store, proj, t0, n = Path(sys.argv[1]), Path(sys.argv[2]), float(sys.argv[3]), int(sys.argv[4])
for i in range(n):
    while time.time() < t0 + i * 0.01:
        pass
    J.snapshot(store, f"{i:064x}", proj / "pins.toml", proj / "pins.lock", proj, None)
"""


def test_two_deploys_of_one_lock_keep_its_snapshot_at_once(tmp_path: Path) -> None:
    """Two fleets deployed from one lock at the same moment: both keep its snapshot (no ENOTEMPTY)."""
    proj = tmp_path / "proj"
    proj.mkdir()
    (proj / "pins.toml").write_text("# pins\n")
    (proj / "pins.lock").write_text("{}\n")
    store = tmp_path / "store"
    t0 = time.time() + 2.0
    procs = [subprocess.Popen([sys.executable, "-c", SNAPSHOTTER, str(store), str(proj), str(t0), "300"],
                              env=clirun.environment(), stderr=subprocess.PIPE, text=True) for _ in range(2)]
    for p in procs:
        _, err = p.communicate(timeout=240)
        assert p.returncode == 0, err[-2000:]
    for i in range(300):
        snap = J.find_snapshot(store, f"{i:064x}")
        assert snap is not None and (snap / "pins.lock").read_text() == "{}\n"
    assert not [p.name for p in (store / "deploy" / "locks").iterdir() if p.name.startswith(".")]
