"""What a process loads before it does anything: the processes that run most often load only what they use.

An audit runs one pytest per host, and a deploy runs at least two audits; `builder status`, `start`,
`stop` and `deploy` run on every fleet change. The pydantic models of the pins, lock and inventory and
the Docker SDK are most of what these processes could import for nothing.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
HEAVY = ("pydantic", "docker", "requests", "huggingface_hub", "rich")


def loaded_after(code: str, cwd: Path) -> set[str]:
    """The top-level packages of HEAVY in sys.modules after `code` runs in a fresh interpreter."""
    probe = f"{code}\nimport json, sys\nprint(json.dumps(sorted({{m.split('.')[0] for m in sys.modules}})))"
    out = subprocess.run([sys.executable, "-c", probe], cwd=cwd, capture_output=True, text=True, check=True)
    return set(json.loads(out.stdout.splitlines()[-1])) & set(HEAVY)


def test_a_hosts_check_process_loads_no_model_and_no_docker_sdk() -> None:
    # as the host's pytest imports them: checks/ first on sys.path (its rootdir), builder beside it
    modules = sorted(p.stem for p in (ROOT / "checks").glob("*.py"))
    code = f"import sys; sys.path[:0] = [{str(ROOT / 'checks')!r}, {str(ROOT)!r}]\n" + "\n".join(
        f"import {m}" for m in modules)
    assert "test_serving" in modules and "checklib" in modules
    assert loaded_after(code, ROOT / "checks") == set()


def test_the_fleet_commands_load_no_docker_sdk_and_no_rich() -> None:
    # deploy, status, start and stop talk to hosts over ssh; only an image build or push, or a bundle
    # --with-image, talks to the local engine, and imports the SDK where it does. rich is imported where
    # it draws (colour, a table, bars on a terminal).
    for module in ("builder.cli.deploy", "builder.cli.audit", "builder.cli.ship", "builder.cli.bundle"):
        got = loaded_after(f"import {module}", ROOT)
        assert not got & {"docker", "requests", "huggingface_hub", "rich"}, (module, got)
