"""One audit: validate everything local, write each host's expectations, run every selected host's
checks in parallel threads (builder.audit.runner), and merge the hosts' results into the report."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from builder.audit.exits import name_the_cause
from builder.audit.expect import build_expectations, load_lane_inputs
from builder.audit.findings import AuditReport, HostResult
from builder.audit.runner import run_host
from builder.audit.selection import AuditOptions, audit_targets
from builder.foundation.canon import run_folder
from builder.foundation.ssh import ControlSockets


def run_audit(opts: AuditOptions, on_host: Callable[[HostResult], None] | None = None) -> AuditReport:
    """Validate, then audit every selected host in parallel. Raises ConfigError (exit 2) before any
    host is contacted. `on_host` is called (one at a time) as each host is done."""
    selected, checks_dir = opts.validate()
    concerns = [c.name for c in selected]
    targets = audit_targets(opts)
    opts.check_backend()
    inputs = load_lane_inputs(opts, targets)
    expectations = [build_expectations(t, opts, inputs, selected) for t in targets]

    start = time.monotonic()
    report_lock = threading.Lock()
    # every temporary folder is made inside the cleanup's scope: an error, Ctrl-C or SIGTERM right after
    # one is made removes it too (and one a SIGKILL left is removed by the next audit: run_folder)
    with contextlib.ExitStack() as cleanup:
        work = opts.workdir or cleanup.enter_context(run_folder("builder-audit-"))
        # the Ansible backend reaches hosts over Ansible's own connections: nothing here to keep
        sockets = ControlSockets.for_run(opts.ssh_persist if opts.backend == "native" else 0, opts.control_dir)
        cleanup.callback(sockets.cleanup)

        def one(i: int) -> HostResult:
            r = run_host(targets[i], opts, expectations[i], work, sockets, checks_dir, concerns)
            if on_host is not None:
                with report_lock:
                    on_host(r)
            return r

        with ThreadPoolExecutor(max_workers=max(1, min(32, len(targets)))) as ex:
            results = list(ex.map(one, range(len(targets))))
    return name_the_cause(AuditReport(
        hosts=results, mode=opts.mode, phase=opts.phase, concerns=concerns, seconds=time.monotonic() - start
    ))
