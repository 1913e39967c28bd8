"""``builder lock``: every pinned input resolved to an immutable id and hash (resolve), one module per
kind of input (git sources, kits, plain files, Hub models, base and published images), the lock file
itself (lockfile) and what changed between two locks (diff)."""
