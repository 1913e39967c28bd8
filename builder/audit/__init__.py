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
4. Merge the per-host results into the fleet's report (`findings`): the matrix, JSON and JUnit.
Exit: 0 all pass, 1 drift (or a check errored), 3 a host unreachable (wins over 1).

`run.run_audit` does all four. The package itself imports nothing: each host's pytest imports
`concerns` from it, and should not pay for the operator side's models (pins, lock, inventory).
"""
