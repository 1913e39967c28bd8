#!/usr/bin/env python3
"""A logging `ssh`, put first on PATH for one audit (tests.lib.auditlib.install_ssh_logger): it appends
each call's arguments to a log as one JSON line, then runs the real ssh with them. Where the log is and
which ssh is real are in `ssh-logger.json` beside it. Standard library only."""

from __future__ import annotations

import json
import os
import sys


def main(args: list[str]) -> None:
    with open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "ssh-logger.json")) as f:
        conf = json.load(f)
    with open(conf["log"], "a") as f:
        f.write(json.dumps(args) + "\n")
    os.execv(conf["ssh"], ["ssh", *args])


if __name__ == "__main__":
    main(sys.argv[1:])
