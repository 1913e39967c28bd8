"""Deploy: move a whole fleet to the lock, gated by the audit, rolled back as a whole if it fails.

- ``rollout``: ``deploy``, step by step (bundles, facts, the no-op or the plan, stage everywhere, the
  preflight gate, the switch, the serving audit; any failure after the first change rolls back);
- ``dryrun``: the dry run's plan, the no-op (only audit), and what an unfinished deploy left;
- ``stage`` (and the gate on what was staged), ``derivations``, ``switch``, ``rollback``: the deploy's
  steps on the fleet, each the owner of its own;
- ``deployment``: one deploy's state (the fleet, report, bundles, journal) that those steps share;
- ``options``: what a fleet command is asked to do (made once by the command line, read by every
  step), and the command a message tells the operator to run;
- ``fleetwork``: one command's view of a fleet: its inventory and lane, its options, one connection
  per host, the hosts' facts;
- ``connections``: the command's one ssh connection per host, closed at its end;
- ``rankorder``: stop (the head first) and start (in the lane's order) of the lane's ranks;
- ``fleetaudit``: the fleet's audits over the command's connections, on the inputs it loaded;
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
