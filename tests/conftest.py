"""Shared test setup: tests never touch the home folder or any network beyond loopback; the session's
ziglang wheel (`wheelhouse`) for the tests that build the demo image."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path

import pytest

from builder.lock.lockfile import load_lock
from tests.lib import dockerlib
from tests.lib.fleetlib import close_kept_connections, docker_available

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(autouse=True)
def _isolated_env(
    tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch
) -> Iterator[None]:
    home = tmp_path_factory.mktemp("home")
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setenv("HF_HOME", str(home / "hf"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_DISABLE_TELEMETRY", "1")
    monkeypatch.setenv("NO_COLOR", "1")
    monkeypatch.setenv("GIT_CONFIG_NOSYSTEM", "1")
    # every `python3 -m builder` a test starts runs this tree's code, whatever the folder it runs in
    # and whichever checkout `pip install -e` last pointed at
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]))
    monkeypatch.setenv("GIT_AUTHOR_NAME", "builder tests")
    monkeypatch.setenv("GIT_AUTHOR_EMAIL", "tests@builder.invalid")
    monkeypatch.setenv("GIT_COMMITTER_NAME", "builder tests")
    monkeypatch.setenv("GIT_COMMITTER_EMAIL", "tests@builder.invalid")
    for var in ("BUILDER_PINS", "BUILDER_LOCK", "BUILDER_STORE", "BUILDER_SIGNING_KEY", "HF_TOKEN",
                "HF_ENDPOINT", "BUILDER_REGISTRY_USER", "BUILDER_REGISTRY_PASSWORD"):
        monkeypatch.delenv(var, raising=False)
    yield


@pytest.fixture(autouse=True)
def _ssh_connections(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The ssh connections a test's audits keep open (`--ssh-persist`) live in a folder of that test's
    own, so no test reuses another's, and are closed when the test ends. (/tmp and a short name:
    unix socket paths are limited to 108 bytes.)"""
    folder = Path(tempfile.mkdtemp(prefix="bS-", dir="/tmp"))
    monkeypatch.setenv("BUILDER_SSH_DIR", str(folder))
    yield
    close_kept_connections(folder)


@pytest.fixture
def project_root() -> Path:
    return ROOT


@pytest.fixture(scope="session")
def wheelhouse(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder holding the ziglang wheel the shipped lock pins for this machine's platform."""
    lock = load_lock(ROOT / "pins.lock")
    art = lock.toolchains["zig-wheel"].platforms[dockerlib.engine_platform()]
    assert art.filename
    for d in [*(x for x in os.environ.get("BUILDER_WHEELHOUSE", "").split(os.pathsep) if x),
              str(ROOT / ".cache" / "wheelhouse")]:
        if (Path(d) / art.filename).is_file():
            return Path(d)
    wh = tmp_path_factory.mktemp("wheelhouse")
    mine = ROOT / ".cache" / "builder" / "objects" / art.sha256  # the developer's store, read only
    if mine.is_file():
        shutil.copyfile(mine, wh / art.filename)
        return wh
    plat = art.filename[:-4].split("-")[-1].split(".")[0]
    r = subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
                        "--platform", plat, "-d", str(wh), "ziglang==0.17.0"], capture_output=True, text=True)
    assert r.returncode == 0 and (wh / art.filename).is_file(), r.stderr
    return wh


def pytest_configure(config: pytest.Config) -> None:
    # xdist hands out a --dist loadfile run's files by their number of tests, most first, unless told
    # not to: the order below (the longest tiers first) is what keeps the slowest file off the end
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False
    # A shell's background job (`.ci/run &`, nohup) starts with SIGINT ignored, and Python keeps it so: Ctrl-C
    # would then never reach the code under test, and a test of what an interrupt leaves behind would wait
    # for one forever. Every test process (and so every process it starts) takes SIGINT as Ctrl-C sends it.
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        compile_sources()


def compile_sources() -> None:
    """Byte-compile builder, its checks and the tests' helpers once, before any test runs.

    Where PYTHONDONTWRITEBYTECODE is set (CI's machines set it), Python caches no module it compiles:
    every `builder` the tests run, and every host's pytest of every audit, would compile builder's modules
    from source again, about 1 G of a deploy's 2.3 G instructions at start-up (docs/testing.md). Compiled
    here, each process reads the bytecode; an up-to-date file is skipped, and nothing is written while
    tests run (in the controller, before xdist starts its workers)."""
    import compileall

    for folder in ("builder", "checks", "tests"):
        compileall.compile_dir(ROOT / folder, quiet=1, workers=1)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        # property tests (1000 examples each) are a tier of their own: CI runs them,
        # a developer's quick loop can skip them with -m "not fuzz"
        if getattr(getattr(item, "obj", None), "is_hypothesis_test", False):
            item.add_marker(pytest.mark.fuzz)
    # the longest tiers first: xdist (--dist loadfile: a file's tests in one worker, in order, so a module's
    # fleet is made once) hands out files in this order, so the kill loops and fleets start at once and the
    # quick files fill the workers' gaps at the end (a stable sort: a module's order holds)
    first: dict[str, int] = {}
    for item in items:  # (a file's rank is its longest test's: its own tests keep their order)
        f = item.nodeid.split("::", 1)[0]
        first[f] = min(first.get(f, 4), tier_rank(item))
    items.sort(key=lambda item: first[item.nodeid.split("::", 1)[0]])
    if os.environ.get("CI") and not docker_available():
        raise pytest.UsageError("CI needs a running Docker Engine for the docker/fleet tiers")


def tier_rank(item: pytest.Item) -> int:
    """0 first: the real vLLM (its image, once per machine, is the longest single job), then the kill loops
    and other slow tests, the fleets and registries, Docker, builds and property tests, the rest."""
    marks = {m.name for m in item.iter_markers()}
    if "vllm" in marks:
        return 0
    if "slow" in marks:
        return 1
    if marks & {"fleet", "registry"}:
        return 2
    return 3 if marks & {"docker", "build", "fuzz"} else 4


#: seconds per test file (setup, call and teardown of each test, over every worker): what CI prints last
_FILE_SECONDS: defaultdict[str, float] = defaultdict(float)


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    _FILE_SECONDS[report.nodeid.split("::", 1)[0]] += report.duration


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if not _FILE_SECONDS:
        return
    tr = terminalreporter
    total = sum(_FILE_SECONDS.values())
    tr.write_sep("=", f"time per test file ({total:.0f} s of test time, summed over every worker)")
    for name, seconds in sorted(_FILE_SECONDS.items(), key=lambda kv: -kv[1])[:30]:
        tr.write_line(f"{seconds:8.1f} s  {name}")
