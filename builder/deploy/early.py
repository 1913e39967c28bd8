"""The likely no-op's audit, in a process of its own (``python -m builder.deploy.early REQUEST``).

``builder deploy`` starts it before it loads anything when the fleet most likely runs its bundles
already (no unfinished deploy, and every bundle in out/bundles was made from this lock): as
``builder audit --fleet F --phase all --json`` would, over the command's connections (it opens them;
the deploy's steps reuse them), so its pytest start and its checks overlap the deploy's own loading and
bundle checks on another core. Its report (the audit's JSON) is used only when the deploy finds the
fleet deployed; it is always waited for.

This module is both sides: `EarlyAudit` here, `main` in the child. It imports no more than the
standard library and the journal at the top, so the child starts before the deploy's heavy imports.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any

from builder.deploy import journal as J

if TYPE_CHECKING:
    from builder.audit import HostResult
    from builder.deploy.fleetwork import DeployOptions, Say
    from builder.ssh import ControlSockets

#: the AuditOptions fields the request carries as paths
PATH_FIELDS = ("root", "pins", "lock", "store", "hosts_dir", "checks_dir", "control_dir")
#: a progress line of the child, on its stderr: "HOST: STATUS (SECONDS s)"
PROGRESS = re.compile(r"^(\S+): (pass|drift|unreachable|error) \((.*)\)$")


def request(opts: DeployOptions, shared: ControlSockets) -> dict[str, Any]:
    """The child's AuditOptions, as JSON (absolute paths: the child runs in the sockets' folder)."""
    return {
        "root": str(opts.root.resolve()), "pins": str(opts.pins.resolve()), "lock": str(opts.lock.resolve()),
        "store": str(opts.store.resolve()), "hosts_dir": str((opts.root / "hosts").resolve()),
        "checks_dir": str((opts.checks_dir or opts.root / "checks").resolve()), "fleet": opts.fleet,
        "mode": opts.audit_mode, "phase": "all", "connect_timeout": float(opts.connect_timeout),
        "control_dir": str(shared.folder), "ssh_persist": shared.persist,
    }


class EarlyAudit:
    """The child process, its progress lines (said as they come) and its report."""

    def __init__(self, opts: DeployOptions, shared: ControlSockets, say: Say) -> None:
        # the same builder as this process (whatever put it on the path); no CLI, no table to render
        here = str(Path(__file__).resolve().parent.parent.parent)
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([here, *filter(None, [os.environ.get("PYTHONPATH")])])}
        self.report: dict[str, Any] | None = None
        self.say = say
        say(f"audit of fleet {opts.fleet}")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "builder.deploy.early", json.dumps(request(opts, shared))], cwd=shared.folder,
            env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        )
        self.err = threading.Thread(target=self._progress, daemon=True)
        self.err.start()

    def _progress(self) -> None:
        assert self.proc.stderr is not None
        for raw in self.proc.stderr:
            m = PROGRESS.match(raw.decode("utf-8", "replace").rstrip())
            if m:
                self.say(f"{m.group(1)}: audit: {m.group(2)} ({m.group(3)})")

    def wait(self) -> dict[str, Any] | None:
        assert self.proc.stdout is not None
        out = self.proc.stdout.read()  # (stderr is the progress thread's)
        self.proc.wait()
        self.err.join()
        try:
            got = json.loads(out)
        except ValueError:  # (a configuration error is the deploy's to report)
            return None
        self.report = got if isinstance(got, dict) and "exit" in got else None
        return self.report

    @staticmethod
    def likely(opts: DeployOptions) -> bool:
        if opts.dry_run or J.load(opts.store, opts.fleet) is not None:
            return False
        try:
            seal = json.loads(opts.lock.read_bytes())["seal"]  # (the lock's hash, as bundles record it)
            manifests = list((opts.root / "out" / "bundles" / opts.fleet).glob("*/manifest.json"))
            return bool(manifests) and all(json.loads(m.read_bytes()).get("lock_hash") == seal for m in manifests)
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            return False


def _progress_line(h: HostResult) -> None:
    sys.stderr.write(f"{h.name}: {h.status} ({h.seconds:.1f} s)\n")
    sys.stderr.flush()


def main(argv: list[str]) -> int:
    """The child: run the audit the request names; its JSON report on stdout, progress on stderr."""
    # (imported here, in the child only: the deploy goes on loading while the audit starts)
    from builder.audit import AuditOptions, run_audit
    from builder.errors import BuilderError

    req = json.loads(argv[0])
    fields: dict[str, Any] = {k: Path(v) if k in PATH_FIELDS else v for k, v in req.items()}
    opts = AuditOptions(**fields)
    try:
        report = run_audit(opts, on_host=_progress_line)
    except BuilderError as e:
        sys.stderr.write(f"error: {e}\n")
        return 2
    sys.stdout.write(json.dumps(report.to_json()))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
