"""The newcomer's path: README.md's set-up, command 1 and the local-fleet tour, read from the README and
run verbatim in a clean Debian 12 container (tests/newcomer/readme_run.py)."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from tests.lib.fleetlib import docker_available
from tests.newcomer import readme_run

ROOT = Path(__file__).resolve().parent.parent


def test_plan_reads_the_readme_blocks_in_order() -> None:
    p = readme_run.plan((ROOT / "README.md").read_text())
    # the set-up starts from a stock image's empty package lists, and installs what the README names
    assert p.setup[0].startswith("sudo apt-get update && sudo apt-get install -y ")
    assert [readme_run.drop_sudo(c).split()[0] for c in p.setup] == ["apt-get", "usermod"]
    assert p.commands[0].startswith("python3 -m venv .venv && . .venv/bin/activate && pip install -e '.[dev]'")
    assert readme_run.SUITE_COMMAND not in p.commands
    assert p.build_testhost == "sudo tests/fleet/build-testhost.sh"
    assert p.tour[0].startswith("python3 -m tests.fleet.local up")
    assert any(c.startswith("builder status --fleet local") for c in p.tour)
    assert p.tour[-1].startswith("python3 -m tests.fleet.local down")


def test_drop_sudo_drops_each_commands_sudo_only() -> None:
    assert readme_run.drop_sudo("sudo a && sudo b x; sudo c || sudo d") == "a && b x; c || d"
    assert readme_run.drop_sudo('usermod -aG docker "$USER"  # sudo here stays') == \
        'usermod -aG docker "$USER"  # sudo here stays'


def test_ranks_down_reads_the_status_table() -> None:
    up = "host     rank      up\nspark-1  0 (head)  yes\nspark-2  1 (worker)  yes\n"
    assert readme_run.ranks_down(up) == []
    assert readme_run.ranks_down(up.replace("yes\n", "no\n", 1)) == ["spark-1  0 (head)  no"]
    assert readme_run.ranks_down("spark-1 yes\n") == ["1 host rows in the status table, expected 2"]


def test_plan_names_a_missing_section_in_one_line() -> None:
    with pytest.raises(readme_run.RunError, match=re.escape("README.md: no section '## Set-up and the two commands'")):
        readme_run.plan("# builder\n")


@pytest.mark.slow
@pytest.mark.docker
@pytest.mark.fleet
def test_readme_runs_verbatim_in_a_clean_debian_container() -> None:
    if not docker_available():
        pytest.skip("needs a Docker Engine")
    if os.geteuid() != 0:
        pytest.skip("making the clean Debian rootfs needs root (debootstrap)")
    steps = readme_run.run_readme()
    p = readme_run.plan((ROOT / "README.md").read_text())
    ran = [s.command for s in steps]
    # every README line ran, in order, and exited 0
    expected = [readme_run.drop_sudo(c) for c in p.setup] + p.commands + \
        [readme_run.drop_sudo(p.build_testhost)] + p.tour
    assert [r.removeprefix(readme_run.ACTIVATE) for r in ran] == expected
    assert [s.rc for s in steps] == [0] * len(steps)
    status = next(s for s in steps if "builder status --fleet local" in s.command)
    assert readme_run.ranks_down(status.stdout) == []
