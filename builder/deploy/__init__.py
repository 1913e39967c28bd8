"""Deploy: move a whole fleet to the lock, gated by the audit, rolled back as a whole if it fails.

- ``rollout``: ``deploy`` (stage everywhere, preflight gate, stop head then workers, switch, start
  workers then head, wait for the API, serving audit; any failure after the first change rolls every
  host back), ``start`` and ``stop`` (rank order);
- ``status``: which bundle, lock and image every host runs, and whether its rank is up;
- ``bundles``: the bundles a deploy ships (the current ones, or made again);
- ``hoststate``: one host's facts and steps over its one connection;
- ``fleetlock``: a fleet's commands never interleave (a lock file on the operator machine);
- ``journal``: what an unfinished deploy did, so a rerun after a kill converges;
- ``report``: per-host outcomes, JSON and the exit code.
"""

from __future__ import annotations

# (no imports here: `builder deploy` starts the likely no-op's audit before it loads the rest)
