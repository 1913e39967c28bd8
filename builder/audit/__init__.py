"""`builder audit`: run the testinfra checks in checks/ against hosts, in parallel, and report.

1. Validate everything local first (`options`, `expect`): the options and the concerns they select
   (of those the check modules declare, `concerns`), the inventory, the pins (the
   fleet's lane exists), the lock (it has the lane and its models), the image plan. Any problem is
   one ConfigError line (exit 2) before a host is contacted.
2. Write one expectations file per host (`expect`), built only from the lock, the inventory, the
   placement rule and the image record in the store, never from the host.
3. Per host, in parallel threads (`runner`): a reachability probe with a bounded timeout (over ssh
   it opens the host's one connection, builder.foundation.ssh), then one pytest process over the check modules
   with testinfra's backend for that host. An unreachable host gives one `unreachable` result; the
   rest of the fleet is audited.
4. Merge the per-host results into the fleet's report (`report`): the matrix, JSON and JUnit.
Exit: 0 all pass, 1 drift (or a check errored), 3 a host unreachable (wins over 1).
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from builder.audit.concerns import Concern, declared
from builder.audit.exits import name_the_cause
from builder.audit.expect import build_expectations, load_lane_inputs
from builder.audit.findings import (
    AuditReport,
    CheckOutcome,
    HostResult,
    burn_rows,
    junit_xml,
    matrix_rows,
    problem_rows,
    write_junit,
)
from builder.audit.runner import run_host
from builder.audit.selection import AuditOptions, Loaded, audit_targets, parse_only
from builder.foundation.canon import run_folder
from builder.foundation.ssh import ControlSockets

__all__ = [
    "AuditOptions",
    "AuditReport",
    "CheckOutcome",
    "Concern",
    "HostResult",
    "Loaded",
    "declared",
    "junit_xml",
    "burn_rows",
    "matrix_rows",
    "problem_rows",
    "parse_only",
    "run_audit",
    "write_junit",
]


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
