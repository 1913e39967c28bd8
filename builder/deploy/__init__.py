"""Deploy: move a whole fleet to the lock, gated by the audit, rolled back as a whole if it fails.

- ``rollout``: ``deploy``, step by step (bundles, facts, the no-op or the plan, stage everywhere, the
  preflight gate, the switch, the serving audit; any failure after the first change rolls back);
- ``dryrun``: the dry run's plan, the no-op (only audit), and what an unfinished deploy left;
- ``stage``, ``switch``, ``rollback``: the deploy's three moves on the fleet;
- ``deployment``: one deploy's state (the fleet, report, bundles, journal) that those steps share;
- ``fleetwork``: one command's view of a fleet: its inventory and lane, one connection per host, the
  hosts' facts, stop and start in rank order, the fleet's audits;
- ``startstop``: ``builder start`` and ``builder stop`` (rank order);
- ``status``: which bundle, lock and image every host runs, and whether its rank is up;
- ``bundles``: the bundles a deploy ships (the current ones, or made again);
- ``hoststate``: one host's facts and steps over its one connection (builder.hostscripts.lane on the host);
- ``fleetlock``: a fleet's commands never interleave (a lock file on the operator machine);
- ``journal``: what an unfinished deploy did, so a rerun after a kill converges;
- ``report``: per-host outcomes, JSON and the exit code.
"""

from __future__ import annotations

# (nothing is gathered here: callers import the module they use, builder.deploy.rollout and the rest)
